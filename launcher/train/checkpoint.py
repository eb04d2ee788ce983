"""Checkpoints that a run can resume from, and stopping cleanly when the scheduler asks.

Layout of `run_dir/checkpoints/`:

    step40/                 DeepSpeed's files (model, optimizer, scheduler, loss scaler) plus
      launcher_rank<R>.pt   per rank: data position and random-number state
      launcher_complete.json  written last, by rank 0, after every rank saved: step, world size, ...
    latest                  the tag to resume from; replaced atomically after the marker exists
    universal/step40/       made by a resume on another world size or ZeRO stage (launcher.universal)

A save that dies half-way leaves a tag directory without the marker and `latest` still naming the
previous complete checkpoint, so a resume never starts from a partial checkpoint.

Stopping: SIGTERM, SIGUSR1 and SIGUSR2 (what SLURM or submitit sends before preemption or at the time limit) only set a
flag; at the next step boundary the ranks all-reduce it, so every rank stops after the same step,
saves, and the job ends with status "preempted". The launcher process of a multi-rank job forwards
the signal as a file (`run_dir/stop_requested`) that the ranks read at every step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import re
import resource
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from launcher.core.errors import TrainingFailed, one_line
from launcher.core.rundir import METRICS_FILE, read_json, write_json_atomic
from launcher.job.reshard import UNIVERSAL_DIR, Reshard

log = logging.getLogger("launcher")

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
MARKER_FILE = "launcher_complete.json"
STOP_FILE = "stop_requested"
# USR2: submitit's preemption signal; INT (Ctrl-C) stops as cleanly as TERM.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
# Test hook: seconds to sleep after DeepSpeed wrote a checkpoint and before it is marked complete.
SLOW_SAVE_ENV = "LAUNCHER_TEST_SLOW_SAVE"

_TAG = re.compile(r"step(\d+)")


def tag_for(step: int) -> str:
    return f"step{step}"


def complete_tags(checkpoints: Path) -> list[tuple[int, str]]:
    """(step, tag) of every checkpoint whose marker exists, oldest first."""
    found = []
    if checkpoints.is_dir():
        for path in checkpoints.iterdir():
            match = _TAG.fullmatch(path.name)
            if match and (path / MARKER_FILE).is_file():
                found.append((int(match.group(1)), path.name))
    return sorted(found)


def find_resume_tag(checkpoints: Path, warn: Callable[[str], None] = log.warning) -> str | None:
    """The newest intact checkpoint: the one `latest` names, else the newest complete one; None if none is.

    Complete: its marker exists. Intact: every file the marker lists has the size it had at save (a
    marker without the list, written before it existed, is trusted). Each damaged checkpoint passed
    over is reported to `warn` in one line naming the file and the checkpoint resumed instead."""
    candidates = [tag for _, tag in reversed(complete_tags(checkpoints))]
    latest = checkpoints / LATEST_FILE
    if latest.is_file():
        named = latest.read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
        else:
            log.warning("checkpoint %s named by %s is incomplete; looking for an older one", named, latest)
    damaged = None
    for tag in candidates:
        problem = checkpoint_damage(checkpoints / tag)
        if damaged is not None:
            warn(f"{damaged}; resuming from {tag}" if problem is None else f"{damaged}; trying {tag}")
        if problem is None:
            return tag
        damaged = f"checkpoint {tag} is damaged ({problem})"
    if damaged is not None:
        warn(f"{damaged}; no intact checkpoint is left")
    return None


def checkpoint_damage(tag_dir: Path) -> str | None:
    """What differs from the file list the marker recorded at save ("PATH: 12 bytes, 40 at save"); None if nothing."""
    try:
        recorded = read_json(tag_dir / MARKER_FILE).get("files")
    except (OSError, ValueError, AttributeError):
        return f"{tag_dir / MARKER_FILE}: unreadable"
    for name, size in (recorded or {}).items():
        path = tag_dir / name
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


def read_marker(checkpoints: Path, tag: str) -> dict[str, Any]:
    return read_json(checkpoints / tag / MARKER_FILE)


RESUMABLE_CHANGES = {
    "model": {
        "attn_implementation",
        "gradient_checkpointing",
        "vision_gradient_checkpointing",
        "min_pixels",
        "max_pixels",
    }
}


def incompatibilities(marker: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between the job that wrote a checkpoint and this one ("key: old -> new").

    How the model runs (attention kernel, activation checkpointing, image resolution) may change on a
    resume: the weights are the same. So may the world size and ZeRO stage (launcher.reshard decides
    how). A key the checkpoint does not record (an older launcher's) is not compared."""
    differences = []
    for key in ("precision",):
        if marker.get(key) != current.get(key):
            differences.append(f"{key} {marker.get(key)} -> {current.get(key)}")
    for group in ("model", "method"):
        old, new = marker.get(group) or {}, current.get(group) or {}
        for key in sorted(set(old) - RESUMABLE_CHANGES.get(group, set())):
            if old.get(key) != new.get(key):
                differences.append(f"{group}.{key} {old.get(key)} -> {new.get(key)}")
    return differences


