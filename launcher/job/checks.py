"""Checks at the edge: the device, the model's dimensions, paths, and DeepSpeed's own validation.

These need the machine, the file system or heavy imports, so they stay out of the pure builder in
`launcher.ds_config`. Called before any process starts.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config.ds_config import Device
from launcher.core.errors import LauncherError
from launcher.core.rundir import directory_problem


def detect_device() -> Device:
    """The accelerator DeepSpeed will train on, and which half-precision types it supports."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    kind = "cuda" if accelerator.device_name() == "cuda" else accelerator.device_name()
    name = ""
    if kind == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
    return Device(
        kind=kind,
        bf16=bool(accelerator.is_bf16_supported()),
        fp16=bool(accelerator.is_fp16_supported()),
        name=name,
    )


def check_image_text_to_text(config: Any, path: str) -> None:
    """Refuse a model that AutoModelForImageTextToText cannot load (a text-only LLM, a CLIP encoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architecture given"
    raise LauncherError(
        f"model.path={path} is a {config.model_type} model ({architectures}), not an image-text-to-text model: "
        "give a vision-language model that AutoModelForImageTextToText loads (LLaVA, Qwen2-VL, ...)"
    )


# File names transformers loads weights from (a single file, or the index of a sharded checkpoint).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_files(model_cfg: DictConfig) -> None:
    """A local model directory must hold weights, not only a config (a hub id is fetched by the ranks)."""
    if model_cfg.source != "pretrained" or not model_cfg.path:
        return
    path = Path(str(model_cfg.path)).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in WEIGHT_FILES):
        raise LauncherError(
            f"model.path={model_cfg.path} has a config but no weights (model.safetensors or pytorch_model.bin): "
            "copy the complete model directory, or save it with save_pretrained"
        )


# ----------------------------------------------------------------------------- every knob's range
# A value out of range would otherwise reach a rank and fail there with a traceback (a model built
# with 0 attention heads), or much later (a huge worker count, killed by the out-of-memory killer).
WORKERS_PER_CORE = 4  # DataLoader workers beyond this many per usable core only add processes


def check_knobs(cfg: DictConfig) -> None:
    """Refuse, in one line naming the key, any knob outside its range, before anything starts.

    The training knobs that enter the DeepSpeed dict are checked by the pure builder
    (launcher.ds_config); the closed choices by the schema (enums) at compose time."""
    _check_model_knobs(cfg.model)
    _check_pixel_knobs(cfg.model)
    data, dist, plan, train = cfg.data, cfg.dist, cfg.plan, cfg.train
    cores = usable_cores()
    if not 0 <= int(data.num_workers) <= WORKERS_PER_CORE * cores:
        raise LauncherError(
            f"data.num_workers={data.num_workers} must lie in [0, {WORKERS_PER_CORE * cores}] ({WORKERS_PER_CORE} per "
            f"usable core, {cores} here): each worker is a process with its own copy of the data set; "
            f"data.num_workers={min(cores, 2)} is plenty for images this size"
        )
    _at_least(data, "eval_samples", 1, "data")
    _at_least(data, "max_new_tokens", 1, "data")
    if data.synthetic:
        _at_least(data, "n_train", 1, "data")
        _at_least(data, "n_eval", 1, "data")  # an empty held-out file is refused when read
        _at_least(data, "image_size", 8, "data")
        _at_least(data, "seed", 0, "data")
    _at_least(dist, "nproc_per_node", 1, "dist")
    _at_least(dist, "nnodes", 1, "dist")
    _at_least(dist, "node_rank", 0, "dist")
    _at_least(dist, "timeout_s", 1, "dist")
    if dist.step_timeout_s is not None and not 0 <= float(dist.step_timeout_s) < float("inf"):
        raise LauncherError(
            f"dist.step_timeout_s={dist.step_timeout_s} must be a number of seconds, or 0 (or null) for no watchdog"
        )
    _at_least(data, "max_image_pixels", 1, "data")
    if data.get("max_length") is not None and int(data.max_length) < 1:
        raise LauncherError(
            f"data.max_length={data.max_length} must be a positive number of tokens per sample (text + image "
            "tokens), e.g. 2048, or null for no limit"
        )
    if dist.master_port is not None and not 1 <= int(dist.master_port) <= 65535:
        raise LauncherError(f"dist.master_port={dist.master_port} must be a TCP port in [1, 65535]")
    _at_least(train, "keep_checkpoints", 1, "train")
    _at_least(cfg.logger, "log_every", 1, "logger")
    _at_least(train, "max_nonfinite_steps", 0, "train")
    if not 0 <= int(train.seed) < 2**32:
        raise LauncherError(f"train.seed={train.seed} must lie in [0, 2**32) (NumPy's seed range)")
    for key in ("gpu_memory_gb", "cpu_memory_gb"):
        if plan[key] is not None and not 0 < float(plan[key]) < float("inf"):
            raise LauncherError(f"plan.{key}={plan[key]} must be a positive number of GiB (or null: detected)")
    if not 0 <= float(plan.headroom) < 1:
        raise LauncherError(f"plan.headroom={plan.headroom} must be a fraction in [0, 1)")
    for key, low in (("seq_len", 1), ("text_tokens", 1), ("image_size", 1)):
        if plan[key] is not None:
            _at_least(plan, key, low, "plan")
    _at_least(plan, "images_per_sample", 0, "plan")


def _at_least(node: Any, key: str, low: int, group: str) -> None:
    if int(node[key]) < low:
        what = "positive" if low == 1 else f"at least {low}"
        raise LauncherError(f"{group}.{key}={node[key]} must be {what}")


def _check_model_knobs(model: DictConfig) -> None:
    if model.source == "pretrained":
        if not model.path:
            raise LauncherError(f"model.path is empty for model={model.name}: give a hub id or a local directory")
        return
    if model.path:
        raise LauncherError(
            f"model.path={model.path} is given, but model={model.name} builds a tiny model from code and would "
            f"ignore it: to train the model saved there add model.source=pretrained (a trained run's model/ "
            "loads this way), or leave model.path unset"
        )
    if model.arch is None:
        raise LauncherError(
            f"model.arch is not set for the tiny model model={model.name}: use tiny_llava or tiny_qwen2_vl"
        )
    for key in ("hidden_size", "vision_hidden_size"):
        if int(model[key]) < 32 or int(model[key]) % 32:
            raise LauncherError(
                f"model.{key}={model[key]} must be a positive multiple of 32 (attention heads of 32 dimensions), "
                "e.g. 64 or 128"
            )
    for key in ("num_layers", "vision_layers", "image_size", "patch_size"):
        _at_least(model, key, 1, "model")
    if int(model.image_size) % int(model.patch_size):
        raise LauncherError(
            f"model.image_size={model.image_size} must be a multiple of model.patch_size={model.patch_size}"
        )
    if model.arch == "tiny_qwen2_vl" and (int(model.image_size) // int(model.patch_size)) % 2:
        raise LauncherError(
            f"model.image_size / model.patch_size = {int(model.image_size) // int(model.patch_size)} must be even: "
            "tiny_qwen2_vl merges 2x2 patches"
        )


def _check_pixel_knobs(model: DictConfig) -> None:
    """model.min_pixels / model.max_pixels: positive, and the range not empty (null: the processor's own)."""
    low, high = model.get("min_pixels"), model.get("max_pixels")
    for key, value in (("min_pixels", low), ("max_pixels", high)):
        if value is not None and int(value) < 1:
            raise LauncherError(
                f"model.{key}={value} must be a positive number of pixels per image (e.g. {448 * 448} for 448 x 448), "
                "or null for the processor's own"
            )
    if low is not None and high is not None and int(high) < int(low):
        raise LauncherError(
            f"model.max_pixels={high} is below model.min_pixels={low}: raise model.max_pixels or lower "
            "model.min_pixels (each image is resized to between the two)"
        )


def check_model_choices(cfg: DictConfig, device_kind: str, precision: str, *, launching: bool = True) -> str:
    """The model settings that need the machine or the model's config; returns the attention kernel.

    model.attn_implementation must run on this device, with the flash-attn package and in this
    precision (auto resolves here; a dry run, which may plan for another machine, keeps what was
    asked). model.min_pixels / model.max_pixels need a dynamic-resolution model (the Qwen2-VL
    family): the model's config is read when either is set (a tiny model is built into the cache
    for it, as the memory preflight does)."""
    from launcher.model.models import check_pixel_limits, read_config, resolve_attn_implementation

    attn = str(cfg.model.attn_implementation)
    if launching:
        attn = resolve_attn_implementation(attn, device_kind=device_kind, precision=precision)
    min_pixels, max_pixels = cfg.model.get("min_pixels"), cfg.model.get("max_pixels")
    if min_pixels is not None or max_pixels is not None:
        from launcher.model.stats import model_dir

        config = read_config(model_dir(cfg))
        check_pixel_limits(config, min_pixels=min_pixels, max_pixels=max_pixels, tiny=cfg.model.source == "tiny")
    check_max_length(cfg)
    return attn


def check_max_length(cfg: DictConfig) -> None:
    """data.max_length must leave room beside one image: below that every record with an image is
    skipped, which training would only find record by record."""
    longest = cfg.data.get("max_length")
    if longest is None:
        return
    from launcher.model.stats import fewest_image_tokens

    found = fewest_image_tokens(cfg)
    if found is not None and int(longest) <= found[0]:
        tokens, what = found
        raise LauncherError(
            f"data.max_length={longest} leaves no room beside one image's {tokens} tokens ({what}): every "
            f"record with an image would be skipped; raise data.max_length (e.g. {max(2048, 2 * tokens)}), or "
            "null for no limit"
        )


def check_data(data: DictConfig) -> None:
    """The data files exist and the loader's settings are valid (records are read by the ranks)."""
    from launcher.data.formats import looks_like_hub_id

    if data.group_by_length and not data.cache:
        raise LauncherError(
            "data.group_by_length=true needs data.cache=true: the lengths it sorts by come from the cache"
        )
    if data.group_by_length and data.sources:
        raise LauncherError(
            "data.group_by_length=true with data.sources: a mixture deals its draws by weight, not by length; "
            "use one of them"
        )
    if data.synthetic:
        return
    if data.name == "mixture" and not data.sources:  # conf/data/mixture.yaml: the sources are the point
        raise LauncherError(
            f"data.sources is not set for data={data.name}: give the sources, e.g. "
            "'data.sources=[{path: a.json, weight: 3}, {path: b.parquet, weight: 1}]'"
        )
    sources = list(data.sources or [])
    path = None if OmegaConf.is_missing(data, "path") else data.path
    if sources and path:
        raise LauncherError("data.path and data.sources are both set: give one data set (data.path) or a mixture")
    if not sources and not path:
        raise LauncherError(
            f"data.path is not set for data={data.name}: give the training file, `datasets` folder or hub id"
        )
    paths = [(f"data.sources[{i}].path", source.path) for i, source in enumerate(sources)] or [("data.path", path)]
    for key, value in [*paths, ("data.eval_path", data.eval_path)]:
        if value and not Path(str(value)).expanduser().exists() and not looks_like_hub_id(str(value)):
            raise LauncherError(f"{key}={value}: no such file or folder (nor a hub id like org/name)")
    for index, source in enumerate(sources):
        if not math.isfinite(source.weight) or source.weight <= 0:
            raise LauncherError(
                f"data.sources[{index}].weight={source.weight}: a mixture weight must be a positive number"
            )
    roots = [data.image_root, *(source.image_root for source in sources)]
    for root in filter(None, roots):
        if not Path(str(root)).expanduser().is_dir():
            raise LauncherError(f"data.image_root={root}: no such directory")


def check_cache_dir(cfg: DictConfig) -> None:
    """The built-in data set and tiny models are generated into cache_dir, which must be writable."""
    if not (cfg.data.synthetic or cfg.model.source == "tiny"):
        return
    problem = directory_problem(Path(str(cfg.cache_dir)))
    if problem:
        raise LauncherError(
            f"cache_dir={cfg.cache_dir}: cannot write there ({problem}); set cache_dir= (or VLM_LAUNCHER_CACHE) "
            "to a directory you can write"
        )


def check_tiny_model_records(cfg: DictConfig, *, micro_batch: int, world_size: int) -> None:
    """A tiny model's vocabulary comes from the data: read the records here, as the memory preflight
    would, so that a bad record is reported once, as an error, before any rank starts."""
    if cfg.model.source != "tiny" or cfg.data.synthetic:
        return
    from launcher.data.records import read_data

    records = read_data(cfg.data, Path(str(cfg.cache_dir)).expanduser().absolute()).train
    if len(records) < micro_batch * world_size:
        raise LauncherError(
            f"data: {len(records)} usable training records, fewer than one global micro-batch "
            f"({micro_batch} x {world_size} ranks)"
        )


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a SLURM or container allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_local_ranks(dist: DictConfig, device_kind: str) -> None:
    """Ranks started on this machine must each have a device: a GPU each, or on a CPU at least a core each.

    Only for launchers that start the ranks here (local, torchrun); DeepSpeed's hostfile and SLURM
    place ranks on other machines."""
    if dist.launcher not in ("local", "torchrun"):
        return
    nproc = int(dist.nproc_per_node)
    if device_kind == "cuda":
        import torch

        have, what = torch.cuda.device_count(), "GPU(s) visible on this machine (one rank per GPU)"
    elif device_kind == "cpu":
        have, what = usable_cores(), "CPU core(s) this process may use (at least one per rank)"
    else:
        return
    if nproc > have:
        raise LauncherError(
            f"dist.nproc_per_node={nproc} is more than the {have} {what}: use dist.nproc_per_node={have} or fewer"
        )


def check_paths(ds: dict[str, Any]) -> None:
    """NVMe offload needs a directory that exists and that this user can write."""
    zero = ds.get("zero_optimization") or {}
    for which in ("offload_param", "offload_optimizer"):
        block = zero.get(which) or {}
        if block.get("device") != "nvme":
            continue
        path = Path(str(block.get("nvme_path")))
        if not path.is_dir():
            raise LauncherError(
                f"offload.nvme_path={path} does not exist: create it on a local NVMe disk or point to one"
            )
        if not os.access(path, os.W_OK):
            raise LauncherError(f"offload.nvme_path={path} is not writable: pick a directory you can write")


def check_optimizer_and_scheduler(ds: dict[str, Any]) -> None:
    """The optimizer and scheduler blocks name classes DeepSpeed can build, with parameters they accept.

    DeepSpeed's config validation passes both blocks through unread; a wrong type or parameter only
    fails inside `deepspeed.initialize` on every rank, with a traceback. The classes are the ones
    DeepSpeed 0.19 picks (engine._configure_basic_optimizer, _scheduler_from_config); nothing is built."""
    import inspect

    optimizer = ds.get("optimizer")
    if optimizer:
        cls, params = _optimizer_class(optimizer, ds)
        if cls is not None:
            _check_signature(cls, params, f"optimizer (type {optimizer.get('type')})", "optimizer.params")
    scheduler = ds.get("scheduler")
    if scheduler:
        import torch
        from deepspeed.runtime import lr_schedules

        name = str(scheduler.get("type"))
        cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
        if not inspect.isclass(cls):
            raise LauncherError(
                f"scheduler.type={name} is not a scheduler DeepSpeed can build: use one of "
                f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)} (or a torch.optim.lr_scheduler class)"
            )
        _check_signature(cls, dict(scheduler.get("params") or {}), f"scheduler {name}", "scheduler.params")


