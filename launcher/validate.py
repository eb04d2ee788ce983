"""Checks at the edge: the device, the model's dimensions, paths, and DeepSpeed's own validation.

These need the machine, the file system or heavy imports, so they stay out of the pure builder in
`launcher.ds_config`. Called before any process starts.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher.ds_config import Device
from launcher.errors import LauncherError, one_line


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


def model_hidden_size(model_cfg: DictConfig) -> int:
    """Hidden size of the language model: a tiny model's config says; a real one's config file does."""
    if model_cfg.source == "tiny":
        return int(model_cfg.hidden_size)
    if model_cfg.source != "pretrained":
        raise LauncherError(f"model.source={model_cfg.source} is unknown: use tiny or pretrained")
    if not model_cfg.path:
        raise LauncherError(f"model.path is empty for model={model_cfg.name}: give a hub id or a local directory")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_cfg.path)
    except (OSError, ValueError) as err:
        first = one_line(err)
        raise LauncherError(
            f"model.path={model_cfg.path}: cannot read its config ({first}); give a local directory "
            "holding config.json or a reachable hub id"
        ) from None
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text_config, "hidden_size", None)
    if not hidden:
        raise LauncherError(f"model.path={model_cfg.path}: its config has no hidden_size for the language model")
    return int(hidden)


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