# ----------------------------------------------------------------------------- learning-rate schedule
# The scheduler's parameters by the knob a user changes them with (others by their DeepSpeed name).
SCHEDULE_KNOBS = {
    "lr": "train.lr",
    "warmup_max_lr": "train.lr",
    "total_num_steps": "train.max_steps",
    "warmup_num_steps": "warm-up",
    "cos_min_ratio": "train.min_lr_ratio",
}


def lr_schedule_of(ds: dict[str, Any]) -> dict[str, Any]:
    """What sets a DeepSpeed dict's learning rate at each step: the optimizer's lr and the scheduler
    block. A checkpoint records it (the marker's "lr_schedule"), so a resume can tell it changed."""
    return {"lr": ((ds.get("optimizer") or {}).get("params") or {}).get("lr"), "scheduler": ds.get("scheduler")}


def scheduled_lr(schedule: dict[str, Any], step: int) -> float | None:
    """The learning rate metrics.jsonl shows at `step` (1-based: the scheduler has stepped `step` times)
    under a schedule, from DeepSpeed's own scheduler class; None where DeepSpeed has no such class."""
    from deepspeed.runtime import lr_schedules

    block, lr = schedule.get("scheduler") or {}, schedule.get("lr")
    cls = getattr(lr_schedules, str(block.get("type")), None)
    if cls is None or lr is None:
        return None
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(lr))
    try:
        # Built at its step (not at -1, where DeepSpeed warns that it has not started), then stepped there.
        cls(optimizer, **{**(block.get("params") or {}), "last_batch_iteration": step - 1}).step(step - 1)
    except (TypeError, ValueError):
        return None
    return float(optimizer.param_groups[0]["lr"])


def schedule_change(marker: dict[str, Any], ds: dict[str, Any]) -> str | None:
    """One line when this job's learning-rate schedule differs from the checkpoint's, else None.

    DeepSpeed restores only the scheduler's step count: the schedule itself is rebuilt from this job's
    config, so a resume with another train.max_steps (or warm-up, lr) continues on the new schedule,
    re-stretched to the new length, and the learning rate jumps at the resume step. A checkpoint of an
    older launcher does not record its schedule: nothing is said."""
    saved, now = marker.get("lr_schedule"), lr_schedule_of(ds)
    if not saved or saved == now:
        return None
    step = int(marker["step"])
    old = {"lr": saved.get("lr"), **((saved.get("scheduler") or {}).get("params") or {})}
    new = {"lr": now.get("lr"), **((now.get("scheduler") or {}).get("params") or {})}
    changes = {}
    for key in [*old, *(key for key in new if key not in old)]:
        if old.get(key) != new.get(key):
            changes.setdefault(SCHEDULE_KNOBS.get(key, f"scheduler.params.{key}"), f"{old.get(key)} -> {new.get(key)}")
    old_type, new_type = (str((s.get("scheduler") or {}).get("type")) for s in (saved, now))
    if old_type != new_type:
        changes = {"scheduler.type": f"{old_type} -> {new_type}", **changes}
    what = ", ".join(f"{knob} {change}" + (" steps" if knob == "warm-up" else "") for knob, change in changes.items())
    total = new.get("total_num_steps")
    how = f"re-stretched to {total} steps" if "train.max_steps" in changes and total else "changed to the new values"
    before, after = scheduled_lr(saved, step + 1), scheduled_lr(now, step + 1)
    lrs = f" (lr at step {step + 1}: {before:.1e} -> {after:.1e})" if before is not None and after is not None else ""
    return f"resume: {what}: the learning-rate schedule is {how} from step {step + 1} on{lrs}"


