"""The run directory: one object names every path a run writes; summary.json is one typed record.

    .hydra/            Hydra's config.yaml, hydra.yaml, overrides.yaml (the job's command line)
    ds_config.json     the exact dict given to DeepSpeed
    job.json           the job spec the ranks read (world size, precision, overrides, choices, W&B group)
    metrics.jsonl      one line per logged step
    summary.json       the run's outcome (status "running" until it ends)
    train.log          the log of rank 0
    checkpoints/       resumable checkpoints (launcher.checkpoint)
    errors/            each failing rank's one-line error and traceback (launcher.errors)
    skipped_records.jsonl  each record skipped (bad, or over data.max_length): file, record, reason
    model/             the final model in Hugging Face format
    stop_requested     a stop signal forwarded to the ranks by the launcher process
    wandb_run_id       the W&B run a resume continues; wandb/ holds W&B's own files
    .lock              held (flock) by the job that owns the directory, for the job's whole life

Every JSON file is written atomically (a temporary file and a rename), so nothing half-written looks
complete, and never with NaN or Infinity (not JSON): a non-finite number is written as null.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run directories this process owns: path of the lock file -> its open descriptor.
_claimed: dict[str, int] = {}

JOB_FILE = "job.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
DS_CONFIG_FILE = "ds_config.json"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    path: Path

    @property
    def hydra(self) -> Path:
        return self.path / ".hydra"

    @property
    def config(self) -> Path:
        """The composed config the ranks train with (written by Hydra, or by a resume)."""
        return self.hydra / "config.yaml"

    @property
    def overrides(self) -> Path:
        return self.hydra / "overrides.yaml"

    @property
    def ds_config(self) -> Path:
        return self.path / DS_CONFIG_FILE

    @property
    def job(self) -> Path:
        return self.path / JOB_FILE

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def train_log(self) -> Path:
        return self.path / "train.log"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def errors(self) -> Path:
        return self.path / "errors"

    @property
    def model(self) -> Path:
        return self.path / "model"

    @property
    def skipped_records(self) -> Path:
        return self.path / "skipped_records.jsonl"

    def write_skipped_records(self, entries: list[dict[str, Any]]) -> None:
        """Rank 0: one JSON line per record the run skips, replacing the file (a resume finds the same
        records again, and writes them once); no file when nothing is skipped."""
        if not entries:
            self.skipped_records.unlink(missing_ok=True)
            return
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".skipped_records.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.writelines(json.dumps(entry, default=str) + "\n" for entry in entries)
            os.replace(tmp, self.skipped_records)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @property
    def stop_file(self) -> Path:
        return self.path / "stop_requested"

    @property
    def wandb_run_id(self) -> Path:
        return self.path / "wandb_run_id"

    @property
    def lock(self) -> Path:
        return self.path / ".lock"

    def claim(self) -> str | None:
        """Own this directory for the rest of this process's life; why not, when another job owns it.

        An OS lock (flock) on `.lock`: held while the process lives, released by the kernel however it
        ends (a crash, SIGKILL, the out-of-memory killer), so a dead job never blocks a resume."""
        key = str(self.lock.resolve())
        if key in _claimed:
            return None
        if not self.path.exists():
            # Made here, before Hydra: if the job then stops before using it, leave nothing behind.
            atexit.register(_remove_if_unused, self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "?"
            os.close(fd)
            return f"another job (pid {owner}) is running in it"
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _claimed[key] = fd  # kept open: closing it would release the lock
        return None

    def read_summary(self) -> Summary | None:
        """The summary a run left, or None when there is none (or it cannot be read)."""
        try:
            return Summary.from_json(read_json(self.summary))
        except (OSError, ValueError, TypeError):
            return None

    def write_summary(self, summary: Summary) -> None:
        write_json_atomic(self.summary, summary.to_json())

    def append_metrics(self, record: dict[str, Any]) -> None:
        with self.metrics_writer() as writer:
            writer.write(record)

    def metrics_writer(self) -> MetricsWriter:
        """metrics.jsonl opened once for appending (training writes a line per step)."""
        return MetricsWriter(self.metrics)


class MetricsWriter:
    """Appends one JSON line per record and flushes it: a reader (or a crash) sees whole lines only.

    Kept open for the run: opening and closing the file per step cost ~0.2 ms, about 1% of a tiny step."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a")  # noqa: SIM115 (closed by close(), or as a context manager)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(finite(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@dataclass
class Summary:
    """summary.json: a run's outcome. Written by rank 0 while training, by the launcher otherwise."""

    status: str = "running"  # running | completed | preempted | failed | interrupted
    steps: int = 0
    wall_s: float | None = None
    final_loss: float | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    samples_per_sec: float | None = None
    tokens_per_sec: float | None = None
    peak_memory_bytes: int | None = None
    world_size: int | None = None
    zero_stage: int | None = None
    precision: str | None = None
    offload: str | None = None
    comm: str | None = None
    deepspeed: str | None = None
    model: str | None = None
    error: str | None = None
    overrides: list[str] = field(default_factory=list)
    choices: dict[str, Any] = field(default_factory=dict)
    objective: float | None = None
    # What training learnt about the job (absent from the file until known).
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_job(cls, job: dict[str, Any]) -> Summary:
        """The summary of a job that has not produced anything yet.

        A planned job's "choices" are its labels (launcher.ds_config.labelled_choices: what the DeepSpeed
        dict trains with, a `deepspeed_json` run's included), and its stage and precision the dict's."""
        choices = dict(job.get("choices") or {})
        return cls(
            world_size=job.get("world_size"),
            zero_stage=job.get("zero_stage"),
            precision=job.get("precision") or choices.get("precision"),
            offload=choices.get("offload"),
            comm=choices.get("comm"),
            deepspeed=choices.get("deepspeed"),
            model=choices.get("model"),
            overrides=list(job.get("overrides") or []),
            choices=choices,
        )

    def failed(self, error: str, *, wall_s: float, status: str = "failed") -> None:
        """Record how the job ended when it did not complete."""
        self.status = status
        self.error = error.splitlines()[0] if error else error
        if self.wall_s is None:
            self.wall_s = round(wall_s, 3)

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return finite({**fields, **self.extra})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(
            **{k: v for k, v in data.items() if k in names}, extra={k: v for k, v in data.items() if k not in names}
        )


def _remove_if_unused(path: Path) -> None:
    """At exit: remove a run directory this process made and never used (only its lock in it)."""
    with contextlib.suppress(OSError):
        if [entry.name for entry in path.iterdir()] == [".lock"]:
            (path / ".lock").unlink()
            path.rmdir()


def summary_skeleton(job: dict[str, Any]) -> dict[str, Any]:
    """The fields every summary.json has, with nulls where the run has not produced them."""
    return Summary.for_job(job).to_json()


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {key: finite(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(value) for value in obj]
    return obj


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temporary file and a rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(finite(obj), handle, indent=2, default=str, allow_nan=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def directory_problem(path: Path) -> str | None:
    """Why `path` cannot be made (or written) as a directory; None when it can.

    Probed by creating, and removing, a temporary directory in `path` or its nearest existing
    ancestor: permission bits alone do not tell (root, read-only mounts, /proc)."""
    path = Path(path).expanduser().absolute()
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".write-probe-", dir=ancestor)
    except OSError as err:
        return f"cannot create a directory in {ancestor}: {err.strerror or err}"
    os.rmdir(probe)
    return None


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())
