"""The exceptions users see: problems printed as a single line, with no traceback."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any


class LauncherError(Exception):
    """A problem the user can fix: printed as one line (no traceback), exit code 2."""

    exit_code = 2


class TrainingFailed(LauncherError):
    """Training started and then failed (a crashed rank, a non-finite loss): exit code 1."""

    exit_code = 1


class Interrupted(LauncherError):
    """The job was stopped by a signal before training could stop cleanly: status "interrupted"."""

    exit_code = 143  # 128 + SIGTERM, as a process ended by it reports; SIGINT (Ctrl-C) is treated alike


def one_line(err: BaseException) -> str:
    """The line a user should see for an exception.

    A LauncherError raised in a DataLoader worker is re-raised in the main process with the worker's
    traceback in its message; the user's line is its last one, without the exception's class name.
    """
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    if len(lines) > 1 and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        last = lines[-1]
        return last.split(": ", 1)[1] if last.split(": ", 1)[0].endswith("Error") else last
    return lines[0]


# ----------------------------------------------------------------------------- errors of the ranks
# Every rank that fails writes `run_dir/errors/rank<R>.json` (one line for the user, exit code, time)
# and `rank<R>.txt` (its traceback). When one rank crashes, the others fail soon after on the broken
# connection; the earliest record is the cause, and the launcher shows that one line only.
ERRORS_DIR = "errors"


def record_rank_error(
    run_dir: Path, rank: int, message: str, exit_code: int, trace: str, *, launch: str | None = None
) -> Path:
    """Write this rank's error record; returns the traceback file. `launch` names the launch it belongs to."""
    out = run_dir / ERRORS_DIR
    out.mkdir(parents=True, exist_ok=True)
    trace_file = out / f"rank{rank}.txt"
    trace_file.write_text(trace)
    record = {"rank": rank, "error": message, "exit_code": exit_code, "time": time.time(), "traceback": str(trace_file)}
    if launch is not None:
        record["launch"] = launch
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{rank}.json")
    return trace_file


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


# A rank that dies by a signal (SIGABRT from gloo or NCCL, the out-of-memory killer's SIGKILL) records
# nothing; its `errors/rank<R>.in_step` file, rewritten in place as each train step starts and ends,
# still holds the step it died in (launcher.watchdog writes it).
IN_STEP_SUFFIX = ".in_step"


def step_in_flight(run_dir: Path) -> int | None:
    """The earliest train step a rank was in when it died, from the files of ranks that ended mid-step."""
    steps = []
    for path in (run_dir / ERRORS_DIR).glob(f"rank*{IN_STEP_SUFFIX}"):
        try:
            steps.append(int(path.read_text().strip()))
        except (OSError, ValueError):  # blank: that rank was between steps
            continue
    return min(steps, default=None)


def first_rank_error(run_dir: Path) -> dict[str, Any] | None:
    """The earliest error any rank recorded (the cause; later ones are its consequences)."""
    records = []
    for path in (run_dir / ERRORS_DIR).glob("rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return min(records, key=lambda record: record["time"]) if records else None


def clear_rank_errors(run_dir: Path) -> None:
    """Forget the records of an earlier segment of this run (before a resume starts its ranks)."""
    shutil.rmtree(run_dir / ERRORS_DIR, ignore_errors=True)
