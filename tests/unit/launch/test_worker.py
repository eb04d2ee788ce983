"""launcher.launch.worker: a rank's entry point, `python -m launcher.launch.worker RUN_DIR`. It trains the
job the launcher planned into RUN_DIR (job.json), accepts the `--local_rank=N` DeepSpeed's launcher
appends, and a failing rank prints nothing: its error is recorded for the launcher, and its exit code
says what kind of failure it was.

The worker runs in this process (on the `process_group` fixture's one-rank gloo group), started by the
real launcher (`run_here`) in place of a child process; `outcome` reads its exit code as the launcher
reads a child's. The worker sets what a rank process sets (PATH; its death with its parent).
"""

from __future__ import annotations

import os

import pytest

from launcher.core.rank_errors import first_rank_error
from launcher.core.rundir import RunDir
from launcher.launch import worker
from launcher.launch.ranks import outcome
from tests.helpers import QUICK, read_summary, run_here

DEEPSPEEDS_ARGUMENT = "--local_rank=0"


@pytest.fixture
def start_worker(process_group, monkeypatch):
    """A `start` for run_here: the worker's main in this process, its exit code read as the launcher would.
    The exit codes it returned, in order, are kept on the function."""
    monkeypatch.setenv("PATH", os.environ["PATH"])  # the worker puts the interpreter's bin first: undone after

    def start(job, run_dir, *, env, output=None):
        code = worker.main([str(run_dir.path), DEEPSPEEDS_ARGUMENT])
        start.codes.append(code)
        return outcome(job, run_dir, code)

    start.codes = []
    return start


@pytest.mark.slow
def test_the_worker_trains_the_planned_job(start_worker, tmp_path):
    ran = run_here(QUICK, tmp_path / "run", start=start_worker)
    assert start_worker.codes == [0]
    assert ran.outcome.status == "completed", ran.error
    assert read_summary(tmp_path / "run")["steps"] == 2


def test_a_failing_rank_prints_nothing_records_its_error_and_exits_with_its_code(start_worker, tmp_path, capfd):
    # Planned for 2 ranks, started as 1 (the process group of this test): the rank refuses the job.
    ran = run_here([*QUICK, "dist.nproc_per_node=2"], tmp_path / "run", start=start_worker)
    assert start_worker.codes == [2]
    record = first_rank_error(RunDir(tmp_path / "run"))
    assert record is not None and record.rank == 0 and record.exit_code == 2
    assert record.error.startswith("1 ranks started, but the job was planned for world size 2")
    assert ran.error == record.error and ran.outcome.exit_code == 2  # the launcher's one line is the rank's
    printed = capfd.readouterr()
    assert "Traceback" not in printed.err and "world size 2" not in printed.err + printed.out


def test_hydra_full_error_lets_the_ranks_error_through(start_worker, tmp_path, monkeypatch):
    """For a developer: the exception itself leaves the worker (its traceback is printed), no exit code."""
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    ran = run_here([*QUICK, "dist.nproc_per_node=2"], tmp_path / "run", start=start_worker)
    assert start_worker.codes == []  # raised, not returned
    assert ran.error.startswith("1 ranks started, but the job was planned for world size 2")
