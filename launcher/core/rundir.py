"""The run directory: the one place every path a run writes is spelled.

    .hydra/            config.yaml, hydra.yaml, overrides.yaml: the job's config and command line
                       (written by the launcher, without credentials: `write_hydra_files`)
    ds_config.json     the exact dict given to DeepSpeed (credentials left out)
    job.json           the job the ranks run (launcher.job.spec.Job)
    metrics.jsonl      one line per step
    summary.json       the run's outcome (launcher.core.summary.Summary; status "running" until it ends)
    train.log          the log of rank 0
    checkpoints/       resumable checkpoints: <tag>/ (DeepSpeed's files, launcher_rank<R>.pt, the marker),
                       latest, universal/<tag>/ (launcher.core.checkpoints)
    errors/            each failing rank's one-line error, traceback and stacks; the step in flight
    skipped_records.jsonl  each record skipped (bad, or over data.max_length): file, record, reason
    model/             the final model in Hugging Face format
    stop_requested     a stop signal forwarded to the ranks by the launcher process
    ended_by           who killed the ranks on purpose, and why (the tuner, once a candidate is measured)
    wandb_run_id       the W&B run a resume continues; wandb/ holds W&B's own files
    .lock              held (flock) by the job that owns the directory, for the job's whole life
    .reserve           1 MiB of the disk kept, while the job lives, for what a failure writes on a full disk

Every JSON file is written atomically (a temporary file and a rename), so nothing half-written looks
complete, and never with NaN or Infinity (not JSON): a non-finite number is written as null.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from launcher.core import disk
from launcher.core.errors import LauncherError
from launcher.core.json_files import finite, read_json, write_json_atomic, write_text_atomic
from launcher.core.summary import Summary

# Every entry a run writes in its directory (the module docstring), W&B's and Hydra's included.
RUN_ENTRIES = (
    *(".hydra", "ds_config.json", "job.json", "metrics.jsonl", "summary.json", "train.log", "checkpoints", "errors"),
    *(
        "skipped_records.jsonl",
        "model",
        "stop_requested",
        "ended_by",
        "wandb_run_id",
        "wandb",
        ".lock",
        ".reserve",
        "export",
        "export-merged",
    ),
)

T = TypeVar("T")

# Run directories this process owns: path of the lock file -> its open descriptor.
_claimed: dict[str, int] = {}

HYDRA_DIR = ".hydra"
JOB_FILE = "job.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
DS_CONFIG_FILE = "ds_config.json"
CHECKPOINTS_DIR = "checkpoints"
STAGES_DIR = "stages"  # stages/<name>: the model each stage of train.stages ended with
UNIVERSAL_DIR = "universal"  # checkpoints/universal/<tag>: a checkpoint converted for another shape
MARKER_FILE = "launcher_complete.json"  # written last into a checkpoint: it is complete
LATEST_FILE = "latest"
RESERVE_FILE = ".reserve"
# Room kept on the run dir's disk for the records of a failure (errors/, summary.json: a few KiB): on a full
# disk they could not be written, and a rank and the launcher each said their line (issue 42).
RESERVE_BYTES = 1 << 20


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    path: Path

    # ------------------------------------------------------------------ the job's config
    @property
    def hydra(self) -> Path:
        return self.path / HYDRA_DIR

    @property
    def config(self) -> Path:
        """The composed config, as the command line gave it (`train.epochs` not yet turned into steps)."""
        return self.hydra / "config.yaml"

    @property
    def hydra_config(self) -> Path:
        """Hydra's own node of the job (its group choices under runtime.choices)."""
        return self.hydra / "hydra.yaml"

    @property
    def overrides(self) -> Path:
        """The job's command line: what a resume composes again."""
        return self.hydra / "overrides.yaml"

    @property
    def ds_config(self) -> Path:
        return self.path / DS_CONFIG_FILE

    @property
    def job(self) -> Path:
        return self.path / JOB_FILE

    def foreign_entries(self) -> list[str]:
        """The entries of this directory that no run writes (a user's notes, their own model/ without a
        run's metrics), sorted; [] for a directory that does not exist, is empty, or holds a run's files."""
        try:
            names = sorted(entry.name for entry in self.path.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        ours = set(RUN_ENTRIES)
        if not self.metrics.exists():
            ours -= {"model"}  # a run writes model/ at its end, after its metrics: this one is not a run's
        return [name for name in names if name not in ours and not name.startswith(".write-probe-")]

    def is_run(self) -> bool:
        """Whether a job was started here (its command line is recorded)."""
        return self.overrides.is_file()

    def read_overrides(self) -> list[str]:
        return [str(item) for item in yaml.safe_load(self.overrides.read_text()) or []]

    def read_hydra_overrides(self) -> list[str]:
        """The job's overrides of Hydra's own settings (`hydra.job.env_set.X=...`), credentials redacted;
        [] where hydra.yaml is missing or holds none."""
        try:
            node = yaml.safe_load(self.hydra_config.read_text()) or {}
        except (OSError, yaml.YAMLError):
            return []
        found = ((node.get("hydra") or {}).get("overrides") or {}).get("hydra") or []
        return [str(item) for item in found]

    def write_hydra_files(self, config: dict[str, Any], hydra: dict[str, Any], overrides: list[str]) -> None:
        """The run's `.hydra/` files, as Hydra would write them: the composed config, Hydra's node and the
        command line. The only writer of `.hydra/` (Hydra's own is off: conf/config.yaml output_subdir):
        callers pass them with credentials already left out (launcher.core.credentials)."""
        self.hydra.mkdir(parents=True, exist_ok=True)
        for path, content in (
            (self.config, config),
            (self.hydra_config, {"hydra": hydra}),
            (self.overrides, list(overrides)),
        ):
            write_text_atomic(path, yaml.safe_dump(content, default_flow_style=False, sort_keys=False))

    # ------------------------------------------------------------------ what training writes
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
    def model(self) -> Path:
        return self.path / "model"

    def stage_model(self, stage: str) -> Path:
        """The model a stage of train.stages ended with (Hugging Face format): where the next one starts.
        A name that is a path (launcher.config.stages refuses those) could never reach outside the run dir."""
        if Path(stage).name != stage or stage in ("", ".", ".."):
            raise ValueError(f"stage name {stage!r} is a path, not a name")
        return self.path / STAGES_DIR / stage

    @property
    def skipped_records(self) -> Path:
        return self.path / "skipped_records.jsonl"

    @property
    def stop_file(self) -> Path:
        return self.path / "stop_requested"

    @property
    def ended_by(self) -> Path:
        return self.path / "ended_by"

    @property
    def wandb_run_id(self) -> Path:
        return self.path / "wandb_run_id"

    @property
    def lock(self) -> Path:
        return self.path / ".lock"

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS_DIR

    def checkpoint(self, tag: str) -> Path:
        return self.checkpoints / tag

    def marker(self, tag: str) -> Path:
        """The file that makes checkpoint `tag` complete (launcher.core.checkpoints.CheckpointMarker)."""
        return self.checkpoints / tag / MARKER_FILE

    @property
    def latest(self) -> Path:
        """The name of the checkpoint to resume from, replaced atomically once its marker exists."""
        return self.checkpoints / LATEST_FILE

    def universal(self, tag: str) -> Path:
        """Checkpoint `tag` converted for another world size or ZeRO stage (launcher.train.universal)."""
        return self.checkpoints / UNIVERSAL_DIR / tag

    # ------------------------------------------------------------------ errors of the ranks
    @property
    def errors(self) -> Path:
        return self.path / "errors"

    def rank_error(self, rank: int) -> Path:
        """A failed rank's record: its one line, exit code, time (launcher.core.rank_errors)."""
        return self.errors / f"rank{rank}.json"

    def rank_traceback(self, rank: int) -> Path:
        return self.errors / f"rank{rank}.txt"

    def rank_stacks(self, rank: int) -> Path:
        """Every thread's stack of a rank the step watchdog ended (launcher.train.watchdog)."""
        return self.errors / f"rank{rank}_stacks.txt"

    def in_step(self, rank: int) -> Path:
        """The train step rank `rank` is in (blank between steps): named when a rank dies by a signal."""
        return self.errors / f"rank{rank}.in_step"

    # ------------------------------------------------------------------ owning it, and its records
    def claim(self) -> str | None:
        """Own this directory for the rest of this process's life; why not (and what to do), when another
        job owns it or it cannot be written (a read-only disk, no permission).

        An OS lock (flock) on `.lock`: held while the process lives, released by the kernel however it
        ends (a crash, SIGKILL, the out-of-memory killer), so a dead job never blocks a resume."""
        key = str(self.lock.resolve())
        if key in _claimed:  # owned already (a job run again in this process): its reserve may have been used
            return self._reserve_room()
        if (link := self.link_outside()) is not None:
            return link
        try:
            if not self.path.exists():
                # Made here, before Hydra: if the job then stops before using it, leave nothing behind.
                atexit.register(_remove_if_unused, self.path)
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            return f"cannot write in it ({err.strerror or err}): make it writable, or choose another directory"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 200).decode(errors="replace").strip() or "?"
            os.close(fd)
            return f"another job (pid {owner}) is running in it; wait for it to end, or choose another directory"
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        if (full := self._reserve_room()) is not None:
            os.close(fd)  # not owned after all: the next claim, in this process too, tries again
            return full
        _claimed[key] = fd  # kept open: closing it would release the lock
        return None

    def _reserve_room(self) -> str | None:
        """Keep RESERVE_BYTES of the disk for the records of a failure (`with_room`) until this process ends;
        why not, when the disk has not even that left (a job there could record nothing)."""
        reserve = self.path / RESERVE_FILE
        try:
            with open(reserve, "ab") as handle:
                os.posix_fallocate(handle.fileno(), 0, RESERVE_BYTES)
        except OSError as error:
            reserve.unlink(missing_ok=True)
            if error.errno != errno.ENOSPC:
                return None  # a filesystem that cannot reserve: the job runs without
            room = disk.free_space(self.path) or "no room"
            return f"cannot write in it (No space left on device; {room}): free disk space, or choose another directory"
        atexit.register(reserve.unlink, missing_ok=True)
        return None

    def with_room(self, write: Callable[[], T]) -> T:
        """`write()`; where the disk is full, again once the reserved room is given back (the records of a
        failure: a rank's error, the summary)."""
        try:
            return write()
        except OSError as error:
            reserve = self.path / RESERVE_FILE
            if error.errno != errno.ENOSPC or not reserve.exists():
                raise
            reserve.unlink(missing_ok=True)
            return write()

    def link_outside(self) -> str | None:
        """Why this directory holds a link a run would write through to outside it (a planted `model` or
        `checkpoints/step4` leading to someone's folder, which a save would replace or a prune delete), or
        None: its own entries, and everything under the folders the launcher replaces and deletes in
        (checkpoints/, stages/). W&B's folder is W&B's: it links its core's log to ~/.cache/wandb, and
        writes through that link by design. Looked for at the start; `inside` checks again where the run
        writes."""
        root = self.path.resolve()
        entries = [entry for entry in self.path.iterdir()] if self.path.is_dir() else []
        for tree in (CHECKPOINTS_DIR, STAGES_DIR):
            if (self.path / tree).is_dir() and not (self.path / tree).is_symlink():
                for folder, names, files in os.walk(self.path / tree):  # links are met as entries, not followed
                    entries += [Path(folder) / name for name in [*names, *files]]
        for entry in entries:
            if entry.is_symlink() and not entry.resolve().is_relative_to(root):
                return _outside(entry, root)
        return None

    def inside(self, path: Path) -> Path:
        """`path`, where a run is about to write (or replace, or delete) it, when that stays inside this
        directory once links are followed; else one line naming the link (LauncherError)."""
        root = self.path.resolve()
        if not path.resolve().is_relative_to(root):
            raise LauncherError(_outside(path, root))
        return path

    def read_summary(self) -> Summary | None:
        """The summary a run left, or None when there is none (or it cannot be read)."""
        try:
            return Summary.from_json(read_json(self.summary))
        except (OSError, ValueError, TypeError):
            return None

    def write_summary(self, summary: Summary) -> None:
        write_json_atomic(self.summary, summary.to_json())

    def last_recorded_step(self) -> int:
        """The last step metrics.jsonl records (0: none): the last step trained, however the run ended. Reads
        only the file's tail (a long run's file holds a line per step)."""
        try:
            with self.metrics.open("rb") as file:
                file.seek(max(0, file.seek(0, os.SEEK_END) - 65536))
                lines = file.read().splitlines()
        except OSError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):  # a line cut by a kill, or the tail's cut first line
                continue
        return 0

    def metrics_writer(self) -> MetricsWriter:
        """metrics.jsonl opened once for appending (training writes a line per step)."""
        return MetricsWriter(self.metrics)

    def write_skipped_records(self, entries: list[dict[str, Any]]) -> None:
        """Rank 0: one JSON line per record the run skips, replacing the file (a resume finds the same
        records again, and writes them once); no file when nothing is skipped."""
        if not entries:
            self.skipped_records.unlink(missing_ok=True)
            return
        write_text_atomic(self.skipped_records, "".join(json.dumps(entry, default=str) + "\n" for entry in entries))

    def append_skipped_records(self, entries: list[dict[str, Any]]) -> None:
        """Any rank: records a stream skipped while training (data.streaming), added to the file. One
        write in append mode per call: lines of several ranks do not interleave within a line."""
        if entries:
            with open(self.skipped_records, "a") as file:
                file.write("".join(json.dumps(entry, default=str) + "\n" for entry in entries))


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


def _outside(path: Path, root: Path) -> str:
    return (
        f"{path} leads to {path.resolve()}, outside the run directory {root}: a run writes only inside its "
        "own directory; remove the link (to keep checkpoints on another disk, put the run directory there: "
        "hydra.run.dir=PATH)"
    )


def _remove_if_unused(path: Path) -> None:
    """At exit: remove a run directory this process made and never used (only its lock in it)."""
    with contextlib.suppress(OSError):
        if [entry.name for entry in path.iterdir()] == [".lock"]:
            (path / ".lock").unlink()
            path.rmdir()


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
