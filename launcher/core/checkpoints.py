"""Checkpoints on disk, without torch: which exist, which are complete and intact, and what each records.

Layout of `run_dir/checkpoints/` (paths from launcher.core.rundir.RunDir):

    step40/                 DeepSpeed's files (model, optimizer, scheduler, loss scaler) plus
      launcher_rank<R>.pt   per rank: data position and random-number state (launcher.train.checkpoint)
      launcher_complete.json  the marker (`CheckpointMarker`), written last, by rank 0, after every rank saved
    latest                  the tag to resume from; replaced atomically after the marker exists
    universal/step40/       made by a resume on another world size or ZeRO stage (launcher.train.universal)

A save that dies half-way leaves a tag directory without the marker and `latest` still naming the
previous complete checkpoint, so a resume never starts from a partial checkpoint. The launcher decides
what a resume continues from these files alone (launcher.job.resume); the ranks save and load with
torch (launcher.train.checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.core.json_files import read_json, write_json_atomic
from launcher.core.rundir import MARKER_FILE, UNIVERSAL_DIR, RunDir

log = logging.getLogger("launcher")

_TAG = re.compile(r"step(\d+)")


@dataclass(frozen=True)
class CheckpointMarker:
    """What a complete checkpoint records about the job that saved it (launcher_complete.json).

    A field an older launcher did not record is None (it is then not compared)."""

    step: int
    tag: str
    world_size: int | None = None
    zero_stage: int | None = None
    precision: str | None = None
    model: dict[str, Any] | None = None  # the model config, as composed
    method: dict[str, Any] | None = None  # the method config, as composed
    base_model: str | None = None  # what an export from this checkpoint rebuilds
    # What a resume on another world size keeps (launcher.job.reshard), and what a ZeRO-0 optimizer state
    # is indexed by (launcher.train.universal converts it by these names).
    global_batch: int | None = None
    micro_batch: int | None = None
    offload_optimizer: str | None = None
    lr_schedule: dict[str, Any] | None = None  # a resume says when it changes the schedule
    param_names: list[str] | None = None
    # The optimizer's groups (launcher.model.groups): [name, elements] each; its state is saved per group.
    param_groups: list[list[Any]] | None = None
    # train.stages as planned (launcher.config.stages.Stage.to_json each), and the stage this step trained in.
    stages: list[dict[str, Any]] | None = None
    stage: str | None = None
    files: dict[str, int] = field(default_factory=dict)  # every file of the checkpoint, with its size at save

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointMarker:
        names = {f.name for f in dataclasses.fields(cls)}
        known = {key: value for key, value in data.items() if key in names}
        known.setdefault("tag", tag_for(int(data["step"])))
        known["files"] = known.get("files") or {}
        return cls(**known)


def tag_for(step: int) -> str:
    return f"step{step}"


def read_marker(run_dir: RunDir, tag: str) -> CheckpointMarker:
    return CheckpointMarker.from_json(read_json(run_dir.marker(tag)))


def write_marker(run_dir: RunDir, marker: CheckpointMarker) -> None:
    write_json_atomic(run_dir.marker(marker.tag), marker.to_json())


def complete_tags(run_dir: RunDir) -> list[tuple[int, str]]:
    """(step, tag) of every checkpoint whose marker exists, oldest first."""
    found = []
    if run_dir.checkpoints.is_dir():
        for path in run_dir.checkpoints.iterdir():
            match = _TAG.fullmatch(path.name)
            if match and run_dir.marker(path.name).is_file():
                found.append((int(match.group(1)), path.name))
    return sorted(found)


def find_resume_tag(run_dir: RunDir, warn: Callable[[str], None] = log.warning) -> str | None:
    """The newest intact checkpoint: the one `latest` names, else the newest complete one; None if none is.

    Complete: its marker exists. Intact: every file the marker lists has the size it had at save (a
    marker without the list, written before it existed, is trusted). Each damaged checkpoint passed
    over is reported to `warn` in one line naming the file and the checkpoint resumed instead."""
    candidates = [tag for _, tag in reversed(complete_tags(run_dir))]
    if run_dir.latest.is_file():
        named = run_dir.latest.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
        else:
            log.warning("checkpoint %s named by %s is incomplete; looking for an older one", named, run_dir.latest)
    damaged = None
    for tag in candidates:
        problem = checkpoint_damage(run_dir, tag)
        if damaged is not None:
            warn(f"{damaged}; resuming from {tag}" if problem is None else f"{damaged}; trying {tag}")
        if problem is None:
            return tag
        damaged = f"checkpoint {tag} is damaged ({problem})"
    if damaged is not None:
        warn(f"{damaged}; no intact checkpoint is left")
    return None


def checkpoint_damage(run_dir: RunDir, tag: str) -> str | None:
    """What differs from the file list the marker recorded at save ("PATH: 12 bytes, 40 at save"); None if nothing."""
    try:
        recorded = read_marker(run_dir, tag).files
    except (OSError, ValueError, KeyError, TypeError):
        return f"{run_dir.marker(tag)}: unreadable"
    for name, size in recorded.items():
        path = run_dir.checkpoint(tag) / name
        if not path.is_file():
            return f"{path}: missing, {size} bytes at save"
        if path.stat().st_size != size:
            return f"{path}: {path.stat().st_size} bytes, {size} at save"
    return None


def saved_files(tag_dir: Path) -> dict[str, int]:
    """Every file of a checkpoint (path relative to its directory) with its size, for the marker."""
    return {
        path.relative_to(tag_dir).as_posix(): path.stat().st_size
        for path in sorted(tag_dir.rglob("*"))
        if path.is_file() and path.name != MARKER_FILE and not path.name.startswith(f".{MARKER_FILE}.")
    }


def write_latest(run_dir: RunDir, tag: str) -> None:
    """Point `latest` at `tag`, durably (fsync) and atomically."""
    tmp = run_dir.checkpoints / f".{run_dir.latest.name}.tmp"
    with open(tmp, "w") as handle:
        handle.write(tag)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, run_dir.latest)


def prune(run_dir: RunDir, keep: int) -> None:
    """Delete complete checkpoints beyond the newest `keep`, and incomplete ones older than those, with
    their universal copies."""
    kept = complete_tags(run_dir)[-max(keep, 1) :]
    oldest_kept = kept[0][0]
    kept_tags = {tag for _, tag in kept}
    universal = run_dir.checkpoints / UNIVERSAL_DIR
    copies = list(universal.iterdir()) if universal.is_dir() else []
    for path in [*run_dir.checkpoints.iterdir(), *copies]:
        match = _TAG.fullmatch(path.name)
        if match and path.name not in kept_tags and int(match.group(1)) < oldest_kept:
            shutil.rmtree(run_dir.inside(path), ignore_errors=True)


# ----------------------------------------------------------------------------- resuming another job
# How the model runs may change on a resume: the weights are the same.
RESUMABLE_CHANGES = {
    "model": {
        "attn_implementation",
        "gradient_checkpointing",
        "vision_gradient_checkpointing",
        "compile",
        "kernels",
        "min_pixels",
        "max_pixels",
    }
}


def incompatibilities(
    marker: CheckpointMarker, *, precision: str, model: dict[str, Any], method: dict[str, Any]
) -> list[str]:
    """What differs between the job that wrote a checkpoint and this one ("key: old -> new").

    How the model runs (attention kernel, activation checkpointing, compilation, liger's kernels, image
    resolution) may change on a resume: the weights are the same. So may the world size and ZeRO stage
    (launcher.job.reshard decides how). A key the checkpoint does not record (an older launcher's) is not compared."""
    differences = []
    if marker.precision != precision:
        differences.append(f"precision {marker.precision} -> {precision}")
    for group, old, new in (("model", marker.model, model), ("method", marker.method, method)):
        old = old or {}
        for key in sorted(set(old) - RESUMABLE_CHANGES.get(group, set())):
            if old.get(key) != new.get(key):
                differences.append(f"{group}.{key} {old.get(key)} -> {new.get(key)}")
    return differences


def lr_schedule_of(ds: dict[str, Any]) -> dict[str, Any]:
    """What sets a DeepSpeed dict's learning rate at each step: the optimizer's lr and the scheduler
    block. A checkpoint records it (the marker's "lr_schedule"), so a resume can tell it changed."""
    return {"lr": ((ds.get("optimizer") or {}).get("params") or {}).get("lr"), "scheduler": ds.get("scheduler")}
