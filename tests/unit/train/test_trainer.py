"""The trainer in this process, on gloo: a tiny job trains, stops on request, and resumes exactly.

The launcher plans each job as train.py would (launcher.launch.run.run_job); its one rank trains here
(`train_here`) instead of in a child process, so a job costs its steps, not an interpreter's start-up.
"""

from __future__ import annotations

import json

from launcher.core.rundir import RunDir
from launcher.job.spec import Job, read_job
from tests.helpers import losses, read_metrics, read_summary

JOB = ("logger=none", "train.micro_batch_size=4", "train.eval_every=0", "data.eval_accuracy=false", "train.save_every=2")


def test_a_job_trains_writes_its_run_directory_and_reads_its_job_back(train_in_process, tmp_path):
    ran = train_in_process(*JOB, "train.max_steps=3", run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed" and ran.outcome.exit_code == 0, ran.outcome.error
    run_dir = RunDir(tmp_path / "run")
    summary = read_summary(run_dir.path)
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["world_size"] == 1 and summary["zero_stage"] == 0 and summary["precision"] == "fp32"
    assert [row["step"] for row in read_metrics(run_dir.path)] == [1, 2, 3]
    assert (run_dir.model / "config.json").is_file() and run_dir.marker("step3").is_file()
    job = read_job(run_dir.path)
    assert Job.from_json(json.loads(json.dumps(job.to_json()))) == job  # job.json round-trips
    assert job.max_steps == 3 and job.model_path == summary["base_model"]
    assert ran.lines[0].startswith("job: tiny_llava (full) on 1 rank (cpu), ZeRO 0")


def test_a_stopped_job_resumes_with_the_losses_of_an_uninterrupted_one(train_in_process, tmp_path):
    whole = train_in_process(*JOB, "train.max_steps=4", run_dir=tmp_path / "whole")
    assert whole.outcome.status == "completed", whole.outcome.error

    stopped = RunDir(tmp_path / "stopped")
    stopped.path.mkdir()
    stopped.stop_file.touch()  # what the launcher writes when a scheduler's SIGTERM reaches it
    first = train_in_process(*JOB, "train.max_steps=4", run_dir=stopped.path)
    assert first.outcome.status == "preempted" and first.outcome.exit_code == 143
    assert read_summary(stopped.path)["steps"] == 1 and stopped.marker("step1").is_file()
    assert not stopped.model.exists()

    stopped.stop_file.unlink()
    resumed = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert read_summary(stopped.path)["resumed_from_step"] == 1
    assert losses(stopped.path) == losses(whole.run_dir)  # bitwise: same world size, ZeRO-0, fp32