# ----------------------------------------------------------------------------- data position
@dataclass
class DataPosition:
    """Where the training data stream is: the sampler's epoch and the batches consumed in it."""

    epoch: int = 0
    batches: int = 0
    # A mixture's samples drawn from ("drawn") and records in ("records") each source, at save.
    sources: dict[str, dict[str, int]] | None = None


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way: the first `start` indices are skipped.

    Skipping indices, not batches, means a resume loads no image it will not train on."""

    start = 0

    def __iter__(self) -> Iterator[int]:
        return iter(list(super().__iter__())[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start


def batches(loader: Any, sampler: ResumableSampler, position: DataPosition, micro: int) -> Iterator[Any]:
    """Batches forever, epoch after epoch, from `position` on; `position` counts what was handed out.

    Each epoch's iterator draws the workers' base seed from the loader's own generator (reseeded from
    the sampler's seed and the epoch), not from the global torch generator: a resumed run creates one
    iterator more than the uninterrupted run did, and that draw would shift the global random stream
    (dropout) from the restored state."""
    while True:
        sampler.set_epoch(position.epoch)
        sampler.start = position.batches * micro
        if loader.generator is not None:
            loader.generator.manual_seed(sampler.seed + position.epoch)
        for batch in loader:
            position.batches += 1
            yield batch
        position.epoch += 1
        position.batches = 0


# ----------------------------------------------------------------------------- random-number state
def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- save and load
def _barrier() -> None:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def save(engine: Any, run_dir: Path, step: int, position: DataPosition, meta: dict[str, Any], *, keep: int) -> None:
    """Save a resumable checkpoint of this step on every rank; then point `latest` at it.

    Collective: every rank calls it at the same step. Keeps the newest `keep` complete checkpoints."""
    checkpoints = run_dir / CHECKPOINT_DIR
    tag = tag_for(step)
    rank = torch.distributed.get_rank()
    if rank == 0 and (checkpoints / tag).exists():  # left by a crashed save, or a resumed run re-saving
        shutil.rmtree(checkpoints / tag)
    _barrier()
    with write_failures_reported(checkpoints / tag):
        engine.save_checkpoint(str(checkpoints), tag=tag, save_latest=False)
        own = {"step": step, "epoch": position.epoch, "batches": position.batches, "rng": rng_state()}
        if position.sources is not None:
            own["sources"] = position.sources
        torch.save(own, checkpoints / tag / f"launcher_rank{rank}.pt")
    _barrier()  # every rank's files are on disk
    if rank == 0:
        delay = float(os.environ.get(SLOW_SAVE_ENV) or 0)
        if delay:
            time.sleep(delay)
        with write_failures_reported(checkpoints / tag):
            files = saved_files(checkpoints / tag)  # every rank's, complete after the barrier
            write_json_atomic(checkpoints / tag / MARKER_FILE, {**meta, "step": step, "tag": tag, "files": files})
            _write_latest(checkpoints, tag)
        _prune(checkpoints, keep)
    _barrier()


@contextlib.contextmanager
def write_failures_reported(where: Path, what: str = "checkpoint") -> Iterator[None]:
    """A write that fails (disk full, a file size limit, a read-only disk) becomes one line."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, RuntimeError, SafetensorError) as err:
        if not isinstance(err, OSError) and not _is_write_failure(err):
            raise
        raise TrainingFailed(_write_failure_message(where, err, what)) from err


def _is_write_failure(err: Exception) -> bool:
    """torch's file writer reports a failed write (disk full, file size limit) only as a RuntimeError,
    safetensors' (save_pretrained) as a SafetensorError naming an I/O error."""
    text = str(err)
    signs = ("PytorchStreamWriter", "inline_container", "file write failed", "I/O error")
    return any(sign in text for sign in signs)


