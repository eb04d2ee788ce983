"""launcher.compare.sweep: the end of a multirun (Hydra's callback): the comparison on the terminal and in
the sweep directory, and the line train.py ends a sweep with when some of its jobs failed. A real
`train.py -m` sweep runs in tests/e2e."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launcher.compare import sweep as sweep_module
from launcher.compare.sweep import SweepReport, failed_jobs, failed_sweep_line
from tests.unit.compare.sweeps import ERROR, NAMES


@pytest.fixture(autouse=True)
def no_failures_yet(monkeypatch):
    """What this process has recorded of a sweep: nothing, for each test (and left as it was after)."""
    monkeypatch.setattr(sweep_module, "_failed", [])


def test_the_failed_jobs_are_those_whose_summary_did_not_complete(sweep: Path) -> None:
    # 2 failed; 3 wrote no summary (killed hard): not known to have failed; 0, 1, 10 completed.
    assert failed_jobs(sweep) == [("2", ERROR)]


def test_a_sweep_without_failures_ends_without_a_line() -> None:
    assert failed_sweep_line() is None


def test_the_end_of_a_multirun_writes_the_comparison_and_remembers_the_failures(sweep: Path, capsys) -> None:
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    SweepReport().on_multirun_end(config)
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    assert lines[0].split()[:5] == ["run", "zero", "offload", "precision", "status"]
    assert f"{NAMES['2']} failed: {ERROR}" in lines
    assert lines[-1] == f"comparison: {(sweep / 'compare.md').absolute()} (+ compare.csv, compare.png)"
    assert {"compare.md", "compare.csv", "compare.png"} <= {p.name for p in sweep.iterdir()}
    assert failed_sweep_line() == ("1 job(s) of the sweep failed (job 2; errors above)", 1)


def test_a_sweep_directory_that_was_never_made_is_left_alone(tmp_path: Path, capsys) -> None:
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "never")}}})
    SweepReport().on_multirun_end(config)
    assert capsys.readouterr().out == "" and not (tmp_path / "never").exists()
    assert failed_sweep_line() is None


def test_a_preempted_job_is_no_failure_and_the_sweep_exits_as_a_preemption(monkeypatch) -> None:
    """A job a stop signal ended saved a checkpoint (or never trained): the sweep says so and exits 143, as one
    preempted job does; a failure among them still makes it exit 1."""
    monkeypatch.setattr(sweep_module, "_failed", [("1", "preempted")])
    assert failed_sweep_line() == (
        "1 job(s) of the sweep were stopped by a signal (job 1; resume each with resume=DIR)",
        143,
    )
    monkeypatch.setattr(sweep_module, "_failed", [("0", "preempted"), ("2", ERROR)])
    assert failed_sweep_line() == ("1 job(s) of the sweep failed (job 2; errors above)", 1)


def test_a_job_the_device_cannot_run_is_skipped_not_failed(sweep: Path) -> None:
    """experiment=precision_sweep's fp16 job on a CPU without fp16 (launcher.core.errors.DeviceLacks) exited the
    sweep 1 (issue 44): it is recorded "skipped", shown in the table, and fails nothing."""
    from launcher.core.rundir import RunDir
    from launcher.core.summary import Summary
    from launcher.launch.run import Outcome

    job = RunDir(sweep / "4")
    job.path.mkdir()
    summary = Summary(status="running")
    summary.failed("precision=fp16 is not supported on this cpu: use precision=bf16 or precision=fp32", wall_s=1.0,
                   status="skipped")  # fmt: skip
    job.write_summary(summary)
    assert failed_jobs(sweep) == [("2", ERROR)]
    outcome = Outcome(job.path, "skipped", 2, summary.error)
    assert outcome.lines() == [(f"skipped: {summary.error}", True)]
