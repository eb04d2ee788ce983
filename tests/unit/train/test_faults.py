"""launcher.train.faults: the faults tests inject on purpose (`LAUNCHER_TEST_FAULT=RANK:STEP[:HOW]`)."""

from __future__ import annotations

import faulthandler
import os
import signal

import pytest

from launcher.train import faults
from launcher.train.faults import FAULT_ENV, Fault


def test_the_fault_is_read_for_its_rank_only(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    assert Fault.for_rank(0) == Fault(0, None, "raise")
    monkeypatch.setenv(FAULT_ENV, "1:3")
    assert Fault.for_rank(0) == Fault(0) and Fault.for_rank(1) == Fault(1, 3, "raise")
    monkeypatch.setenv(FAULT_ENV, "0:5:alloc=1")
    assert Fault.for_rank(0) == Fault(0, 5, "alloc=1")


def test_a_raised_fault_names_itself_at_its_step_only():
    fault = Fault(1, 3)
    fault.at(2)
    with pytest.raises(RuntimeError, match=f"^fault injected by {FAULT_ENV} on rank 1 at step 3$"):
        fault.at(3)
    Fault(0).at(3)  # no fault for this rank


def test_an_allocation_fault_holds_its_memory_and_goes_on():
    held = len(faults._BALLAST)
    Fault(0, 2, "alloc=1").at(2)
    try:
        assert len(faults._BALLAST) == held + 1 and faults._BALLAST[-1].numel() == 2**20
    finally:
        faults._BALLAST.pop()


def test_an_abort_fault_ends_the_process_by_sigabrt():
    """As gloo and NCCL end a process: SIGABRT, nothing recorded (a forked copy of this process)."""
    Fault(0, 4, "abort").at(3)  # not its step
    pid = os.fork()
    if pid == 0:  # the child: abort, or leave with a code that fails the test
        faulthandler.disable()  # pytest's: it would print the child's stacks on SIGABRT
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        try:
            Fault(0, 4, "abort").at(4)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT
