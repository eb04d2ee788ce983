"""A pytest plugin that writes each test's verdict to a file the moment the test ends, and gives every test
a time limit: what a check stopped at any second still knows (pytest prints names and tracebacks only at
its end, and a suite cut at its limit said `F.........s...` and nothing else).

    python -m pytest -m gpu -p tests.verdicts --verdicts OUT/pytest.txt --test-timeout 120

One JSON object per line, appended and flushed as it happens (by the controller under xdist's `-n`):

    {"test": ID, "outcome": "started"}
    {"test": ID, "outcome": "passed" | "failed" | "skipped" | "error", "seconds": S, "error": LINE,
     "traceback": TEXT}

`error` is a failure's first `E` line (the exception and its message), or the skip's reason; `run_error`
the last `error: ...` line of a run the test started (train.py's own one line), where there is one;
`traceback` the failure's report, cut to its last 4,000 characters. A test with a "started" line and no
verdict was running when the suite stopped (bench/device_check.py names it "stopped").

With `--test-timeout S` a test still running after S seconds fails with `TestTimedOut` raised in it
(SIGALRM); one stuck where Python cannot interrupt it (inside a C call) has its process ended 30 s later
by faulthandler, with every thread's stack on stderr: xdist then reports it failed, or the check finds it
started and never ended.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

TRACEBACK_CHARS = 4000
# After the time limit, how long a test stuck in C (out of SIGALRM's reach) has before its process ends.
HARD_STOP_GRACE_S = 30


class TestTimedOut(Exception):
    """Raised in a test that runs past --test-timeout."""

    __test__ = False  # not a test class, whatever its name


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("verdicts", "each test's verdict written as it ends (tests/verdicts.py)")
    group.addoption("--verdicts", type=Path, help="append each test's start and verdict to this file (JSON lines)")
    group.addoption("--test-timeout", type=float, default=0.0, help="fail a test that runs longer (seconds)")


# ----------------------------------------------------------------------------- the verdicts
def _write(config: pytest.Config, record: dict[str, Any]) -> None:
    path = config.getoption("verdicts")
    if path is None or hasattr(config, "workerinput"):  # under xdist the controller writes, not the workers
        return
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    config = _CONFIG.get("config")
    if config is not None:
        _write(config, {"test": nodeid, "outcome": "started"})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One verdict per test: the call's, or the setup's when it failed or skipped, or the teardown's error."""
    config = _CONFIG.get("config")
    if config is None:
        return
    failed_elsewhere = report.when != "call" and report.failed
    skipped_at_setup = report.when == "setup" and report.skipped
    if report.when != "call" and not (failed_elsewhere or skipped_at_setup):
        return
    outcome = report.outcome if report.when == "call" else ("error" if report.failed else "skipped")
    record: dict[str, Any] = {"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 2)}
    if report.failed:
        text = str(report.longrepr)
        record["error"] = _first_error(text)
        if (run_error := _run_error(text)) is not None:
            record["run_error"] = run_error
        record["traceback"] = text[-TRACEBACK_CHARS:]
    elif report.skipped and isinstance(report.longrepr, tuple):
        record["error"] = str(report.longrepr[2])  # the reason
    _write(config, record)


def _first_error(text: str) -> str:
    """The report's first `E ` line (the exception and its message), else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors[0] if errors else lines[-1] if lines else "")[:500]


def _run_error(text: str) -> str | None:
    """The last `error: ...` line a run printed (train.py's one-line error), where the report holds one."""
    found = [line.strip() for line in text.splitlines() if line.strip().removeprefix("E").strip().startswith("error:")]
    return found[-1].removeprefix("E").strip()[:500] if found else None


_CONFIG: dict[str, pytest.Config] = {}


def pytest_configure(config: pytest.Config) -> None:
    _CONFIG["config"] = config


def pytest_unconfigure(config: pytest.Config) -> None:
    _CONFIG.pop("config", None)


# ----------------------------------------------------------------------------- the time limit
_STARTED: dict[str, float] = {}


@contextmanager
def _time_limit(item: pytest.Item) -> Iterator[None]:
    """One phase (setup, call, teardown) of a test, inside what is left of its --test-timeout. Armed per
    phase, where pytest turns what a phase raises into the test's report (never inside pytest's own code)."""
    limit = float(item.config.getoption("test_timeout") or 0)
    if limit <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return
    started = _STARTED.setdefault(item.nodeid, time.monotonic())
    left = max(started + limit - time.monotonic(), 0.01)

    def timed_out(_signum: int, _frame: object) -> None:
        raise TestTimedOut(f"{item.nodeid} ran past --test-timeout={limit:g} s")

    previous = signal.signal(signal.SIGALRM, timed_out)
    signal.setitimer(signal.ITIMER_REAL, left)
    faulthandler.dump_traceback_later(left + HARD_STOP_GRACE_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _time_limit(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _time_limit(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    with _time_limit(item):
        yield
    _STARTED.pop(item.nodeid, None)
