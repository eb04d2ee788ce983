"""The exceptions users see, and the one line each is shown as (no traceback)."""

from __future__ import annotations


class LauncherError(Exception):
    """A problem the user can fix: printed as one line (no traceback), exit code 2."""

    exit_code = 2


class TrainingFailed(LauncherError):
    """Training started and then failed (a crashed rank, a non-finite loss): exit code 1."""

    exit_code = 1


class DeviceLacks(LauncherError):
    """The device cannot run what the job asks (a precision it does not have): exit code 2 for one job; in a
    sweep the job is recorded "skipped", not failed (a precision sweep meant for GPUs, run on a CPU)."""


class Interrupted(LauncherError):
    """The job was stopped by a signal before training could stop cleanly: status "interrupted"."""

    exit_code = 143  # 128 + SIGTERM, as a process ended by it reports; SIGINT (Ctrl-C) is treated alike


def one_line(err: BaseException, *, named: bool = False, limit: int | None = None) -> str:
    """The line a user should see for an exception: its message's first line.

    `named` puts the exception's class in front (for errors that are not the launcher's own, whose
    class says what kind of failure it was); `limit` cuts a long line to that many characters.
    A LauncherError raised in a DataLoader worker is re-raised in the main process with the worker's
    traceback in its message; the user's line is its last one, without the exception's class name."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        text = ""
    elif len(lines) > 1 and lines[0].startswith("Caught ") and "DataLoader worker" in lines[0]:
        last = lines[-1]
        text = last.split(": ", 1)[1] if last.split(": ", 1)[0].endswith("Error") else last
    else:
        text = lines[0]
    if named:
        text = f"{type(err).__name__}: {text}".rstrip(": ")
    text = text or type(err).__name__
    if limit is not None and len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def error_line(output: str) -> str:
    """A child job's one-line error from its output (train.py prints `error: ...`), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors[-1].removeprefix("error:").strip() if errors else lines[-1] if lines else "no output")[:500]
