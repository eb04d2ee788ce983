"""Compose the DeepSpeed dict: a pure function of (config, world size, model dimensions, device).

No torch, no deepspeed, no I/O. Everything DeepSpeed would accept silently but wrongly (parameter
offload below stage 3, "auto" strings, unknown top-level keys, fp16 and bf16 together, batch sizes
that do not multiply out) is rejected here with a one-line `LauncherError` that names the key and
the fix. `launcher.validate` runs DeepSpeed's own pydantic models on the result as a second check.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from launcher.core.errors import LauncherError

# Every top-level key DeepSpeed 0.19 reads (tests check each against DeepSpeed's source). DeepSpeed
# ignores any other top-level key without a word, so a typo would silently change nothing.
KNOWN_TOP_LEVEL_KEYS = frozenset(
    {
        "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint",
        "comet", "comms_logger", "communication_data_type", "compile", "compression_training",
        "csv_monitor", "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last",
        "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity",
        "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op",
        "gradient_clipping", "gradient_predivide_factor", "graph_harvesting", "hybrid_engine",
        "log_level", "managed_gradient_accumulation", "memory_breakdown", "nebula", "optimizer",
        "pipeline", "prescale_gradients", "progressive_layer_drop", "quantize_training", "scheduler",
        "seq_parallel_communication_data_type", "sequence_parallel_size", "sparse_attention",
        "sparse_gradients", "steps_per_print", "tensor_parallel", "tensorboard", "timers",
        "torch_autocast", "train_batch_size", "train_micro_batch_size_per_gpu",
        "use_data_before_expert_parallelism", "wall_clock_breakdown", "wandb", "weight_quantization",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "zero_optimization",
    }
)  # fmt: skip

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
COMM_KEYS = (
    "overlap_comm",
    "contiguous_gradients",
    "reduce_scatter",
    "allgather_partitions",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold",
)
STAGE3_ZERO_KEYS = (
    "stage3_max_live_parameters",
    "stage3_max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "sub_group_size",
)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# Which config group owns which part of the DeepSpeed dict. When a `deepspeed_json` base is given,
# a group named on the command line replaces the base's keys that it owns.
OWNERS: dict[str, str] = {
    "zero_optimization.stage": "zero",
    **{f"zero_optimization.{key}": "zero" for key in STAGE3_ZERO_KEYS},
    "zero_optimization.offload_optimizer": "offload",
    "zero_optimization.offload_param": "offload",
    **{f"zero_optimization.{key}": "comm" for key in COMM_KEYS},
    "fp16": "precision",
    "bf16": "precision",
    **{key: "train" for key in (*BATCH_KEYS, "gradient_clipping", "optimizer", "scheduler")},
}
# What one train.* key named on the command line owns of a base JSON (paths as in `_fill_table`); a
# `train=` choice owns all of OWNERS' "train" entries instead. Any other train.* key owns nothing there.
TRAIN_KEY_OWNS: dict[str, tuple[str, ...]] = {
    "train.micro_batch_size": ("train_micro_batch_size_per_gpu",),
    "train.grad_accum": ("gradient_accumulation_steps",),
    "train.global_batch_size": ("train_batch_size",),
    "train.grad_clip": ("gradient_clipping",),
    "train.lr": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "train.betas": ("optimizer.params.betas",),
    "train.eps": ("optimizer.params.eps",),
    "train.weight_decay": ("optimizer.params.weight_decay",),
    "train.max_steps": ("scheduler.params.total_num_steps",),
    "train.warmup_steps": ("scheduler.params.warmup_num_steps",),
    "train.min_lr_ratio": ("scheduler.params.cos_min_ratio",),
}
# The train.* batch keys and the DeepSpeed keys they name, in the order a base JSON's values are kept.
TRAIN_BATCH_KEYS = {
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "grad_accum": "gradient_accumulation_steps",
    "global_batch_size": "train_batch_size",
}
# Blocks taken whole from the base when it has them: their params depend on their "type".
ATOMIC_BLOCKS = ("optimizer", "scheduler")


@dataclass(frozen=True)
class Device:
    """What the training device can do; `launcher.validate.detect_device` fills it in."""

    kind: str  # "cpu" or "cuda"
    bf16: bool
    fp16: bool
    name: str = ""


@dataclass(frozen=True)
class BatchSizes:
    micro: int
    accum: int
    total: int  # micro x accum x world size: what DeepSpeed calls train_batch_size


def resolve_batch_sizes(micro: int | None, accum: int | None, total: int | None, world_size: int) -> BatchSizes:
    """Derive the missing one of (micro batch per device, accumulation steps, global batch).

    total = micro x accum x world_size. Any two determine the third; micro alone means accum=1.
    """
    if world_size < 1:
        raise LauncherError(f"world size must be at least 1, got {world_size}")
    for key, value in (
        ("train.micro_batch_size", micro),
        ("train.grad_accum", accum),
        ("train.global_batch_size", total),
    ):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise LauncherError(f"{key}={value} must be a positive integer")
    if micro is not None and accum is None and total is None:
        accum = 1
    if micro is not None and accum is not None:
        if total is not None and total != micro * accum * world_size:
            raise LauncherError(
                f"inconsistent batch sizes: train.global_batch_size={total} but train.micro_batch_size="
                f"{micro} x train.grad_accum={accum} x world size {world_size} = {micro * accum * world_size};"
                " give only two of the three"
            )
        return BatchSizes(micro, accum, micro * accum * world_size)
    if total is None:
        raise LauncherError(
            "batch size is underdetermined: give two of train.micro_batch_size, train.grad_accum and "
            "train.global_batch_size"
        )
    known_key, known = ("train.micro_batch_size", micro) if micro is not None else ("train.grad_accum", accum)
    if known is None:
        raise LauncherError(
            "batch size is underdetermined: with train.global_batch_size also give train.micro_batch_size "
            "or train.grad_accum"
        )
    if total % (known * world_size):
        raise LauncherError(
            f"train.global_batch_size={total} is not divisible by {known_key}={known} x world size "
            f"{world_size} = {known * world_size}; pick a global batch that is a multiple of it"
        )
    other = total // (known * world_size)
    if micro is not None:
        return BatchSizes(micro=known, accum=other, total=total)
    return BatchSizes(micro=other, accum=known, total=total)


def fastest_precisions(kind: str) -> tuple[str, ...]:
    """The training dtypes, fastest first on a device of this kind (`precision=auto` and the planner).

    On a GPU 16-bit math is the fast path (bf16 before fp16: no loss scaling). On a CPU it is not, even
    with avx512_bf16: the built-in job (`python train.py precision=fp32|bf16 train.max_steps=120
    logger=none`, 2 cores, torch 2.13, three alternating runs each, steps 11-120) took a median 0.068-0.074
    s per step in fp32 (430-470 samples/s) against 0.086-0.106 s in bf16 (300-370 samples/s), and
    0.087-0.097 against 0.107-0.132 CPU-seconds per step; a user's sweep on the same kind of machine saw
    411 against 78.8 samples/s. So fp32 comes first on a CPU."""
    return ("fp32", "bf16", "fp16") if kind == "cpu" else ("bf16", "fp16", "fp32")


def resolve_precision(requested: str, device: Device) -> str:
    """Map the precision group's dtype to fp32/bf16/fp16, refusing what the device cannot do.

    `auto` is the fastest dtype the device supports (`fastest_precisions`): bf16 on a GPU that has it,
    else fp16 on a GPU, and fp32 on a CPU."""
    if requested not in PRECISIONS:
        raise LauncherError(f"precision.dtype={requested} is unknown: use one of {', '.join(PRECISIONS)}")
    if requested == "auto":
        supported = {"fp32": True, "bf16": device.bf16, "fp16": device.fp16 and device.kind != "cpu"}
        return next(dtype for dtype in fastest_precisions(device.kind) if supported[dtype])
    if requested == "fp16" and not device.fp16:
        raise LauncherError(
            f"precision=fp16 is not supported on this {device.kind} {device.name}".rstrip()
            + ": use precision=bf16 or precision=fp32"
        )
    if requested == "bf16" and not device.bf16:
        alternative = "precision=fp16 or precision=fp32" if device.fp16 else "precision=fp32"
        raise LauncherError(
            f"precision=bf16 is not supported on this {device.kind} {device.name}".rstrip() + f": use {alternative}"
        )
    return requested


def derived_bucket_sizes(hidden_size: int) -> dict[str, int]:
    """Bucket sizes for `comm=default`, scaled to the language model's hidden size h.

    A bucket of h*h elements holds about one projection matrix; prefetching 0.9 of that keeps one
    layer in flight at stage 3; parameters under 10*h elements (norms, biases) are small enough to
    keep unpartitioned. Integers: DeepSpeed rejects fractional sizes.
    """
    if hidden_size < 1:
        raise LauncherError(f"model hidden size must be positive, got {hidden_size}")
    h = hidden_size
    return {
        "reduce_bucket_size": h * h,
        "allgather_bucket_size": h * h,
        "stage3_prefetch_bucket_size": round(0.9 * h * h),
        "stage3_param_persistence_threshold": 10 * h,
    }


def warmup_steps(train: Mapping[str, Any]) -> int:
    """Linear warm-up length: as given, or warmup_ratio of the run, or 5% of it (DeepSpeed's
    WarmupCosineLR needs >= 1). A ratio rounds up, as the HF Trainer's does."""
    given, ratio = train["warmup_steps"], train.get("warmup_ratio")
    if given is not None:
        return int(given)
    if ratio is not None:
        return max(1, math.ceil(float(ratio) * int(train["max_steps"])))
    return max(1, int(train["max_steps"]) // 20)


def _check_train(train: Mapping[str, Any]) -> None:
    epochs, ratio = train.get("epochs"), train.get("warmup_ratio")
    if epochs is not None and not (math.isfinite(epochs) and epochs > 0):
        raise LauncherError(f"train.epochs={epochs} must be a positive number of passes over the data")
    if ratio is not None and not 0 <= ratio < 1:
        raise LauncherError(f"train.warmup_ratio={ratio} must be a fraction in [0, 1), e.g. 0.03")
    if train["max_steps"] is None:  # launcher.entry turns train.epochs into steps before planning
        raise LauncherError(
            "train.max_steps=null and train.epochs=null: give the training length, e.g. train.max_steps=1000 "
            "or train.epochs=1"
        )
    positive = ("max_steps", "lr", "log_every")
    non_negative = ("weight_decay", "grad_clip", "eval_every", "save_every", "eps")
    for key in positive:
        if not train[key] > 0:
            raise LauncherError(f"train.{key}={train[key]} must be positive")
    for key in non_negative:
        if train[key] < 0:
            raise LauncherError(f"train.{key}={train[key]} must not be negative")
    for key in (*positive, *non_negative, "min_lr_ratio"):
        if not math.isfinite(train[key]):
            raise LauncherError(f"train.{key}={train[key]} must be a finite number")
    betas = train["betas"]
    if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
        raise LauncherError(f"train.betas={list(betas)} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if train["warmup_steps"] is not None and not 1 <= train["warmup_steps"] < train["max_steps"]:
        raise LauncherError(
            f"train.warmup_steps={train['warmup_steps']} must lie in [1, train.max_steps={train['max_steps']}) "
            "(DeepSpeed's WarmupCosineLR needs at least one warm-up step)"
        )
    if not 0 <= train["min_lr_ratio"] <= 1:
        raise LauncherError(f"train.min_lr_ratio={train['min_lr_ratio']} must lie in [0, 1]")


def _offload_block(device: str, offload: Mapping[str, Any], *, param: bool) -> dict[str, Any]:
    if device not in OFFLOAD_DEVICES:
        which = "param" if param else "optimizer"
        raise LauncherError(f"offload.{which}={device} is unknown: use one of {', '.join(OFFLOAD_DEVICES)}")
    block: dict[str, Any] = {"device": device, "pin_memory": bool(offload["pin_memory"])}
    if device == "nvme":
        block["nvme_path"] = offload["nvme_path"]
        if param:
            block.update(
                {
                    key: offload[key]
                    for key in ("buffer_count", "buffer_size", "max_in_cpu")
                    if offload.get(key) is not None
                }
            )
    return block


def _composed(cfg: Mapping[str, Any], batch: BatchSizes, dtype: str, hidden_size: int) -> dict[str, Any]:
    """The dict the groups alone describe (no base JSON, no extra)."""
    zero, comm, offload, train = cfg["zero"], cfg["comm"], cfg["offload"], cfg["train"]
    stage = zero["stage"]
    if stage not in (0, 1, 2, 3):
        raise LauncherError(f"zero.stage={stage} is unknown: use zero=stage0, stage1, stage2 or stage3")
    zero_block: dict[str, Any] = {"stage": stage}
    if stage > 0:
        buckets = derived_bucket_sizes(hidden_size)
        for key in COMM_KEYS:
            if stage < 3 and key.startswith("stage3_"):
                continue
            if stage == 3 and key in ("allgather_bucket_size", "allgather_partitions", "reduce_scatter"):
                continue  # stage 3 gathers by prefetch buckets instead
            value = comm[key]
            zero_block[key] = buckets[key] if value is None else value
    if stage == 3:
        # null: left out, so DeepSpeed applies its own default.
        zero_block.update({key: zero[key] for key in STAGE3_ZERO_KEYS if zero.get(key) is not None})
    if offload["optimizer"] != "none":
        zero_block["offload_optimizer"] = _offload_block(offload["optimizer"], offload, param=False)
    if offload["param"] != "none":
        zero_block["offload_param"] = _offload_block(offload["param"], offload, param=True)

    fp16: dict[str, Any] = {"enabled": dtype == "fp16"}
    if dtype == "fp16":
        precision = cfg["precision"]
        scaling = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
        # null (precision=auto on a GPU without bf16): left out, DeepSpeed's defaults apply.
        fp16.update({key: precision[key] for key in scaling if precision.get(key) is not None})
    return {
        "train_batch_size": batch.total,
        "train_micro_batch_size_per_gpu": batch.micro,
        "gradient_accumulation_steps": batch.accum,
        "gradient_clipping": float(train["grad_clip"]),
        "steps_per_print": train["log_every"],
        "wall_clock_breakdown": False,
        "zero_optimization": zero_block,
        "fp16": fp16,
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": float(train["lr"]),
                "betas": [float(b) for b in train["betas"]],
                "eps": float(train["eps"]),
                "weight_decay": float(train["weight_decay"]),
                # torch's fused AdamW: DeepSpeed would JIT-compile its fused_adam op (a minute) for the
                # same update at the same speed (bench/optimizer.py). Offloaded optimizer states keep
                # DeepSpeed's compiled CPU Adam (launcher.ops).
                **({} if offload["optimizer"] != "none" else {"torch_adam": True, "fused": True}),
            },
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": train["max_steps"],
                "warmup_num_steps": warmup_steps(train),
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": float(train["min_lr_ratio"]),
                "warmup_type": "linear",
            },
        },
    }


