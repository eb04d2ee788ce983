"""Checks at the edge: the device, the model's dimensions, paths, and DeepSpeed's own validation.

These need the machine, the file system or heavy imports, so they stay out of the pure builder in
`launcher.ds_config`. Called before any process starts.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.ds_config import Device
from launcher.errors import LauncherError
from launcher.rundir import directory_problem


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


def check_data(data: DictConfig) -> None:
    """The data files exist and the loader's settings are valid (records are read by the ranks)."""
    if data.on_bad_record not in ("error", "skip"):
        raise LauncherError(f"data.on_bad_record={data.on_bad_record}: choose 'error' or 'skip'")
    if int(data.num_workers) < 0:
        raise LauncherError(
            f"data.num_workers={data.num_workers} must be 0 or more (0 decodes images in the training process)"
        )
    if data.synthetic:
        return
    if OmegaConf.is_missing(data, "path") or not data.path:
        raise LauncherError(f"data.path is not set for data={data.name}: give the training JSON file")
    for key in ("path", "eval_path"):
        value = data[key]
        if not value:
            continue
        path = Path(str(value)).expanduser()
        if path.is_dir():
            raise LauncherError(
                f"data.{key}={value} is a directory: give the JSON file (a list of records, or JSON lines)"
            )
        if not path.is_file():
            raise LauncherError(f"data.{key}={value}: no such file")
    image_root = Path(str(data.image_root)).expanduser() if data.image_root else None
    if image_root is not None and not image_root.is_dir():
        raise LauncherError(f"data.image_root={data.image_root}: no such directory")


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
    from launcher.data import load_records

    train_file = Path(str(cfg.data.path)).expanduser()
    image_root = Path(str(cfg.data.image_root)).expanduser() if cfg.data.image_root else train_file.parent
    records, _ = load_records(train_file, image_root, on_bad_record=cfg.data.on_bad_record)
    if cfg.data.eval_path:
        load_records(Path(str(cfg.data.eval_path)).expanduser(), image_root, on_bad_record=cfg.data.on_bad_record)
    if len(records) < micro_batch * world_size:
        raise LauncherError(
            f"data.path={cfg.data.path}: {len(records)} records, fewer than one global micro-batch "
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
