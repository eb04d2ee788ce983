"""Parameter groups as the config gives them (`train.groups`): what each sets, checked without torch.

    python train.py train.groups.vision.lr=2e-5 train.groups.projector.lr_scale=2
    python train.py +train.groups.heads.match='.*lm_head.*' +train.groups.heads.lr=1e-5

A group is a part of the model (vision, projector, language: their own weights; adapters: LoRA's) or,
with `match`, the parameters whose names a regular expression matches (re.fullmatch, as peft's
target_modules). Which parameters each holds is decided on the model (launcher.model.groups); here, what
each group sets and the rates it resolves to against the optimizer's base rate and weight decay.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from launcher.config.schema import TRAINABLE
from launcher.core.errors import LauncherError

PARTS = (*TRAINABLE, "adapters")
SETTINGS = ("lr", "lr_scale", "weight_decay", "match")
DEFAULT_GROUP = "default"  # the parameters no configured group holds


@dataclass(frozen=True)
class GroupSpec:
    """One configured group: a part (`match` None) or a regex group."""

    name: str
    lr: float | None = None
    lr_scale: float | None = None
    weight_decay: float | None = None
    match: str | None = None

    def rate(self, base_lr: float) -> float:
        """This group's learning rate, from the optimizer's base rate."""
        if self.lr is not None:
            return self.lr
        return base_lr * (1.0 if self.lr_scale is None else self.lr_scale)


def group_specs(groups: Mapping[str, Any] | None) -> list[GroupSpec]:
    """The groups `train.groups` sets (a part left all null is no group), in the order given, or one line
    naming the key and the fix."""
    specs = []
    for name, given in (groups or {}).items():
        key = f"train.groups.{name}"
        if not isinstance(given, Mapping):
            raise LauncherError(f"{key}={given} must be a group: {{lr, lr_scale, weight_decay, match}}")
        unknown = sorted(str(setting) for setting in given if setting not in SETTINGS)
        if unknown:
            raise LauncherError(
                f"{key}.{unknown[0]} is no group setting: use lr, lr_scale (a multiple of train.lr), "
                "weight_decay or match (a regex over parameter names)"
            )
        values = {setting: _number(key, setting, given.get(setting)) for setting in ("lr", "lr_scale", "weight_decay")}
        match = given.get("match")
        if all(value is None for value in values.values()):
            if match is None and name in PARTS:
                continue  # the default's unset part
            raise LauncherError(f"{key} sets nothing: give it lr, lr_scale or weight_decay, or leave it out")
        if values["lr"] is not None and values["lr_scale"] is not None:
            raise LauncherError(
                f"{key} sets both lr and lr_scale: give one (lr_scale multiplies train.lr, and follows it)"
            )
        if name in PARTS and match is not None:
            raise LauncherError(f"{key} is a part of the model and takes no match: name the regex group otherwise")
        if name not in PARTS and match is None:
            raise LauncherError(
                f"{key} is no part of the model ({', '.join(PARTS)}): give it a regex over parameter names, "
                f"+{key}.match='.*lm_head.*', or use a part's name"
            )
        if name == DEFAULT_GROUP:
            raise LauncherError(f"{key}: '{DEFAULT_GROUP}' names the parameters no group holds; choose another name")
        if match is not None:
            try:
                re.compile(str(match))
            except re.error as err:
                raise LauncherError(f"{key}.match={match} is no regular expression ({err}): fix it") from None
        specs.append(GroupSpec(name=str(name), match=None if match is None else str(match), **values))
    return specs


def _number(key: str, setting: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise LauncherError(f"{key}.{setting}={value} must be a finite number, at least 0")
    return float(value)


def describe_groups(specs: list[GroupSpec], base_lr: float) -> str:
    """The job line's part: `lr 0.001 (vision 2e-05, projector 0.002, heads 1e-05 wd 0.1)`; '' without groups."""
    if not specs:
        return ""
    parts = []
    for spec in specs:
        text = f"{spec.name} {spec.rate(base_lr):g}"
        if spec.weight_decay is not None:
            text += f" wd {spec.weight_decay:g}"
        parts.append(text)
    return f"lr {base_lr:g} ({', '.join(parts)})"


# DeepSpeed's schedulers that scale each group's own rate; the others (WarmupLR, WarmupDecayLR, OneCycle,
# LRRangeTest) set every group to the one rate of their own params.
SCALING_SCHEDULERS = ("WarmupCosineLR",)


def check_schedule(specs: list[GroupSpec], ds_config: Mapping[str, Any]) -> None:
    """Groups with their own rates need a scheduler that keeps them (or none)."""
    scheduler = (ds_config.get("scheduler") or {}).get("type")
    rated = [spec.name for spec in specs if spec.lr is not None or spec.lr_scale is not None]
    if rated and scheduler is not None and scheduler not in SCALING_SCHEDULERS:
        raise LauncherError(
            f"train.groups.{rated[0]} sets its own learning rate, but the scheduler {scheduler} sets every group "
            f"to one rate of its own and would undo it: use {' or '.join(SCALING_SCHEDULERS)} (the default, "
            "which scales each group's rate), or drop the group's lr"
        )