def _fill_table(cfg: Mapping[str, Any], batch: BatchSizes, dtype: str, hidden_size: int) -> dict[str, Any]:
    """Values for "auto"/null leaves of a base JSON, keyed by dotted path (scheduler params by name)."""
    train = cfg["train"]
    buckets = derived_bucket_sizes(hidden_size)
    return {
        "train_batch_size": batch.total,
        "train_micro_batch_size_per_gpu": batch.micro,
        "gradient_accumulation_steps": batch.accum,
        "gradient_clipping": float(train["grad_clip"]),
        "fp16.enabled": dtype == "fp16",
        "bf16.enabled": dtype == "bf16",
        **{f"zero_optimization.{key}": value for key, value in buckets.items()},
        "optimizer.params.lr": float(train["lr"]),
        "optimizer.params.betas": [float(b) for b in train["betas"]],
        "optimizer.params.eps": float(train["eps"]),
        "optimizer.params.weight_decay": float(train["weight_decay"]),
        # Scheduler params, whatever the scheduler type of the base file.
        "scheduler.params.total_num_steps": train["max_steps"],
        "scheduler.params.warmup_num_steps": warmup_steps(train),
        "scheduler.params.warmup_max_lr": float(train["lr"]),
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_min_ratio": 0.0,
        "scheduler.params.cos_min_ratio": float(train["min_lr_ratio"]),
    }


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def _get(tree: Mapping[str, Any], path: str, default: Any = None) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        child = tree.get(part)
        if not isinstance(child, dict):
            child = tree[part] = {}
        tree = child
    tree[last] = value


