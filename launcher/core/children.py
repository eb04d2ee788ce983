"""Child processes that die with their parent, so that no rank or data worker outlives a job."""

from __future__ import annotations

import contextlib
import ctypes
import signal

from launcher.core.signals import ignore_stop_signals


def die_with_parent() -> None:
    """In a child process: the kernel sends it SIGKILL when its parent dies (Linux; elsewhere nothing).

    Set in the ranks the launcher starts, in the ranks torch's launcher starts, and in DataLoader
    workers: a launcher killed by SIGKILL or the out-of-memory killer leaves no process behind."""
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no such call
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def helper_process(_worker_id: int = 0) -> None:
    """What a helper process of a rank (a DataLoader worker, the indexing process) does first: it dies with
    its parent, and ignores the stop signals, which a scheduler sends to every process (a process group,
    SLURM): its parent decides when to stop, and must not find its helpers gone before it has saved."""
    die_with_parent()
    ignore_stop_signals()
