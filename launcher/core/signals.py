"""Signals as clusters send them, handled for a while and then handed back.

SIGTERM (a scheduler's stop, `timeout`, `scancel`), SIGINT (Ctrl-C), SIGUSR1 (SLURM's warning before the
time limit) and SIGUSR2 (submitit's preemption signal) all mean "stop": while a job is planned they end
it at once (status "interrupted"), while the ranks run the launcher forwards them as a file and the
ranks stop at the next step boundary with a checkpoint (launcher.train.checkpoint.StopRequest).
Every handler installed here is removed again when its `with` block ends, so a caller (the tuner, a test)
is left with the handlers it had.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


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
