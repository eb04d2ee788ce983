"""Compose the DeepSpeed dict: a pure function of (config, world size, model dimensions, device).

No torch, no deepspeed, no I/O. Everything DeepSpeed would accept silently but wrongly (parameter
offload below stage 3, "auto" strings, unknown top-level keys, fp16 and bf16 together, batch sizes
that do not multiply out) is rejected here with a one-line `LauncherError` that names the key and
the fix. `launcher.job.checks` runs DeepSpeed's own pydantic models on the result as a second check.
The config's ranges were checked before (launcher.config.ranges); the training knobs' DeepSpeed keys
come from one table (launcher.config.knobs), the batch arithmetic from launcher.config.batch.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from launcher.config.batch import BATCH_KEYS, BatchSizes, batch_givens, resolve_givens
from launcher.config.knobs import TRAIN_KEY_OWNS, train_values
from launcher.config.precision import OFFLOAD_DEVICES, Device, resolve_precision, with_bf16_spelling
from launcher.config.tree import deep_merge, delete, get, is_unset, leaves, set_path
from launcher.core.errors import LauncherError
from launcher.core.overrides import override_key

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

# Which config group owns which part of the DeepSpeed dict. When a `deepspeed_json` base is given,
# a group named on the command line replaces the base's keys that it owns (a `train=` choice: every
# training key; a single train.* key only its own values, launcher.config.knobs.TRAIN_KEY_OWNS).
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
# Blocks taken whole from the base when it has them: their params depend on their "type".
ATOMIC_BLOCKS = ("optimizer", "scheduler")


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
    composed: dict[str, Any] = {
        "train_batch_size": None,
        "train_micro_batch_size_per_gpu": None,
        "gradient_accumulation_steps": None,
        "gradient_clipping": None,
        "steps_per_print": train["log_every"],
        "wall_clock_breakdown": False,
        "zero_optimization": zero_block,
        "fp16": fp16,
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {}},  # which AdamW runs: `_choose_adam`, on the final dict
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_type": "linear"}},
    }
    for path, value in train_values(train, batch, composed_only=True).items():
        set_path(composed, path, value)
    return composed


def fill_values(cfg: Mapping[str, Any], batch: BatchSizes, dtype: str, hidden_size: int) -> dict[str, Any]:
    """Values for "auto"/null leaves of a base JSON, keyed by dotted path (scheduler params by name,
    whatever the scheduler type of the base file)."""
    buckets = derived_bucket_sizes(hidden_size)
    return {
        **train_values(cfg["train"], batch, composed_only=False),
        "fp16.enabled": dtype == "fp16",
        "bf16.enabled": dtype == "bf16",
        **{f"zero_optimization.{key}": value for key, value in buckets.items()},
    }


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
            delete(merged, path)  # a group: the composition fills it in again
        elif get(merged, path, "absent") != "absent":
            set_path(merged, path, copy.deepcopy(fill[path]))
    _check_overrides_land(merged, composed, explicit_groups, source)
    for key in BATCH_KEYS:
        if key in merged:
            merged[key] = composed[key]
    for block in ATOMIC_BLOCKS:
        if block in merged:  # taken whole: its params depend on its "type"
            composed = {key: value for key, value in composed.items() if key != block}
    for path, value in leaves(composed):
        if is_unset(get(merged, path)):
            set_path(merged, path, copy.deepcopy(value))
    for path, value in list(leaves(merged)):
        if is_unset(value):
            if path not in fill:
                raise LauncherError(f'{source}: cannot fill "{value}" at {path}; set a value there or remove the key')
            set_path(merged, path, copy.deepcopy(fill[path]))
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
        if any(get(tree_of[path], path, "absent") != "absent" for path in paths):
            continue
        block, name = paths[0].split(".", 1)[0], paths[0].rsplit(".", 1)[1]
        raise LauncherError(
            f"{key} would change nothing: the {block} of {source} (type {get(merged, block + '.type')}) has no "
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
    for path, value in leaves(ds):
        if isinstance(value, str) and value.lower() == "auto":
            raise LauncherError(f'{path}="auto" would be silently dropped by DeepSpeed: give a value')
        if isinstance(value, float) and not math.isfinite(value):
            raise LauncherError(
                f"{path}={value} is not a finite number (JSON has none: ds_config.json would hold null, and "
                "DeepSpeed its own default); give a number"
            )
    _check_batch(ds, world_size)
    _check_precision(ds, device)
    _check_zero(ds.get("zero_optimization") or {})
    clip = ds.get("gradient_clipping", 0)
    if not isinstance(clip, int | float) or clip < 0:
        raise LauncherError(f"gradient_clipping={clip} must be a non-negative number (0 disables clipping)")


def _check_batch(ds: Mapping[str, Any], world_size: int) -> None:
    total, micro, accum = (ds.get(key) for key in BATCH_KEYS)
    for key, value in zip(BATCH_KEYS, (total, micro, accum), strict=True):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise LauncherError(f"{key}={value} must be a positive integer")
    if total != micro * accum * world_size:
        raise LauncherError(
            f"inconsistent batch sizes: train_batch_size={total} but train_micro_batch_size_per_gpu={micro} "
            f"x gradient_accumulation_steps={accum} x world size {world_size} = {micro * accum * world_size}"
        )


def _check_precision(ds: Mapping[str, Any], device: Device) -> None:
    fp16 = bool(get(ds, "fp16.enabled", False))
    bf16 = bool(get(ds, "bf16.enabled", False)) or bool(get(ds, "bfloat16.enabled", False))
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


def _check_zero(zero: Mapping[str, Any]) -> None:
    """Offload needs the stage that can hold it; bucket sizes are whole numbers of elements."""
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
        if value is None or not (key.endswith("_size") or key.endswith("_threshold")):
            continue
        if isinstance(value, bool) or not float(value).is_integer():
            raise LauncherError(f"zero_optimization.{key}={value} must be a whole number of elements")
        if value < (0 if key.endswith("_threshold") else 1):
            raise LauncherError(f"zero_optimization.{key}={value} must be positive")


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
    if base is not None:
        base = with_bf16_spelling(base, base_source)
    batch = resolve_givens(batch_givens(cfg["train"], base, explicit_groups, base_source), world_size)
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
            base, composed, fill_values(cfg, batch, dtype, hidden_size), explicit_groups, base_source
        )
    extra = with_bf16_spelling(cfg.get("deepspeed_extra") or {}, "deepspeed_extra")
    unknown = sorted(set(extra) - KNOWN_TOP_LEVEL_KEYS)
    if unknown:
        raise LauncherError(
            f"deepspeed_extra.{unknown[0]} is not a DeepSpeed key; DeepSpeed would silently ignore it: "
            "check the spelling against the DeepSpeed config docs"
        )
    final = deep_merge(composed, extra)
    if "optimizer" not in (base or {}):  # a base's own optimizer block is taken whole
        _choose_adam(final)
    check_ds_config(final, world_size=world_size, device=device)
    return final


def _choose_adam(ds: dict[str, Any]) -> None:
    """The composed AdamW: torch's fused one, where DeepSpeed would JIT-compile its fused_adam op (a minute)
    for the same update at the same speed (bench/optimizer.py); DeepSpeed's compiled CPU Adam where the
    final dict offloads the optimizer states, whichever source (group, base JSON, extra) offloads them
    (launcher.train.ops)."""
    optimizer = ds["optimizer"]
    offload = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    chosen = "torch_adam" in optimizer["params"]  # deepspeed_extra chose
    if offload in (None, "none") and str(optimizer.get("type")).lower() == "adamw" and not chosen:
        optimizer["params"] = {**optimizer["params"], "torch_adam": True, "fused": True}


def explicit_groups_from_overrides(overrides: list[str]) -> frozenset[str]:
    """Groups the user named on the command line (a `deepspeed=` preset names zero and offload).

    A train.* override is named by its key ("train.lr"): it owns only its own values of a base JSON
    (TRAIN_KEY_OWNS). "train" alone means the group itself was chosen (`train=...`)."""
    groups: set[str] = set()
    for override in overrides:
        top, _, rest = override_key(override).partition(".")
        if top == "deepspeed":
            groups.update(("zero", "offload"))
        elif top == "train" and rest:
            groups.add("train." + rest.split(".", 1)[0].split("[", 1)[0])
        elif top in ("zero", "precision", "offload", "comm", "train"):
            groups.add(top)
    return frozenset(groups)
