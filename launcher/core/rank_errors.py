"""How the ranks of a job failed: one record per failing rank, and the one line the user sees.

Every rank that fails writes `errors/rank<R>.json` (its one line for the user, exit code, time) and
`rank<R>.txt` (its traceback). When one rank crashes, the others fail soon after (torch's and DeepSpeed's
launchers stop them, gloo peers see the broken connection; NCCL peers under SLURM wait for their timeouts
unless srun ends them: docs/multinode.md); the earliest record is the cause, and the launcher shows that one
line only.

A rank that dies by a signal (SIGABRT from gloo or NCCL, the out-of-memory killer's SIGKILL) records
nothing; its `errors/rank<R>.in_step` file, rewritten in place as each train step starts and ends
(launcher.train.watchdog), still holds the step it died in.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.core.rundir import RunDir

# Signs that a rank failed because another one did. When a rank dies outright (gloo aborts the
# process, SIGABRT, when a collective receives other sizes than it expects), torchrun terminates the
# others, and one may notice its DataLoader worker's SIGTERM before the broken connection.
BROKEN_COLLECTIVE_SIGNS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "collective mismatch",
    "is killed by signal: Terminated",
    "killed by SIGABRT",
)


@dataclass(frozen=True)
class RankError:
    """One failed rank's record (errors/rank<R>.json)."""

    rank: int
    error: str
    exit_code: int
    time: float
    traceback: str  # the file holding it
    launch: str | None = None  # the SLURM launch it belongs to (launcher.launch.slurm.launch_id)

    @classmethod
    def from_json(cls, data: dict) -> RankError:
        return cls(
            rank=int(data["rank"]),
            error=str(data["error"]),
            exit_code=int(data.get("exit_code", 1)),
            time=float(data.get("time", 0.0)),
            traceback=str(data.get("traceback", "")),
            launch=data.get("launch"),
        )


def record_rank_error(
    run_dir: RunDir, rank: int, message: str, exit_code: int, trace: str, *, launch: str | None = None
) -> Path:
    """Write this rank's error record; returns the traceback file. `launch` names the launch it belongs to."""
    run_dir.errors.mkdir(parents=True, exist_ok=True)
    trace_file = run_dir.rank_traceback(rank)
    trace_file.write_text(trace)
    record = {"rank": rank, "error": message, "exit_code": exit_code, "time": time.time(), "traceback": str(trace_file)}
    if launch is not None:
        record["launch"] = launch
    tmp = run_dir.errors / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, run_dir.rank_error(rank))
    return trace_file


def read_rank_error(run_dir: RunDir, rank: int) -> RankError | None:
    try:
        return RankError.from_json(json.loads(run_dir.rank_error(rank).read_text()))
    except (OSError, ValueError, KeyError):
        return None


def first_rank_error(run_dir: RunDir) -> RankError | None:
    """The earliest error any rank recorded (the cause; later ones are its consequences)."""
    records = []
    for path in run_dir.errors.glob("rank*.json"):
        try:
            records.append(RankError.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError):
            continue
    return min(records, key=lambda record: record.time) if records else None


def clear_rank_errors(run_dir: RunDir) -> None:
    """Forget the records of an earlier segment of this run (before a resume starts its ranks)."""
    shutil.rmtree(run_dir.errors, ignore_errors=True)


def step_failure(message: str, step: int, world_size: int, zero_stage: int | None) -> str:
    """The line for a rank that failed inside a train step: the step, and the likely cause where the
    error is a sign that another rank failed first."""
    message = f"step {step}: {message}"
    if world_size > 1 and any(sign in message for sign in BROKEN_COLLECTIVE_SIGNS):
        message += " (another rank failed or ran a different collective; see its output above and errors/"
        if zero_stage == 3:
            message += "; at ZeRO-3, ranks whose batches differ in modality do this: keep data.modality_guard on"
        message += ")"
    return message


def step_in_flight(run_dir: RunDir) -> int | None:
    """The earliest train step a rank was in when it died, from the files of ranks that ended mid-step."""
    steps = []
    for path in run_dir.errors.glob("rank*.in_step"):
        try:
            steps.append(int(path.read_text().strip()))
        except (OSError, ValueError):  # blank: that rank was between steps
            continue
    return min(steps, default=None)
