"""The exceptions users see: problems printed as a single line, with no traceback."""


class LauncherError(Exception):
    """A problem the user can fix: printed as one line (no traceback), exit code 2."""

    exit_code = 2


class TrainingFailed(LauncherError):
    """Training started and then failed (a crashed rank, a non-finite loss): exit code 1."""

    exit_code = 1


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
