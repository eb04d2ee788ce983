"""Resuming on another number of ranks or another ZeRO stage: what changes, and what cannot (pure).

    python train.py resume=RUN dist.nproc_per_node=1 deepspeed=z2     # saved on 2 ranks at ZeRO-3

A checkpoint holds each rank's shard of the model and optimizer, cut for the world size and ZeRO
stage that saved it. Another world size or stage reads it through DeepSpeed's universal checkpoint
format: one folder per parameter with its full fp32 value and Adam moments (launcher.universal
converts, once, in the launcher process; the ranks load it). What this module decides, before any
conversion or rank:

- whether a resume needs the conversion at all (the world size, the stage or the optimizer's offload
  differs: DeepSpeed's CPU Adam and torch's AdamW do not read each other's state);
- what it cannot continue, in one line: a checkpoint without the batch sizes it was saved with (an
  older launcher's), NVMe optimizer offload (DeepSpeed's universal loader skips it), bf16/fp16 to or
  from ZeRO-0, data whose order depends on the world size (length-grouped batches, mixtures);
- the global batch it keeps (accumulation adjusts to the new world size), and where each rank's
  data stream resumes: the same number of samples drawn by all ranks together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.core.checkpoints import CheckpointMarker
from launcher.core.errors import LauncherError


@dataclass(frozen=True)
class Reshard:
    """A resume onto another world size or ZeRO stage (job.json's "reshard")."""

    saved_world_size: int
    saved_zero_stage: int
    saved_micro_batch: int
    global_batch: int
    world_size: int
    zero_stage: int
    saved_offload: str = "none"  # the optimizer's offload device: none | cpu | nvme
    offload: str = "none"

    @property
    def converts(self) -> bool:
        """Whether the checkpoint goes through a universal copy: a ZeRO-0 one loaded at ZeRO-0 holds the
        whole model and optimizer in one file, which DeepSpeed loads on any world size as it is."""
        return not (self.saved_zero_stage == 0 and self.zero_stage == 0)

    @property
    def keeps_ranks(self) -> bool:
        return self.saved_world_size == self.world_size

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Reshard:
        return cls(**{key: value if key.endswith("offload") else int(value) for key, value in data.items()})

    def describe(self) -> str:
        return (
            _shape(self.saved_world_size, self.saved_zero_stage, self.saved_offload)
            + " -> "
            + _shape(self.world_size, self.zero_stage, self.offload)
        )


def _shape(world_size: Any, stage: Any, offload: str | None) -> str:
    optimizer = f" with the optimizer offloaded ({offload})" if offload not in (None, "none") else ""
    return f"{world_size} rank(s) at ZeRO-{stage}{optimizer}"


def reshard_for(marker: CheckpointMarker, current: dict[str, Any]) -> Reshard | None:
    """The reshard a resume needs (None: the same world size and stage, a plain resume), or one line
    saying why this checkpoint cannot continue on the new shape.

    `current` holds the new job's world_size, zero_stage, global_batch, offload_optimizer ("cpu",
    "nvme" or None) and data (the data config, plain)."""
    saved_world_size, saved_stage = marker.world_size, marker.zero_stage
    offload = current.get("offload_optimizer") or "none"
    # An older launcher's checkpoint does not record its offload: taken as unchanged.
    saved_offload = (offload if marker.offload_optimizer is None else marker.offload_optimizer) or "none"
    if (saved_world_size, saved_stage, saved_offload) == (current["world_size"], current["zero_stage"], offload):
        return None
    change = f"{_shape(saved_world_size, saved_stage, saved_offload)} -> " + _shape(
        current["world_size"], current["zero_stage"], offload
    )
    if marker.global_batch is None or marker.micro_batch is None:
        raise LauncherError(
            f"cannot resume on another shape ({change}): the checkpoint does not record its batch sizes (saved by "
            "an older launcher); resume with its world size and ZeRO stage"
        )
    if "nvme" in (offload, saved_offload):
        raise LauncherError(
            f"cannot resume on another shape ({change}) with NVMe optimizer offload: DeepSpeed's universal "
            "checkpoint loader does not fill NVMe-swapped states (nor does its converter read them); resume "
            "with the checkpoint's own shape"
        )
    stages = (int(saved_stage), int(current["zero_stage"]))
    if 0 in stages and stages != (0, 0) and current.get("precision", "fp32") != "fp32":
        raise LauncherError(
            f"cannot resume on another shape ({change}) in {current['precision']} to or from ZeRO-0: there "
            "DeepSpeed keeps the fp32 master weights in its FP16_Optimizer, which no converter reads; resume "
            "at ZeRO-0 on any world size, or between ZeRO-1/2/3"
        )
    data = current.get("data") or {}
    if int(saved_world_size) != int(current["world_size"]):
        if data.get("sources"):
            raise LauncherError(
                f"cannot resume a mixture (data.sources) on another world size ({change}): each rank's share of "
                "the mixture's draws depends on it; resume with the same world size"
            )
        if data.get("group_by_length"):
            raise LauncherError(
                f"cannot resume data.group_by_length=true on another world size ({change}): its batches are "
                "grouped per rank; resume with the same world size, or with data.group_by_length=false"
            )
        if data.get("streaming"):
            raise LauncherError(
                f"cannot resume data.streaming=true on another world size ({change}): each rank's stream (its files, "
                "its place in them) depends on it; resume with the same world size"
            )
    if int(current["global_batch"]) != int(marker.global_batch):
        raise LauncherError(
            f"cannot resume on another shape ({change}) with another global batch: the checkpoint trained with "
            f"{marker.global_batch} samples per step, this job has {current['global_batch']}"
        )
    return Reshard(
        saved_world_size=int(saved_world_size),
        saved_zero_stage=int(saved_stage),
        saved_micro_batch=int(marker.micro_batch),
        global_batch=int(marker.global_batch),
        world_size=int(current["world_size"]),
        zero_stage=int(current["zero_stage"]),
        saved_offload=str(saved_offload),
        offload=str(offload),
    )


def batch_overrides(saved_global_batch: int, saved_micro: int, world_size: int, given: dict[str, Any]) -> list[str]:
    """The batch overrides that keep the checkpoint's global batch on `world_size` ranks.

    `given` holds the new command line's own train.micro_batch_size / train.grad_accum /
    train.global_batch_size, when it sets them (they win). The micro batch stays the saved one unless
    given (or implied by a given accumulation); the accumulation follows. One line when the global
    batch cannot be kept, with what would do."""
    if given.get("train.global_batch_size") not in (None, saved_global_batch, str(saved_global_batch)):
        raise LauncherError(
            f"train.global_batch_size={given['train.global_batch_size']}: a resume keeps the checkpoint's global "
            f"batch ({saved_global_batch}); leave it out"
        )
    accum = given.get("train.grad_accum")
    if accum is not None and given.get("train.micro_batch_size") is None:
        # The accumulation given: the micro batch follows from it.
        if saved_global_batch % (int(accum) * world_size):
            raise LauncherError(
                f"train.grad_accum={accum}: the checkpoint's global batch {saved_global_batch} is no multiple of "
                f"{accum} x {world_size} rank(s); give train.micro_batch_size instead"
            )
        given = {**given, "train.micro_batch_size": saved_global_batch // (int(accum) * world_size)}
    micro = int(given.get("train.micro_batch_size") or saved_micro)
    if accum is not None and micro * int(accum) * world_size != saved_global_batch:
        raise LauncherError(
            f"train.micro_batch_size={micro} x train.grad_accum={accum} x {world_size} rank(s) is not the "
            f"checkpoint's global batch {saved_global_batch}; give one of the two"
        )
    if saved_global_batch % (micro * world_size):
        fits = [m for m in range(1, saved_global_batch // world_size + 1) if saved_global_batch % (m * world_size) == 0]
        hint = (
            f"give train.micro_batch_size={' or '.join(str(m) for m in fits[-3:])}"
            if fits
            else "choose a world size that divides it"
        )
        raise LauncherError(
            f"the checkpoint's global batch {saved_global_batch} cannot be kept on {world_size} rank(s) with micro "
            f"batch {micro} ({saved_global_batch} is no multiple of {micro} x {world_size}): {hint}"
        )
    return [
        f"train.micro_batch_size={micro}",
        "train.grad_accum=null",
        f"train.global_batch_size={saved_global_batch}",
    ]


def resumed_batches(batches: int, saved_micro: int, saved_world_size: int, micro: int, world_size: int) -> int:
    """Micro-batches each new rank has consumed in the epoch: the same samples drawn by all ranks
    together (the samplers deal one shuffled order, rank r taking every world_size-th sample, so the
    samples of each global step are the same on any world size)."""
    drawn = batches * saved_micro * saved_world_size
    if drawn % (micro * world_size):
        raise LauncherError(
            f"the checkpoint's data position ({drawn} samples drawn in the epoch) is no whole number of micro "
            f"batches of {micro} on {world_size} rank(s); resume with a micro batch that divides it"
        )
    return drawn // (micro * world_size)
