"""launcher.core.rank_errors: each failing rank's record, the earliest one as the cause, the step a rank
died in, and the line of a rank that failed because another did."""

from __future__ import annotations

import json

import pytest

from launcher.core.rank_errors import (
    RankError,
    clear_rank_errors,
    first_rank_error,
    read_rank_error,
    record_rank_error,
    step_failure,
    step_in_flight,
)
from launcher.core.rundir import RunDir


def test_a_rank_error_is_recorded_with_its_traceback(tmp_path):
    run_dir = RunDir(tmp_path)
    trace = record_rank_error(run_dir, 1, "ValueError: bad", 1, "Traceback ...\n", launch="job7.0")
    assert trace == run_dir.rank_traceback(1) and trace.read_text() == "Traceback ...\n"
    record = read_rank_error(run_dir, 1)
    assert isinstance(record, RankError)
    assert (record.rank, record.error, record.exit_code, record.traceback, record.launch) == (
        1,
        "ValueError: bad",
        1,
        str(trace),
        "job7.0",
    )
    record_rank_error(run_dir, 0, "x", 2, "")
    assert "launch" not in json.loads(run_dir.rank_error(0).read_text())  # only under SLURM
    assert sorted(p.name for p in run_dir.errors.iterdir()) == ["rank0.json", "rank0.txt", "rank1.json", "rank1.txt"]
    assert read_rank_error(run_dir, 5) is None


def test_the_earliest_record_is_the_cause(tmp_path):
    run_dir = RunDir(tmp_path)
    assert first_rank_error(run_dir) is None
    for rank, when in ((0, 30.0), (1, 10.0), (2, 20.0)):
        record_rank_error(run_dir, rank, f"error of rank {rank}", 1, "")
        data = json.loads(run_dir.rank_error(rank).read_text())
        run_dir.rank_error(rank).write_text(json.dumps({**data, "time": when}))
    (run_dir.errors / "rank3.json").write_text("{")  # being written: passed over
    first = first_rank_error(run_dir)
    assert (first.rank, first.error, first.time) == (1, "error of rank 1", 10.0)
    clear_rank_errors(run_dir)
    assert not run_dir.errors.exists() and first_rank_error(run_dir) is None


def test_an_older_record_reads_with_defaults():
    record = RankError.from_json({"rank": "3", "error": "boom"})
    assert record == RankError(rank=3, error="boom", exit_code=1, time=0.0, traceback="", launch=None)


def test_the_step_in_flight_is_the_earliest_of_the_ranks_that_died_in_one(tmp_path):
    run_dir = RunDir(tmp_path)
    assert step_in_flight(run_dir) is None
    run_dir.errors.mkdir()
    run_dir.in_step(0).write_text(f"{'':<20}\n")  # between steps
    assert step_in_flight(run_dir) is None
    run_dir.in_step(1).write_text(f"{12:<20}\n")
    run_dir.in_step(2).write_text(f"{11:<20}\n")
    assert step_in_flight(run_dir) == 11


WORKER_TERMINATED = "RuntimeError: DataLoader worker (pid 10530) is killed by signal: Terminated."
RESET = "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:41101: Connection reset by peer."


@pytest.mark.parametrize("error", [RESET, WORKER_TERMINATED])
def test_a_rank_failing_because_another_did_says_so_and_names_the_zero3_cause(error):
    """gloo aborts a rank on a mismatched gather; the other then sees either the broken connection or,
    when torchrun's SIGTERM reaches its DataLoader worker first, a terminated worker: both get the hint."""
    line = step_failure(error, 1, world_size=2, zero_stage=3)
    assert line.startswith("step 1: ") and "another rank failed" in line and "keep data.modality_guard on" in line
    assert "modality_guard" not in step_failure(error, 1, world_size=2, zero_stage=2)
    assert step_failure(error, 4, world_size=1, zero_stage=3) == f"step 4: {error}"  # no other rank to blame


def test_an_ordinary_step_failure_only_gains_its_step():
    assert step_failure("ValueError: bad", 7, world_size=2, zero_stage=3) == "step 7: ValueError: bad"