def _write_failure_message(where: Path, err: BaseException, what: str = "checkpoint") -> str:
    """One line for a checkpoint that could not be written, with what the machine says about why."""
    # torch's writer says only "unexpected pos ..."; the errno of the short write is lost.
    reason = err.strerror if isinstance(err, OSError) and err.strerror else "a write stopped part-way"
    facts = [reason]
    with contextlib.suppress(OSError):
        facts.append(f"{shutil.disk_usage(where.parent).free / 2**30:.1f} GiB free there")
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        facts.append(f"file size limit (ulimit -f) {soft / 2**20:.0f} MiB")
    return (
        f"cannot write {what} {where} ({'; '.join(facts)}): free disk space (or raise the file size limit), "
        "or put hydra.run.dir on a disk with room; "
        + ("the incomplete checkpoint is never resumed from" if what == "checkpoint" else "nothing incomplete is left")
    )


def _write_latest(checkpoints: Path, tag: str) -> None:
    tmp = checkpoints / f".{LATEST_FILE}.tmp"
    with open(tmp, "w") as handle:
        handle.write(tag)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, checkpoints / LATEST_FILE)


def _prune(checkpoints: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest `keep`, and incomplete ones older than those."""
    kept = complete_tags(checkpoints)[-max(keep, 1) :]
    oldest_kept = kept[0][0]
    kept_tags = {tag for _, tag in kept}
    for path in [*checkpoints.iterdir(), *_universal_copies(checkpoints)]:
        match = _TAG.fullmatch(path.name)
        if match and path.name not in kept_tags and int(match.group(1)) < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


def _universal_copies(checkpoints: Path) -> list[Path]:
    """The universal copies of checkpoints (launcher.universal), pruned with their originals."""
    folder = checkpoints / UNIVERSAL_DIR
    return list(folder.iterdir()) if folder.is_dir() else []


def load(
    engine: Any, run_dir: Path, tag: str, reshard: Reshard | None = None
) -> tuple[int, DataPosition, dict[str, Any] | None]:
    """Restore a checkpoint into the engine; returns its step, the data position (as saved: per rank of
    the saving job) and this rank's RNG state (None when the world size changed: no rank's applies).

    With `reshard` (another world size or ZeRO stage) the weights and optimizer come from the
    checkpoint's universal copy (launcher.universal), made by the launcher before the ranks started."""
    from launcher.train import universal

    checkpoints = run_dir / CHECKPOINT_DIR
    rank = torch.distributed.get_rank()
    source = checkpoints / tag
    try:
        if reshard is not None and reshard.converts:
            source = universal.universal_path(checkpoints, tag)
            if reshard.zero_stage == 0:
                universal.load_into_stage0(engine, source)
                path = str(source)
            else:
                path, _ = engine.load_checkpoint(
                    str(source.parent), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
                )
        else:
            path, _ = engine.load_checkpoint(
                str(checkpoints), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        same_ranks = reshard is None or reshard.keeps_ranks
        own = torch.load(checkpoints / tag / f"launcher_rank{rank if same_ranks else 0}.pt", weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:
        # A damage the sizes recorded at save do not show (or a checkpoint saved before they were).
        raise TrainingFailed(
            f"cannot load checkpoint {source} ({type(err).__name__}: {one_line(err)}): a file of it "
            "may be damaged; move that directory away to resume from the checkpoint before it"
        ) from err
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {source}")
    rng = own["rng"] if same_ranks else None
    return int(own["step"]), DataPosition(own["epoch"], own["batches"], own.get("sources")), rng


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics.jsonl lines of steps after `step`: a resumed run writes them again."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- stopping on a signal
class StopRequest:
    """Set by SIGTERM/SIGUSR1/SIGUSR2 (or the launcher's stop file); read at step boundaries, agreed by all ranks."""

    def __init__(self, run_dir: Path) -> None:
        self.signal_name: str | None = None
        self.stop_file = run_dir / STOP_FILE
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def wanted(self) -> bool:
        """Whether this rank was asked to stop. The ranks agree on it in the step's one all-reduce
        (recipe.train_step), so that all stop after the same step."""
        return self.signal_name is not None or self.stop_file.exists()

    def reason(self) -> str:
        return self.signal_name or ("signal forwarded by the launcher" if self.stop_file.exists() else "unknown")
