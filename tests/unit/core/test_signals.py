"""launcher.core.signals: stop signals handled inside a block, and the previous handlers back after it."""

from __future__ import annotations

import os
import signal

import pytest

from launcher.core.signals import STOP_SIGNALS, handling, name, received, recording_stop_signals, remember


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
