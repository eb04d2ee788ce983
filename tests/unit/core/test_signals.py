"""launcher.core.signals: stop signals handled inside a block, and the previous handlers back after it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from launcher.core import signals
from launcher.core.signals import (
    PAUSE_ENV,
    STOP_SIGNALS,
    handling,
    name,
    pause_for_test,
    received,
    recording_stop_signals,
    remember,
)


def test_the_stop_signals_are_those_clusters_send():
    stops = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"]  # SIGHUP: a terminal closed
    assert [name(signum) for signum in STOP_SIGNALS] == stops
    assert name(9) == "SIGKILL"


def test_a_signal_inside_the_block_reaches_the_handler_and_the_old_handlers_come_back():
    def previous(signum, frame):
        raise AssertionError("the block's handler should have run")

    received: list[int] = []
    old = {signum: signal.signal(signum, previous) for signum in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        with handling((signal.SIGUSR1, signal.SIGUSR2), lambda signum, frame: received.append(signum)):
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR2)
        assert received == [signal.SIGUSR1, signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR1) is previous and signal.getsignal(signal.SIGUSR2) is previous
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)


def test_the_old_handlers_come_back_when_the_block_raises():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="planning failed"), handling((signal.SIGTERM,), lambda signum, frame: None):
        assert signal.getsignal(signal.SIGTERM) is not before
        raise RuntimeError("planning failed")
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_signal_is_remembered_inside_the_recording_block_only():
    before = signal.getsignal(signal.SIGTERM)
    remember(signal.SIGTERM)  # outside the block (a test, the tuner's process): nothing is kept for later
    assert received() is None
    with recording_stop_signals():
        assert received() is None
        os.kill(os.getpid(), signal.SIGHUP)  # a closed terminal, before any job's handlers are in place
        os.kill(os.getpid(), signal.SIGTERM)
        assert received() == "SIGHUP"
    assert received() is None and signal.getsignal(signal.SIGTERM) is before


# ----------------------------------------------------------------------------- the tests' hold in a phase
@pytest.fixture
def hold(monkeypatch, tmp_path):
    """LAUNCHER_TEST_PAUSE for `phase` (a 60 s safety net), a fresh record of the phases held; the mark file."""
    monkeypatch.setattr(signals, "_paused", set())
    mark = tmp_path / "held"

    def named(phase: str) -> None:
        monkeypatch.setenv(PAUSE_ENV, f"{phase}:60:{mark}")

    named.mark = mark  # type: ignore[attr-defined]
    return named


def test_a_hold_ends_when_a_stop_signal_arrives_and_the_phase_handler_takes_it(hold):
    """However long the test process takes to send it, the signal ends the hold, and the phase's own handler
    (a rank's stop request here) still gets it; the handlers are the phase's again afterwards."""
    hold("save-step4")
    taken: list[int] = []
    with handling((signal.SIGTERM,), lambda signum, frame: taken.append(signum)):
        mine = signal.getsignal(signal.SIGTERM)
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        began = time.monotonic()
        pause_for_test("save-step4")
        assert time.monotonic() - began < 30 and hold.mark.is_file()
        assert taken == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is mine
        timer.join()


def test_a_hold_ends_when_until_says_the_stop_came_as_a_file(hold, tmp_path):
    hold("step2")
    stop_file = tmp_path / "stop_requested"
    threading.Timer(0.3, stop_file.touch).start()
    began = time.monotonic()
    pause_for_test("step2", until=stop_file.exists)
    assert time.monotonic() - began < 30


def test_a_handler_that_raises_ends_the_hold_with_its_exception(hold):
    """The launcher's planning and an export end on a stop signal by raising: so does their hold."""
    hold("plan")

    def interrupt(signum, frame):
        raise KeyboardInterrupt(name(signum))

    with handling((signal.SIGUSR1,), interrupt):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(KeyboardInterrupt, match="SIGUSR1"):
            pause_for_test("plan")


def test_a_hold_is_for_the_named_phase_once_per_process(hold):
    hold("eval")
    began = time.monotonic()
    pause_for_test("step2")  # another phase: no hold, no mark
    assert not hold.mark.exists()
    with handling((signal.SIGTERM,), lambda signum, frame: None):
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        pause_for_test("eval")
        hold.mark.unlink()
        pause_for_test("eval")  # the second evaluation of the same process goes on at once
    assert not hold.mark.exists() and time.monotonic() - began < 30
