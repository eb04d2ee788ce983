"""The training knobs' one table: each `train.*` key, the DeepSpeed value it sets, and what it owns.

A row says where DeepSpeed reads the value (`path`), how it is computed from the train group and the
resolved batch sizes (`value`), and whether the composition writes it (`composed`: False for values
only a user's own JSON can ask for, such as `warmup_max_lr` of the WarmupLR schedulers). Everything
else is derived from the table, so adding a knob is one row (plus its schema field and default):

- the composed dict's train part (`launcher.config.ds_config`),
- the values that fill a base JSON's "auto" or null leaves (`fill_values`),
- what a `train.*` key named on the command line replaces in a base JSON (`TRAIN_KEY_OWNS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from launcher.config.batch import BatchSizes


@dataclass(frozen=True)
class TrainKnob:
    key: str | None  # the train.* key that sets it and owns it in a base JSON (None: a constant)
    path: str  # where DeepSpeed reads it, dotted
    value: Callable[[Mapping[str, Any], BatchSizes], Any]  # (the train group, the batch sizes) -> the value
    composed: bool = True  # written into the composed dict (False: only fills a base JSON's "auto"/null)


def warmup_steps(train: Mapping[str, Any]) -> int:
    """Linear warm-up length: as given, or warmup_ratio of the run, or 5% of it (DeepSpeed's
    WarmupCosineLR needs >= 1). A ratio rounds up, as the HF Trainer's does."""
    given, ratio = train["warmup_steps"], train.get("warmup_ratio")
    if given is not None:
        return int(given)
    if ratio is not None:
        return max(1, math.ceil(float(ratio) * int(train["max_steps"])))
    return max(1, int(train["max_steps"]) // 20)


TRAIN_KNOBS: tuple[TrainKnob, ...] = (
    TrainKnob("train.global_batch_size", "train_batch_size", lambda train, batch: batch.total),
    TrainKnob("train.micro_batch_size", "train_micro_batch_size_per_gpu", lambda train, batch: batch.micro),
    TrainKnob("train.grad_accum", "gradient_accumulation_steps", lambda train, batch: batch.accum),
    TrainKnob("train.grad_clip", "gradient_clipping", lambda train, batch: float(train["grad_clip"])),
    TrainKnob("train.lr", "optimizer.params.lr", lambda train, batch: float(train["lr"])),
    TrainKnob("train.betas", "optimizer.params.betas", lambda train, batch: [float(b) for b in train["betas"]]),
    TrainKnob("train.eps", "optimizer.params.eps", lambda train, batch: float(train["eps"])),
    TrainKnob("train.weight_decay", "optimizer.params.weight_decay", lambda train, batch: float(train["weight_decay"])),
    TrainKnob("train.max_steps", "scheduler.params.total_num_steps", lambda train, batch: train["max_steps"]),
    TrainKnob("train.warmup_steps", "scheduler.params.warmup_num_steps", lambda train, batch: warmup_steps(train)),
    TrainKnob("train.lr", "scheduler.params.warmup_max_lr", lambda train, batch: float(train["lr"]), composed=False),
    TrainKnob(None, "scheduler.params.warmup_min_lr", lambda train, batch: 0.0, composed=False),
    TrainKnob(None, "scheduler.params.warmup_min_ratio", lambda train, batch: 0.0),
    TrainKnob(
        "train.min_lr_ratio", "scheduler.params.cos_min_ratio", lambda train, batch: float(train["min_lr_ratio"])
    ),
)

# What one train.* key named on the command line owns of a base JSON; a `train=` choice owns all of
# ds_config.OWNERS' "train" entries instead. Any other train.* key owns nothing there.
TRAIN_KEY_OWNS: dict[str, tuple[str, ...]] = {}
for _knob in TRAIN_KNOBS:
    if _knob.key is not None:
        TRAIN_KEY_OWNS[_knob.key] = (*TRAIN_KEY_OWNS.get(_knob.key, ()), _knob.path)


def train_values(train: Mapping[str, Any], batch: BatchSizes, *, composed_only: bool) -> dict[str, Any]:
    """{DeepSpeed path: value} of every knob (or only those the composition writes)."""
    return {knob.path: knob.value(train, batch) for knob in TRAIN_KNOBS if knob.composed or not composed_only}
