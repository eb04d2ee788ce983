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
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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


# The stop signals this process received inside `recording_stop_signals`; None outside it (a test, the
# tuner's own process), where nothing is remembered for later jobs.
_received: list[str] | None = None


@contextlib.contextmanager
def recording_stop_signals() -> Iterator[None]:
    """Around a whole process's work (train.py, each rank): a stop signal that arrives before the handlers
    of the work it stops are in place is remembered (`received`) instead of killing the process with
    nothing recorded; the launcher then ends the job as interrupted, a rank stops after its first step."""
    global _received
    _received = []
    try:
        with handling(STOP_SIGNALS, remember):
            yield
    finally:
        _received = None


def record_stop_signals_from_now() -> None:
    """`recording_stop_signals` for the rest of this process's life: a command line's first statement
    (train.py), so that no stop signal finds the process without its handlers, even in an import."""
    global _received
    _received = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, remember)


def remember(signum: int, _frame: object = None) -> None:
    """Note a stop signal for what runs next in this process (a sweep's next job ends as interrupted)."""
    if _received is not None:
        _received.append(name(signum))


def received() -> str | None:
    """The first stop signal remembered inside `recording_stop_signals`; None if none came."""
    return _received[0] if _received else None


# ----------------------------------------------------------------------------- a test hook
# `LAUNCHER_TEST_PAUSE=PHASE:SECONDS:FILE` holds a process in a phase (train.py's `start`, plan, cache, eval,
# reference, export, a checkpoint's save `save-stepN`, the end of a train step `stepN`) the first time it gets
# there, after creating FILE, until a stop reaches it (or SECONDS pass: a safety net). The tests of stop signals
# and kills send theirs once FILE exists, so each lands inside that phase (with the DataLoader workers of a cache
# build or an evaluation alive) on a loaded machine as on a quiet one: what happens next depends on the phase,
# not on how soon the test process was scheduled.
PAUSE_ENV = "LAUNCHER_TEST_PAUSE"
_paused: set[str] = set()  # the phases this process was held in already


def pause_for_test(phase: str, until: Callable[[], bool] = lambda: False) -> None:
    """Hold this process in `phase` (once per process) until a stop reaches it: a stop signal to this process,
    whichever handler takes it, or `until()` (a rank's stop request, which the launcher passes on as a file);
    at most the seconds LAUNCHER_TEST_PAUSE names. A no-op unless LAUNCHER_TEST_PAUSE names `phase`."""
    wanted, _, rest = os.environ.get(PAUSE_ENV, "").partition(":")
    if wanted != phase or phase in _paused:
        return
    _paused.add(phase)
    seconds, _, mark = rest.partition(":")
    arrived: list[int] = []
    # The phase's own handlers, wrapped; a signal this process ignores or dies of is left as it is.
    previous = {signum: handler for signum in STOP_SIGNALS if callable(handler := signal.getsignal(signum))}

    def note_then_handle(signum: int, frame: object) -> None:
        arrived.append(signum)
        previous[signum](signum, frame)  # the phase's own handler (it may raise, ending the hold with it)

    with handling(tuple(previous), note_then_handle):
        Path(mark).touch()
        deadline = time.monotonic() + float(seconds)
        while time.monotonic() < deadline and not arrived and not until():
            time.sleep(0.05)  # a signal's handler runs between these sleeps
