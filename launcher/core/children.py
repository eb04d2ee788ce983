"""Child processes that die with their parent, so that no rank or data worker outlives a job; and the end of
the entry points (train.py, the ranks, the commands), without the interpreter's costly teardown."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator

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


@contextlib.contextmanager
def exit_without_teardown() -> Iterator[None]:
    """Around the body of an entry point (train.py, a rank, the `python -m launcher.*` commands): its end
    (returning, or sys.exit) ends the process with the exit status Python would give, after what Python's
    own exit does first, in its order: it waits for the other non-daemon threads (and thread pools), runs
    the atexit handlers (logging's, wandb's, multiprocessing's, ours), flushes the output buffers (Python's,
    then C's: DeepSpeed's ops print too). What it leaves out is the interpreter's teardown, which frees every
    module's objects with full garbage collections over millions of them (torch, transformers, DeepSpeed):
    measured here, ~1.6 CPU s of a rank's or the launcher's end, ~0.5 s of torch's launcher's (bench/process_end.py).

    Any other exception leaves as usual: its traceback, then Python's own exit."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None or not hasattr(atexit, "_run_exitfuncs"):  # another Python than CPython's: its own exit
        yield
        return
    try:
        yield
        code: object = 0
    except SystemExit as stop:
        code = stop.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # as Python's exit does: the message on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)
    os._exit(code)