def _delete(tree: dict[str, Any], path: str) -> None:
    *parents, last = path.split(".")
    for part in parents:
        tree = tree.get(part)
        if not isinstance(tree, dict):
            return
    tree.pop(last, None)


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: `override` merged into `base`, recursively for nested mappings."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _is_unset(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value.lower() == "auto")


def _owned_paths(explicit_groups: frozenset[str]) -> dict[str, str]:
    """The base JSON's paths the command line replaces, each with the group or train.* key that owns it."""
    owned = {path: group for path, group in OWNERS.items() if group in explicit_groups}
    if "train" not in explicit_groups:
        for key, paths in TRAIN_KEY_OWNS.items():
            if key in explicit_groups:
                owned.update(dict.fromkeys(paths, key))
    return owned


def _merge_onto_base(
    base: Mapping[str, Any],
    composed: dict[str, Any],
    fill: Mapping[str, Any],
    explicit_groups: frozenset[str],
    source: str,
) -> dict[str, Any]:
    """Start from a user's DeepSpeed JSON: what the command line names replaces what it owns (a group
    its keys, a train.* key only its own values); otherwise the composition only fills keys the base
    lacks or leaves "auto"/null. The batch keys are the resolved ones (`_batch_givens` read the base's)."""
    merged = copy.deepcopy(dict(base))
    for path, owner in _owned_paths(explicit_groups).items():
        if "." not in owner:
            _delete(merged, path)  # a group: the composition fills it in again
        elif _get(merged, path, "absent") != "absent":
            _set(merged, path, copy.deepcopy(fill[path]))
    _check_overrides_land(merged, composed, explicit_groups, source)
    for key in BATCH_KEYS:
        if key in merged:
            merged[key] = composed[key]
    for block in ATOMIC_BLOCKS:
        if block in merged:  # taken whole: its params depend on its "type"
            composed = {key: value for key, value in composed.items() if key != block}
    for path, value in _leaves(composed):
        if _is_unset(_get(merged, path)):
            _set(merged, path, copy.deepcopy(value))
    for path, value in list(_leaves(merged)):
        if _is_unset(value):
            if path not in fill:
                raise LauncherError(f'{source}: cannot fill "{value}" at {path}; set a value there or remove the key')
            _set(merged, path, copy.deepcopy(fill[path]))
    return merged


