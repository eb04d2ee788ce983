"""Resume and preemption, end to end: runs killed (SIGKILL, SIGTERM, during a save) and resumed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT
from tests.test_train_e2e import losses, metrics, summary

pytestmark = pytest.mark.slow

N = 4  # a checkpoint every N steps; runs are 2N steps
RUN = [
    "logger=none",
    "train.micro_batch_size=8",
    f"train.max_steps={2 * N}",
    f"train.save_every={N}",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
]
# A hang in a collective fails in 5 minutes instead of DeepSpeed's 30 (see the known issue in README).
WORLDS = {1: [], 2: ["dist.nproc_per_node=2", "deepspeed=z3", "dist.timeout_s=300"]}


def start(run_dir: Path, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    """`python train.py` in its own process group (so the test can kill every rank at once)."""
    log = open(run_dir.parent / f"{run_dir.name}.out", "ab")  # noqa: SIM115 (the child keeps it)
    return subprocess.Popen(
        [sys.executable, "train.py", *args, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_for(process: subprocess.Popen, condition: Callable[[], bool], timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended (code {process.returncode}) before the condition held"
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.05)


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def latest(run_dir: Path) -> str | None:
    path = run_dir / "checkpoints" / "latest"
    return path.read_text().strip() if path.is_file() else None


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the job and every rank: torchrun starts its ranks in sessions of their own, so the
    process group alone would leave them running."""
    ranks = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    process.wait(timeout=120)
    psutil.wait_procs(ranks, timeout=60)


def resume(run_train, run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    # Only resume= is given: the old run's overrides come back from its run directory.
    return run_train(f"resume={run_dir}", *extra, timeout=900)


def assert_one_line_per_step(run_dir: Path) -> None:
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, 2 * N + 1))


@pytest.fixture(scope="module")
def baselines(tmp_path_factory) -> dict[int, list[float]]:
    """Loss curves of uninterrupted runs, per world size, computed on first use."""
    cache: dict[int, list[float]] = {}

    def get(world: int, run_train) -> list[float]:
        if world not in cache:
            run_dir = tmp_path_factory.mktemp("baseline") / f"ws{world}"
            result = run_train(*RUN, *WORLDS[world], f"hydra.run.dir={run_dir}", timeout=900)
            assert result.returncode == 0, result.stderr[-3000:]
            cache[world] = losses(run_dir)
            assert len(cache[world]) == 2 * N
        return cache[world]

    return get


def report(name: str, reference: list[float], resumed: list[float]) -> None:
    diffs = [abs(a - b) for a, b in zip(reference, resumed, strict=True)]
    rel = [d / abs(a) for d, a in zip(diffs, reference, strict=True)]
    print(f"\n{name}: max abs diff {max(diffs):.3e}, max rel diff {max(rel):.3e}")


