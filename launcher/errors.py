"""The exceptions users see: problems printed as a single line, with no traceback."""


class LauncherError(Exception):
    """A problem the user can fix: printed as one line (no traceback), exit code 2."""

    exit_code = 2


class TrainingFailed(LauncherError):
    """Training started and then failed (a crashed rank, a non-finite loss): exit code 1."""

    exit_code = 1