def _check_overrides_land(
    merged: Mapping[str, Any], composed: Mapping[str, Any], explicit_groups: frozenset[str], source: str
) -> None:
    """A train.* key that only sets optimizer or scheduler params must find one: the base's own
    optimizer/scheduler block is kept whole, and a param it lacks would silently not be set.
    (train.max_steps also ends the run, so it never changes nothing.)"""
    if "train" in explicit_groups:
        return
    for key, paths in TRAIN_KEY_OWNS.items():
        if key not in explicit_groups or key == "train.max_steps":
            continue
        if not all(path.split(".", 1)[0] in ATOMIC_BLOCKS for path in paths):
            continue
        tree_of = {path: merged if path.split(".", 1)[0] in merged else composed for path in paths}
        if any(_get(tree_of[path], path, "absent") != "absent" for path in paths):
            continue
        block, name = paths[0].split(".", 1)[0], paths[0].rsplit(".", 1)[1]
        raise LauncherError(
            f"{key} would change nothing: the {block} of {source} (type {_get(merged, block + '.type')}) has no "
            f'params.{name}; drop the override, or add "{name}": "auto" to its params (filled from {key}) if '
            "that type takes it"
        )


def check_ds_config(ds: Mapping[str, Any], *, world_size: int, device: Device) -> None:
    """Rules between keys of the final dict, whichever source (groups, base JSON, extra) set them."""
    unknown = sorted(set(ds) - KNOWN_TOP_LEVEL_KEYS)
    if unknown:
        raise LauncherError(
            f"unknown DeepSpeed key {unknown[0]!r} (from deepspeed_extra or deepspeed_json); DeepSpeed would "
            "silently ignore it: check the spelling against the DeepSpeed config docs"
        )
    for path, value in _leaves(ds):
        if isinstance(value, str) and value.lower() == "auto":
            raise LauncherError(f'{path}="auto" would be silently dropped by DeepSpeed: give a value')

    total, micro, accum = (ds.get(key) for key in BATCH_KEYS)
    for key, value in zip(BATCH_KEYS, (total, micro, accum), strict=True):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LauncherError(f"{key}={value} must be a positive integer")
    if total != micro * accum * world_size:
        raise LauncherError(
            f"inconsistent batch sizes: train_batch_size={total} but train_micro_batch_size_per_gpu={micro} "
            f"x gradient_accumulation_steps={accum} x world size {world_size} = {micro * accum * world_size}"
        )

    fp16 = bool(_get(ds, "fp16.enabled", False))
    bf16 = bool(_get(ds, "bf16.enabled", False)) or bool(_get(ds, "bfloat16.enabled", False))
    if "bf16" in ds and "bfloat16" in ds:
        raise LauncherError('"bf16" and its older spelling "bfloat16" are both set: keep only "bf16"')
    if fp16 and bf16:
        raise LauncherError(
            "fp16 and bf16 are both enabled (check precision=, deepspeed_extra and deepspeed_json): enable one of them"
        )
    if fp16:
        resolve_precision("fp16", device)
    if bf16:
        resolve_precision("bf16", device)

    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    offload_param = (zero.get("offload_param") or {}).get("device", "none")
    offload_optimizer = (zero.get("offload_optimizer") or {}).get("device", "none")
    if offload_param not in OFFLOAD_DEVICES or offload_optimizer not in OFFLOAD_DEVICES:
        raise LauncherError(
            f"offload device must be one of {', '.join(OFFLOAD_DEVICES)}, got "
            f"optimizer={offload_optimizer}, param={offload_param}"
        )
    if offload_param != "none" and stage < 3:
        raise LauncherError(
            f"parameter offload (offload_param.device={offload_param}) needs ZeRO stage 3, but zero stage is "
            f"{stage}: use zero=stage3 (or deepspeed=z3_offload), or offload=optimizer"
        )
    if offload_optimizer == "nvme" and stage < 3:
        raise LauncherError(
            f"NVMe optimizer offload needs ZeRO stage 3, but zero stage is {stage}: use zero=stage3 "
            "(deepspeed=z3_nvme), or offload=optimizer for CPU offload"
        )
    if offload_optimizer != "none" and stage == 0:
        raise LauncherError(
            "optimizer offload needs ZeRO stage 1, 2 or 3, but zero stage is 0: use zero=stage2 "
            "(deepspeed=z2_offload) or offload=none"
        )
    for which in ("offload_param", "offload_optimizer"):
        block = zero.get(which) or {}
        if block.get("device") == "nvme" and not block.get("nvme_path"):
            raise LauncherError(
                f"{which}.device=nvme needs a directory: set offload.nvme_path=/path/on/a/local/nvme/disk"
            )
    for key in COMM_KEYS:
        value = zero.get(key)
        if key.endswith("_size") or key.endswith("_threshold"):
            if value is not None and (isinstance(value, bool) or not float(value).is_integer()):
                raise LauncherError(f"zero_optimization.{key}={value} must be a whole number of elements")
            if value is not None and value < (0 if key.endswith("_threshold") else 1):
                raise LauncherError(f"zero_optimization.{key}={value} must be positive")
    clip = ds.get("gradient_clipping", 0)
    if not isinstance(clip, int | float) or clip < 0:
        raise LauncherError(f"gradient_clipping={clip} must be a non-negative number (0 disables clipping)")


