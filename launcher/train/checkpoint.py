"""Checkpoints a rank saves and loads (torch), the data position they carry, and stopping on a signal.

Which checkpoints exist and are complete, and what each records, is launcher.core.checkpoints (no
torch: the launcher reads them too). A save writes DeepSpeed's files and each rank's own file (data
position, random-number state), then rank 0 writes the marker and points `latest` at it.

Stopping: SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 (what SLURM or submitit sends before preemption or at the
time limit) only set a flag; at the next step boundary the ranks all-reduce it, so every rank stops
after the same step, saves, and the job ends with status "preempted". The launcher process of a
multi-rank job forwards the signal as a file (`run_dir/stop_requested`) that the ranks read at every step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import random
import resource
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DistributedSampler

from launcher.core.checkpoints import CheckpointMarker, prune, saved_files, tag_for, write_latest, write_marker
from launcher.core.disk import free_space
from launcher.core.errors import TrainingFailed, one_line
from launcher.core.rundir import RunDir
from launcher.core.signals import STOP_SIGNALS, pause_for_test, received
from launcher.job.reshard import Reshard
from launcher.train import universal
from launcher.train.distributed import barrier


def reapply_schedule(engine: Any) -> None:
    """Set the optimizer's rate from the scheduler at the iteration the checkpoint restored. DeepSpeed restores
    the scheduler's iteration and the optimizer's saved rate, but the schedule comes from this job's config:
    with another train.max_steps (or warm-up, lr) the first resumed step would apply the old schedule's rate.
    With the same schedule it sets the rate saved, the same float."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration") and scheduler.last_batch_iteration >= 0:
        scheduler.step(scheduler.last_batch_iteration)


