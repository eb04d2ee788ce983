"""Signals as clusters send them, handled for a while and then handed back.

SIGTERM (a scheduler's stop, `timeout`, `scancel`), SIGINT (Ctrl-C), SIGHUP (the terminal closed), SIGQUIT
(Ctrl-\\), SIGUSR1 (SLURM's warning before the time limit) and SIGUSR2 (submitit's preemption signal) all
mean "stop": while a job is planned they end it at once (status "interrupted"), while the ranks run the
launcher forwards them as a file and the ranks stop at the next step boundary with a checkpoint
(launcher.train.checkpoint.StopRequest). Sent to every process (a process group, SLURM), they reach the
ranks directly too, which stop the same way; torch's launcher and the DataLoader workers ignore them
(`ignore_stop_signals`), so neither ends the ranks before they have saved.
Every handler installed here is removed again when its `with` block ends, so a caller (the tuner, a test)
is left with the handlers it had.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def ignore_stop_signals() -> None:
    """In a helper process (a DataLoader worker, torch's launcher): the stop signals do nothing here; the
    ranks stop on them and end their helpers once saved (or the kernel ends them with their parent)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def handling(signals: tuple[signal.Signals, ...], handler: Callable[[int, object], None]) -> Iterator[None]:
    """Call `handler` on each of `signals` inside the block; the previous handlers are back after it."""
    previous = {signum: signal.signal(signum, handler) for signum in signals}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def name(signum: int) -> str:
    return signal.Signals(signum).name