@dataclass(frozen=True)
class _Given:
    """One batch size to resolve and where it came from, so that an error can say so."""

    value: Any
    key: str  # train.micro_batch_size, ...
    ds_key: str  # train_micro_batch_size_per_gpu, ...
    origin: str  # "override" (named on the command line), "default" (the train node) or "file"
    file: str = ""  # the base JSON, for origin "file"

    def said(self, *, file_named: bool = False) -> str:
        if self.origin == "override":
            return f"{self.key}={self.value}"
        if self.origin == "default":
            return f"the default {self.key}={self.value}"
        if file_named:
            return f"the file's {self.ds_key}={self.value}"
        return f"{self.ds_key}={self.value} (from {self.file})"

    def subject(self) -> str:
        """As the start of a sentence: a file's value names the file."""
        return f"{self.file} sets {self.ds_key}={self.value}" if self.origin == "file" else self.said()


def _batch_givens(
    train: Mapping[str, Any], base: Mapping[str, Any] | None, explicit_groups: frozenset[str], source: str
) -> tuple[_Given, _Given, _Given]:
    """(micro, accumulation, global) to resolve, each with where it came from.

    Batch keys named on the command line win (a `train=` choice names all three). A base JSON's
    concrete values fill the others: with none named, all of them (they must agree); else its micro
    batch, then its accumulation, then its global batch, until two are known (the third is derived).
    If the batch is still open, the train node's values fill in (its micro batch first)."""
    named = {name for name in TRAIN_BATCH_KEYS if "train" in explicit_groups or f"train.{name}" in explicit_groups}
    ours = {
        name: _Given(train[name], f"train.{name}", ds_key, "override" if name in named else "default")
        for name, ds_key in TRAIN_BATCH_KEYS.items()
    }
    files = {
        name: _Given(base[ds_key], f"train.{name}", ds_key, "file", source)
        for name, ds_key in TRAIN_BATCH_KEYS.items()
        if base is not None and name not in named and not _is_unset(base.get(ds_key))
    }
    if not files:
        return ours["micro_batch_size"], ours["grad_accum"], ours["global_batch_size"]
    givens = {name: ours[name] for name in named}
    for name, given in files.items():
        if named and sum(g.value is not None for g in givens.values()) >= 2:
            break
        givens[name] = given
    for name, given in ours.items():
        if _determined(*(givens[n].value if n in givens else None for n in TRAIN_BATCH_KEYS)):
            break
        givens.setdefault(name, given)
    unset = {name: _Given(None, given.key, given.ds_key, given.origin) for name, given in ours.items()}
    micro, accum, total = ({**unset, **givens}[name] for name in TRAIN_BATCH_KEYS)
    return micro, accum, total


