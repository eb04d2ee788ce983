"""Child processes that die with their parent, so that no rank or data worker outlives a job."""

from __future__ import annotations

import contextlib
import ctypes
import signal


def die_with_parent() -> None:
    """In a child process: the kernel sends it SIGKILL when its parent dies (Linux; elsewhere nothing).

    Set in the ranks the launcher starts, in the ranks torch's launcher starts, and in DataLoader
    workers: a launcher killed by SIGKILL or the out-of-memory killer leaves no process behind."""
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no such call
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