def _optimizer_class(optimizer: dict[str, Any], ds: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The class DeepSpeed will construct for this optimizer block, and the parameters it gets."""
    import inspect

    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = str(optimizer.get("type"))
    params = dict(optimizer.get("params") or {})
    offloaded = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if name.lower() in ("adam", "adamw"):
        params.pop("adam_w_mode", None)
        params.pop("fp32_optimizer_states", None)
        if params.pop("torch_adam", False):
            return torch.optim.AdamW, params
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        return (DeepSpeedCPUAdam if offloaded else FusedAdam), params
    if name.lower() == "adagrad":
        return (None if offloaded else torch.optim.Adagrad), params
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return None, params  # LAMB, Lion, MuP, Muon: their own ops or packages; DeepSpeed checks them
    cls = getattr(torch.optim, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise LauncherError(
            f"optimizer.type={name} is not an optimizer DeepSpeed can build: use AdamW, Adam, Adagrad, Lamb, Lion "
            "(or a torch.optim class, spelt as torch spells it, e.g. SGD)"
        )
    return cls, params


def _check_signature(cls: Any, params: dict[str, Any], what: str, prefix: str) -> None:
    import inspect

    signature = inspect.signature(cls.__init__)
    accepted = set(list(signature.parameters)[2:])  # after self and the optimizer / the parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise LauncherError(
            f"{prefix}.{unknown[0]} is not a parameter of the {what} ({cls.__name__} takes "
            f"{', '.join(sorted(accepted))}): fix or remove it"
        )
    missing = [
        name
        for name, parameter in list(signature.parameters.items())[2:]
        if parameter.default is inspect.Parameter.empty
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and name not in params
    ]
    if missing:
        raise LauncherError(f"{prefix}.{missing[0]} is required by the {what}: set it")


# DeepSpeed's pydantic model names, and the part of the dict each one parses.
_SECTION_OF_MODEL = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedFP16Config": "fp16",
}


def validate_with_deepspeed(ds: dict[str, Any]) -> None:
    """Run DeepSpeed's own config parsing (its pydantic models) on the dict, without a process group.

    DeepSpeed assumes world size 1 when no process group exists, so it is shown the per-rank view
    of the batch; the world-size arithmetic was already checked by the builder.
    """
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(ds)
    probe["train_batch_size"] = probe["train_micro_batch_size_per_gpu"] * probe["gradient_accumulation_steps"]
    try:
        DeepSpeedConfig(probe)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        section = _SECTION_OF_MODEL.get(err.title)
        key = f"{section}.{where}" if section else where
        raise LauncherError(f"DeepSpeed rejects {key}: {first['msg']}") from None
    except (AssertionError, ValueError, KeyError, TypeError) as err:
        raise LauncherError(f"DeepSpeed rejects the config: {err}") from None