def _determined(micro: Any, accum: Any, total: Any) -> bool:
    """Whether (micro, accumulation, global) fix the batch: a micro batch alone means accumulation 1."""
    return micro is not None or (accum is not None and total is not None)


def _resolve_givens(givens: tuple[_Given, _Given, _Given], world_size: int) -> BatchSizes:
    """`resolve_batch_sizes`, with errors that name where each number came from when a base JSON
    gave some of them: the file's keys, the user's overrides and the defaults involved."""
    micro, accum, total = givens
    if world_size < 1 or all(given.origin != "file" for given in givens):
        return resolve_batch_sizes(micro.value, accum.value, total.value, world_size)
    for given in givens:
        value = given.value
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            if given.origin == "file":
                raise LauncherError(
                    f'{given.file} sets {given.ds_key}={value}, which must be a positive integer (or "auto" to '
                    f"derive it): fix it in the file, or set {given.key}"
                )
            raise LauncherError(f"{given.key}={value} must be a positive integer")
    m, a, t = micro.value, accum.value, total.value
    if m is not None and a is not None and t is not None and t != m * a * world_size:
        if all(given.origin == "file" for given in givens):
            fix = (
                'set one of them to "auto" in the file (it is then derived), or override one with '
                "train.global_batch_size, train.micro_batch_size or train.grad_accum"
            )
        else:
            fix = _batch_fix(givens)
        file_named = total.origin == "file"
        raise LauncherError(
            f"inconsistent batch sizes: {total.subject()}, but {micro.said(file_named=file_named)} x "
            f"{accum.said(file_named=file_named)} x world size {world_size} = {m * a * world_size}: {fix}"
        )
    if t is not None and (m is None) != (a is None):
        known = micro if m is not None else accum
        if t % (known.value * world_size):
            times = f" = {known.value * world_size}" if world_size > 1 else ""
            raise LauncherError(
                f"{total.subject()}{', which' if total.origin == 'file' else ''} is not divisible by "
                f"{known.said(file_named=total.origin == 'file')} x world size {world_size}{times}: "
                f"{_batch_fix((total, known))}"
            )
    if not _determined(m, a, t):
        known = ", ".join(given.said() for given in givens if given.value is not None)
        file = next(given.file for given in givens if given.origin == "file")
        raise LauncherError(
            f"batch size is underdetermined ({known}): give two of train.micro_batch_size, train.grad_accum and "
            f"train.global_batch_size, or set them in {file}"
        )
    return resolve_batch_sizes(m, a, t, world_size)


