"""Which dtype a job trains in, what it offloads, and the labels that say so: read from the DeepSpeed dict.

`precision=auto` resolves here against the device; `precision_of` and `offload_of` are the one answer to
"which precision / offload does this dict train with" (summary, checkpoints, planner, W&B tags).
No torch, no deepspeed, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from launcher.config.tree import get
from launcher.core.errors import DeviceLacks, LauncherError

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Device:
    """What the training device can do; `launcher.job.checks.detect_device` fills it in."""

    kind: str  # "cpu" or "cuda"
    bf16: bool
    fp16: bool
    name: str = ""


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
        raise DeviceLacks(
            f"precision=fp16 is not supported on this {device.kind} {device.name}".rstrip()
            + ": use precision=bf16 or precision=fp32"
        )
    if requested == "bf16" and not device.bf16:
        alternative = "precision=fp16 or precision=fp32" if device.fp16 else "precision=fp32"
        raise DeviceLacks(
            f"precision=bf16 is not supported on this {device.kind} {device.name}".rstrip() + f": use {alternative}"
        )
    return requested


def precision_of(ds: Mapping[str, Any]) -> str:
    """The training dtype a DeepSpeed dict selects: fp16, bf16 or fp32.

    The one answer to "which precision is this" (summary, checkpoints, planner). DeepSpeed reads the
    "bf16" block and only falls back to its older spelling "bfloat16" when "bf16" is absent."""
    if _enabled(get(ds, "fp16.enabled", False)):
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