@pytest.mark.parametrize("world", [1, 2])
def test_sigkill_after_a_checkpoint_then_resume_is_identical(run_train, isolated_env, tmp_path, world, baselines):
    """fp32 on CPU: killed after step N+1 (checkpoint at N), resumed to 2N, the curve is bitwise identical."""
    reference = baselines(world, run_train)
    run_dir = tmp_path / "run"
    process = start(run_dir, [*RUN, *WORLDS[world]], isolated_env)
    wait_for(process, lambda: last_step(run_dir) >= N + 1 and latest(run_dir) == f"step{N}")
    kill_group(process)
    assert last_step(run_dir) < 2 * N

    result = resume(run_train, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["resumed_from_step"] == N
    assert_one_line_per_step(run_dir)
    report(f"world size {world}", reference, losses(run_dir))
    assert losses(run_dir) == reference  # bitwise: same data order, same states, same arithmetic
    kept = {p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step")}
    assert kept == {f"step{N}", f"step{2 * N}"}  # train.keep_checkpoints=2


@pytest.mark.parametrize("world", [1, 2])
def test_sigterm_saves_stops_as_preempted_and_resumes_to_completion(
    run_train, isolated_env, tmp_path, baselines, world
):
    """At two ranks the launcher process gets the signal and passes it on to both ranks."""
    reference = baselines(world, run_train)
    run_dir = tmp_path / "run"
    process = start(run_dir, [*RUN, *WORLDS[world]], isolated_env)
    wait_for(process, lambda: last_step(run_dir) >= 2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 143
    stopped = summary(run_dir)
    assert stopped["status"] == "preempted"
    assert 2 <= stopped["steps"] < 2 * N
    assert latest(run_dir) == f"step{stopped['steps']}"
    assert last_step(run_dir) == stopped["steps"]

    result = resume(run_train, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["steps"] == 2 * N
    assert_one_line_per_step(run_dir)
    assert losses(run_dir) == reference
    assert (run_dir / "model" / "config.json").is_file()


def test_kill_during_a_save_resumes_from_the_previous_complete_checkpoint(run_train, isolated_env, tmp_path, baselines):
    reference = baselines(1, run_train)
    run_dir = tmp_path / "run"
    env = {**isolated_env, "LAUNCHER_TEST_SLOW_SAVE": "10"}  # seconds between DeepSpeed's save and `latest`
    process = start(run_dir, RUN, env)
    final = run_dir / "checkpoints" / f"step{2 * N}"
    wait_for(process, final.exists)
    kill_group(process)
    assert latest(run_dir) == f"step{N}"
    assert not (final / "launcher_complete.json").exists()

    result = resume(run_train, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == N
    assert_one_line_per_step(run_dir)
    assert losses(run_dir) == reference
    assert latest(run_dir) == f"step{2 * N}" and (final / "launcher_complete.json").is_file()


def test_resume_auto_starts_fresh_then_resumes_and_a_mismatch_is_one_line(run_train, tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, "train.max_steps=2", "train.save_every=0", "resume=auto", f"hydra.run.dir={run_dir}"]
    first = run_train(*args, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "starting fresh" in first.stderr and "resumed_from_step" not in summary(run_dir)
    again = run_train(*args, timeout=900)  # a requeued job: same command, same directory
    assert again.returncode == 0, again.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 2
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]

    mismatch = run_train(f"resume={run_dir}", "deepspeed=z2", timeout=300)
    assert mismatch.returncode == 2
    (line,) = [line for line in mismatch.stderr.splitlines() if line.startswith("error:")]
    assert "zero_stage 0 -> 2" in line

    missing = run_train(f"resume={tmp_path / 'nothing'}", f"hydra.run.dir={tmp_path / 'new'}", timeout=300)
    assert missing.returncode == 2
    assert f"resume={tmp_path / 'nothing'}" in missing.stderr


def test_a_nonfinite_loss_stops_naming_the_step_and_the_checkpoint_before_it_still_loads(run_train, tmp_path):
    """fp32 with a learning rate of 1e4 diverges at step 5 (seeded); checkpoints every 2 steps."""
    run_dir = tmp_path / "run"
    diverging = ["logger=none", "train.micro_batch_size=8", "train.max_steps=30", "train.save_every=2"]
    diverging += ["train.lr=1e4", "train.grad_clip=0", "train.warmup_steps=1"]
    result = run_train(*diverging, f"hydra.run.dir={run_dir}", timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "loss is nan at step 5: lower train.lr" in line
    assert f"checkpoint step4, saved before it, resumes with resume={run_dir}" in line
    assert "Traceback" not in result.stderr
    assert summary(run_dir)["status"] == "failed" and latest(run_dir) == "step4"
    assert last_step(run_dir) == 4 and not (run_dir / "model").exists()

    # The checkpoint loads, and the same job fails again at the same step: usable and deterministic.
    again = resume(run_train, run_dir)
    assert again.returncode == 1 and "loss is nan at step 5" in again.stderr
    assert summary(run_dir)["resumed_from_step"] == 4


def test_a_sweep_rerun_with_resume_auto_resumes_every_job_in_its_own_directory(run_train, tmp_path):
    """A requeued sweep: the same command and sweep directory; each job continues from its checkpoint."""
    sweep = tmp_path / "sweep"
    args = ["-m", "deepspeed=z0,z2", *RUN, "train.max_steps=2", "resume=auto", f"hydra.sweep.dir={sweep}"]
    for attempt in (1, 2):
        result = run_train(*args, timeout=900)
        assert result.returncode == 0, (attempt, result.stderr[-3000:])
    for job in ("0", "1"):
        assert summary(sweep / job)["status"] == "completed"
        assert summary(sweep / job)["resumed_from_step"] == 2
        assert [m["step"] for m in metrics(sweep / job)] == [1, 2]