def _batch_fix(involved: tuple[_Given, ...]) -> str:
    """What to change: a default the user never set, else the overrides and the file's keys involved."""
    defaults = [given for given in involved if given.origin == "default"]
    if defaults:
        return "set " + " or ".join(f"{given.key} (or {given.ds_key} in the file)" for given in defaults)
    options = [" or ".join(given.key for given in involved if given.origin == "override")]
    files = [given for given in involved if given.origin == "file"]
    if files:
        options.append(
            f"{' or '.join(given.ds_key for given in files)} in the file "
            f"(or set {' or '.join(given.key for given in files)})"
        )
    return "change " + ", or ".join(option for option in options if option)


def build_ds_config(
    cfg: Mapping[str, Any],
    *,
    world_size: int,
    hidden_size: int,
    device: Device,
    base: Mapping[str, Any] | None = None,
    base_source: str = "deepspeed_json",
    explicit_groups: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """The validated DeepSpeed dict for a composed config (as a plain dict).

    `hidden_size` is the language model's hidden size (for bucket sizes). `base` is a user's own
    DeepSpeed JSON; `explicit_groups` (`explicit_groups_from_overrides`) are what the command line
    names, which overrides it: a group what it owns (OWNERS), a train.* key its own values.
    """
    _check_train(cfg["train"])
    if base is not None:
        base = with_bf16_spelling(base, base_source)
    batch = _resolve_givens(_batch_givens(cfg["train"], base, explicit_groups, base_source), world_size)
    dtype = resolve_precision(cfg["precision"]["dtype"], device)
    composed = _composed(cfg, batch, dtype, hidden_size)
    if base is not None:
        unknown = sorted(set(base) - KNOWN_TOP_LEVEL_KEYS)
        if unknown:
            raise LauncherError(
                f"{base_source}: unknown DeepSpeed key {unknown[0]!r}; DeepSpeed would silently ignore it: "
                "fix or remove it"
            )
        composed = _merge_onto_base(
            base, composed, _fill_table(cfg, batch, dtype, hidden_size), explicit_groups, base_source
        )
    extra = with_bf16_spelling(cfg.get("deepspeed_extra") or {}, "deepspeed_extra")
    unknown = sorted(set(extra) - KNOWN_TOP_LEVEL_KEYS)
    if unknown:
        raise LauncherError(
            f"deepspeed_extra.{unknown[0]} is not a DeepSpeed key; DeepSpeed would silently ignore it: "
            "check the spelling against the DeepSpeed config docs"
        )
    final = deep_merge(composed, extra)
    check_ds_config(final, world_size=world_size, device=device)
    return final


def precision_of(ds: Mapping[str, Any]) -> str:
    """The training dtype a DeepSpeed dict selects: fp16, bf16 or fp32.

    The one answer to "which precision is this" (summary, checkpoints, planner). DeepSpeed reads the
    "bf16" block and only falls back to its older spelling "bfloat16" when "bf16" is absent."""
    if _enabled(_get(ds, "fp16.enabled", False)):
        return "fp16"
    bf16 = ds.get("bf16") if "bf16" in ds else ds.get("bfloat16")
    if isinstance(bf16, Mapping) and _enabled(bf16.get("enabled", False)):
        return "bf16"
    return "fp32"


# The offload group's choices (conf/offload), by the devices they put (optimizer states, parameters) on.
OFFLOAD_CHOICES = {
    ("none", "none"): "none",
    ("cpu", "none"): "optimizer",
    ("none", "cpu"): "param",
    ("cpu", "cpu"): "all",
    ("nvme", "nvme"): "nvme",
}


def offload_of(ds: Mapping[str, Any]) -> str:
    """The offload a DeepSpeed dict trains with, named as the offload group names it (`all`: optimizer
    states and parameters on the CPU); a mix no choice makes reads `optimizer:cpu,param:nvme`."""
    zero = ds.get("zero_optimization") or {}
    optimizer, param = (
        str((zero.get(key) or {}).get("device") or "none").lower() for key in ("offload_optimizer", "offload_param")
    )
    return OFFLOAD_CHOICES.get((optimizer, param), f"optimizer:{optimizer},param:{param}")


def labelled_choices(
    choices: Mapping[str, Any], ds: Mapping[str, Any], *, device: Device, deepspeed_json: str | None = None
) -> dict[str, Any]:
    """The group choices that say what a run trains with, for everything that labels and compares runs
    (summary.json, the comparison's columns, W&B tags): the final DeepSpeed dict decides, not Hydra.

    Hydra's choices, with `zero`, `offload` and `precision` replaced where the dict says otherwise (a
    `deepspeed_json` base or `deepspeed_extra` overrode them), and `deepspeed=json:FILE` when a JSON was
    the base: a ZeRO-3 offload JSON reads `deepspeed=json:ds.json zero=stage3 offload=all precision=bf16`,
    not the default preset it was composed over. `precision=auto` stays where auto chose the dict's dtype.
    A run composed from the groups alone keeps its choices."""
    labels = dict(choices)
    found = {
        "zero": f"stage{(ds.get('zero_optimization') or {}).get('stage', 0)}",
        "offload": offload_of(ds),
        "precision": precision_of(ds),
    }
    for group, value in found.items():
        chose = labels.get(group)
        if group not in labels or chose == value:
            continue
        if group == "precision" and chose == "auto" and resolve_precision("auto", device) == value:
            continue
        labels[group] = value
    if deepspeed_json:
        labels["deepspeed"] = f"json:{PurePath(deepspeed_json).name}"
    return labels


def _enabled(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


def with_bf16_spelling(tree: Mapping[str, Any], source: str) -> dict[str, Any]:
    """`tree` with DeepSpeed's older key "bfloat16" renamed to "bf16".

    DeepSpeed reads "bf16" first: a composed `"bf16": {"enabled": false}` next to a user's
    `"bfloat16": {"enabled": true}` would silently train in fp32."""
    if "bfloat16" not in tree:
        return dict(tree)
    if "bf16" in tree:
        raise LauncherError(f'{source}: has both "bf16" and its older spelling "bfloat16": keep only "bf16"')
    return {("bf16" if key == "bfloat16" else key): value for key, value in tree.items()}


def explicit_groups_from_overrides(overrides: list[str]) -> frozenset[str]:
    """Groups the user named on the command line (a `deepspeed=` preset names zero and offload).

    A train.* override is named by its key ("train.lr"): it owns only its own values of a base JSON
    (TRAIN_KEY_OWNS). "train" alone means the group itself was chosen (`train=...`)."""
    groups: set[str] = set()
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        top, _, rest = key.partition(".")
        top = top.split("@", 1)[0]
        if top == "deepspeed":
            groups.update(("zero", "offload"))
        elif top == "train" and rest:
            groups.add("train." + rest.split(".", 1)[0].split("[", 1)[0])
        elif top in ("zero", "precision", "offload", "comm", "train"):
            groups.add(top)
    return frozenset(groups)