# ----------------------------------------------------------------------------- data position
@dataclass
class DataPosition:
    """Where the training data stream is: the sampler's epoch and the batches consumed in it."""

    epoch: int = 0
    batches: int = 0
    # A mixture's samples drawn from ("drawn") and records in ("records") each source, at save.
    sources: dict[str, dict[str, int]] | None = None
    records: int = 0  # data.streaming: rows of this rank's epoch consumed (launcher.data.stream)
    # What the training records are: their data cache's key (a digest of the records, the processor and the
    # length limit), or their count without the cache; None for a stream. A resume must find the same.
    dataset: str | None = None


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way: the first `start` indices are skipped.

    Skipping indices, not batches, means a resume loads no image it will not train on. The order is
    DistributedSampler's own (shuffled by seed + epoch, padded to a multiple of the ranks, every
    num_replicas-th index), made in a tensor: only this rank's share becomes Python ints, where
    DistributedSampler makes a list of every index each epoch (~36 MB per rank at a million records)."""

    start = 0

    def __iter__(self) -> Iterator[int]:
        count = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            order = torch.randperm(count, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(count)
        if self.drop_last:
            order = order[: self.total_size]
        elif self.total_size > count:  # padded with the first indices, repeated as often as it takes
            order = torch.cat([order, order.repeat(-(-(self.total_size - count) // count))[: self.total_size - count]])
        return iter(order[self.rank : self.total_size : self.num_replicas][self.start :].tolist())

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
def save(
    engine: Any,
    run_dir: RunDir,
    marker: CheckpointMarker,
    position: DataPosition,
    *,
    keep: int,
    stop: Callable[[], bool] = lambda: False,
) -> None:
    """Save a resumable checkpoint of step `marker.step` on every rank; then mark it complete (the marker,
    with every file's size) and point `latest` at it.

    Collective: every rank calls it at the same step. Keeps the newest `keep` complete checkpoints. `stop`
    (whether this rank was asked to stop) ends the tests' hold between the files and the marker."""
    tag = tag_for(marker.step)
    folder = run_dir.inside(run_dir.checkpoint(tag))
    rank = torch.distributed.get_rank()
    if rank == 0 and folder.exists():  # left by a crashed save, or a resumed run re-saving
        shutil.rmtree(folder)
    barrier()
    with write_failures_reported(folder):
        engine.save_checkpoint(str(run_dir.checkpoints), tag=tag, save_latest=False)
        own = {"step": marker.step, "epoch": position.epoch, "batches": position.batches, "rng": rng_state()}
        own["records"] = position.records
        own["dataset"] = position.dataset
        if position.sources is not None:
            own["sources"] = position.sources
        torch.save(own, folder / f"launcher_rank{rank}.pt")
    barrier()  # every rank's files are on disk
    if rank == 0:
        # The tests' kills and stop signals land here: every file written, the checkpoint not yet complete.
        pause_for_test(f"save-{tag}", until=stop)
        with write_failures_reported(folder):
            files = saved_files(folder)  # every rank's, complete after the barrier
            write_marker(run_dir, dataclasses.replace(marker, tag=tag, files=files))
            write_latest(run_dir, tag)
        prune(run_dir, keep)
    barrier()


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
    free = free_space(where.parent)
    if free is not None:
        facts.append(f"{free} there")
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        facts.append(f"file size limit (ulimit -f) {soft / 2**20:.0f} MiB")
    return (
        f"cannot write {what} {where} ({'; '.join(facts)}): free disk space (or raise the file size limit), "
        "or put hydra.run.dir on a disk with room; "
        + ("the incomplete checkpoint is never resumed from" if what == "checkpoint" else "nothing incomplete is left")
    )


def own_optimizer_steps(engine: Any) -> None:
    """After DeepSpeed loads a universal checkpoint: every parameter's optimizer step a tensor of its own, where
    torch's optimizer keeps it (on the parameter's device for a fused or capturable one, as its own
    load_state_dict places it). DeepSpeed gives every state the one CPU tensor it read: ZeRO-3, which steps its
    sub-groups one at a time, advanced it once per sub-group a step, and a fused AdamW on a GPU reads its
    steps there."""
    optimizer = getattr(engine.optimizer, "optimizer", None)  # torch's (or DeepSpeed's CPU Adam) under ZeRO's
    if optimizer is None:
        return
    on_device = any(group.get("fused") or group.get("capturable") for group in optimizer.param_groups)
    for param, state in optimizer.state.items():  # ZeRO-3 empties the groups' params between steps: not them
        step = state.get("step")
        if torch.is_tensor(step):
            where = param.device if on_device else step.device
            state["step"] = step.to(where, dtype=torch.float32, copy=True)


def load(
    engine: Any, run_dir: RunDir, tag: str, reshard: Reshard | None = None
) -> tuple[int, DataPosition, dict[str, Any] | None]:
    """Restore a checkpoint into the engine; returns its step, the data position (as saved: per rank of
    the saving job) and this rank's RNG state (None when the world size changed: no rank's applies).

    With `reshard` (another world size or ZeRO stage) the weights and optimizer come from the
    checkpoint's universal copy (launcher.train.universal), made by the launcher before the ranks started."""
    rank = torch.distributed.get_rank()
    source = run_dir.checkpoint(tag)
    try:
        if reshard is not None and reshard.converts:
            source = run_dir.universal(tag)
            if reshard.zero_stage == 0:
                universal.load_into_stage0(engine, source)
                path = str(source)
            else:
                path, _ = engine.load_checkpoint(
                    str(source.parent), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
                )
                own_optimizer_steps(engine)
        else:
            path, _ = engine.load_checkpoint(
                str(run_dir.checkpoints), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        reapply_schedule(engine)
        same_ranks = reshard is None or reshard.keeps_ranks
        own = torch.load(run_dir.checkpoint(tag) / f"launcher_rank{rank if same_ranks else 0}.pt", weights_only=False)
    except (OSError, EOFError, RuntimeError, pickle.UnpicklingError) as err:
        # A damage the sizes recorded at save do not show (or a checkpoint saved before they were).
        raise TrainingFailed(
            f"cannot load checkpoint {source} ({type(err).__name__}: {one_line(err)}): a file of it "
            "may be damaged; move that directory away to resume from the checkpoint before it"
        ) from err
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {source}")
    rng = own["rng"] if same_ranks else None
    return (
        int(own["step"]),
        DataPosition(own["epoch"], own["batches"], own.get("sources"), own.get("records", 0), own.get("dataset")),
        rng,
    )


def truncate_metrics(run_dir: RunDir, step: int) -> None:
    """Drop metrics.jsonl lines of steps after `step`: a resumed run writes them again."""
    path = run_dir.metrics
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- stopping on a signal
class StopRequest:
    """Set by SIGTERM/SIGINT/SIGUSR1/SIGUSR2 (or the launcher's stop file); read at step boundaries, agreed by
    all ranks. Its handlers are this rank's while training; `close` gives the previous ones back."""

    def __init__(self, run_dir: RunDir) -> None:
        self.signal_name: str | None = received()  # one that came while the rank was starting
        self.stop_file = run_dir.stop_file
        self._previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def wanted(self) -> bool:
        """Whether this rank was asked to stop. The ranks agree on it in the step's one all-reduce
        (launcher.train.step.train_step), so that all stop after the same step."""
        return self.signal_name is not None or self.stop_file.exists()

    def reason(self) -> str:
        return self.signal_name or ("signal forwarded by the launcher" if self.stop_file.exists() else "unknown")

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
