"""launcher.launch.torchrun: torch's launcher without its failure report. When a rank fails, torchrun
stops the others and returns the exit code that says how the first one failed (2: a user's mistake,
128 + N: killed by signal N, else 1), printing nothing of its own; HYDRA_FULL_ERROR=1 keeps its report.

torch's launcher runs in this process (its ranks are small scripts in child processes); it installs
handlers for the stop signals, which each test puts back."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launcher.launch.torchrun import main
from tests.helpers import free_port

# Rank 1 ends as told (an exit code, or "kill": SIGKILL); rank 0 would run on for a minute.
RANK = """
import os, signal, sys, time
how = sys.argv[1]
if how == "ok":
    sys.exit(0)
if how == "slow":  # both ranks finish after 2 s, whatever their agent was sent meanwhile
    time.sleep(2)
    sys.exit(0)
if os.environ["RANK"] == "1":
    time.sleep(0.3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
time.sleep(60)
"""


@pytest.fixture
def torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`python -m launcher.launch.torchrun --nproc-per-node=2 RANK_SCRIPT HOW` in this process: its exit code."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # set by the launcher; torchrun warns when it is not
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torchrun's handlers replace these
    handlers = {number: signal.getsignal(number) for number in stops}
    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    import torch.distributed.elastic.multiprocessing.api as elastic_api

    monkeypatch.setattr(elastic_api, "_terminate_process_handler", elastic_api._terminate_process_handler)  # undone

    def run(how: str) -> int:
        return main(["--nproc-per-node=2", f"--master-port={free_port()}", str(script), how])

    yield run
    for number, handler in handlers.items():
        signal.signal(number, handler)
    elastic.setLevel(level)


def test_ranks_that_succeed_exit_0(torchrun):
    assert torchrun("ok") == 0


@pytest.mark.parametrize(
    ("how", "code"),
    [("2", 2), ("1", 1), ("kill", 128 + signal.SIGKILL)],
    ids=["a users mistake", "a crash", "killed by SIGKILL"],
)
def test_a_failed_rank_stops_the_others_and_its_exit_code_says_how(torchrun, capfd, how, code):
    started = time.time()
    assert torchrun(how) == code  # not the SIGTERM torchrun then sent rank 0 (143)
    assert time.time() - started < 30  # rank 0 was stopped, not waited for
    printed = capfd.readouterr()
    assert "ChildFailedError" not in printed.err and "failed (exitcode" not in printed.err
    assert "Traceback" not in printed.err and printed.out == ""


def test_hydra_full_error_keeps_torchruns_own_failure(torchrun, monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ChildFailedError) as failed:
        torchrun("1")
    assert failed.value.get_first_failure()[1].exitcode == 1


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_to_torchs_agent_leaves_its_ranks_running(torchrun, signum):
    """Sent to every process (Ctrl-C, `timeout`, SLURM), a stop reaches the ranks, which save and stop; torch's
    agent used to turn it into an exception that killed them within seconds (and a traceback). Here the
    agent (this process) is sent one mid-run and its ranks still end on their own, exit 0."""
    import threading

    signal.signal(signum, lambda *_: None)  # should the signal land before torch installs its handlers
    timer = threading.Timer(0.8, os.kill, (os.getpid(), signum))
    timer.start()
    started = time.time()
    try:
        assert torchrun("slow") == 0
    finally:
        timer.cancel()
    assert time.time() - started >= 2
