"""Nothing lost, nothing silent, as `python train.py` shows it: one job per run directory, a signal while
the job is planned or its model loads, a rank killed by the kernel. Subprocesses, because the point is
the process: its exit code, its one error line, signals to it, and a rank ended from outside."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from launcher.core.signals import PAUSE_ENV
from tests.helpers import ROOT, read_metrics, read_summary, run_here, run_train_py, train_here

pytestmark = pytest.mark.slow

SHORT = ["logger=none", "train.micro_batch_size=4", "train.eval_every=0", "data.eval_accuracy=false"]


def _train(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(predicate, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def test_two_jobs_into_one_directory_one_is_refused_the_other_intact(train_in_process, isolated_env, tmp_path):
    """The first job trains in this process and holds the directory; a second `python train.py` into the
    same directory, started while the first one runs, is refused in one line and touches nothing."""
    run_dir = tmp_path / "run"
    args = [*SHORT, "train.max_steps=4"]
    second: list[subprocess.CompletedProcess[str]] = []

    def start_while_the_first_runs(job, directory, **kwargs):
        second.append(run_train_py(isolated_env, *args, f"hydra.run.dir={run_dir}", timeout=300))
        return train_here(job, directory, **kwargs)

    first = run_here(args, run_dir, start=start_while_the_first_runs)
    assert first.outcome.status == "completed", first.outcome.error
    (refused,) = second
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: hydra.run.dir={run_dir}: another job (pid {os.getpid()}) is running in it; wait for it "
                      "to end, or choose another directory"]  # fmt: skip
    assert "Traceback" not in refused.stderr
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2, 3, 4]  # one line per step, from one job
    assert read_summary(run_dir)["status"] == "completed"


def test_a_signal_while_the_job_is_planned_is_recorded(isolated_env, tmp_path):
    """Ctrl-C to the launcher alone, held in its memory plan (the test hook): stopped before any rank started,
    summary "interrupted", exit 143, the one line on stderr, no traceback. (SIGUSR1 to the whole group while
    planning a 2-rank job: tests/e2e/test_stops.py.)"""
    run_dir, mark = tmp_path / "run", tmp_path / "planning"
    env = {**isolated_env, PAUSE_ENV: f"plan:30:{mark}"}
    job = _train(*SHORT, "train.max_steps=5", f"hydra.run.dir={run_dir}", env=env)
    _wait_for(mark.exists)
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 143, err[-3000:]
    assert "error: stopped by SIGINT before training started; start the job again" in err
    assert "Traceback" not in err
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and "SIGINT" in summary["error"] and summary["steps"] == 0


def test_a_signal_while_the_model_loads_stops_at_the_first_step_with_a_checkpoint(isolated_env, tmp_path):
    """Held where the rank is about to load the model (the "load" hook), so the signal lands there however
    loaded the machine is: waiting for job.json let it land before the rank started, under load (CI-like run
    beside the fault-injection seeds: "interrupted")."""
    run_dir, mark = tmp_path / "run", tmp_path / "loading"
    env = {**isolated_env, PAUSE_ENV: f"load:60:{mark}"}
    job = _train(*SHORT, "train.max_steps=50", f"hydra.run.dir={run_dir}", env=env)
    _wait_for(mark.exists)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted" and summary["steps"] >= 1
    assert (run_dir / "checkpoints" / f"step{summary['steps']}" / "launcher_complete.json").is_file()
    assert f"preempted after step {summary['steps']}: resume with resume={run_dir}" in err


def test_a_rank_killed_by_the_kernel_is_recorded_and_leaves_no_process(isolated_env, tmp_path):
    """What the out-of-memory killer does: SIGKILL to the rank. The launcher records it; nothing lingers."""
    run_dir = tmp_path / "run"
    job = _train(*SHORT, "train.max_steps=500", "data.num_workers=2", f"hydra.run.dir={run_dir}", env=isolated_env)
    _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip())
    launcher = psutil.Process(job.pid)
    rank = next(p for p in launcher.children() if "launcher.launch.worker" in " ".join(p.cmdline()))
    family = [rank, *rank.children(recursive=True)]  # the rank and its DataLoader workers
    rank.kill()
    _, err = job.communicate(timeout=300)
    assert job.returncode == 1, err[-3000:]
    line = "a rank was killed by SIGKILL (the kernel's out-of-memory killer sends it when memory runs out"
    assert line in err and "Traceback" not in err
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and line in summary["error"]
    # What the rank learned before its first step is kept: it wrote the summary once more when set up.
    assert summary["data_cache"]["path"] and summary["kernels"] == "torch" and summary["planned_memory_bytes"] > 0
    _, alive = psutil.wait_procs(family, timeout=15)
    assert alive == []
