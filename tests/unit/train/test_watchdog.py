"""launcher.train.watchdog: a hung step ends its rank with its stacks and one line for the user.

The watchdog ends its process with `os._exit`, so every test in which it may fire runs in a subprocess:
a small script written to tmp_path, run as a rank would be (it imports no torch: a second each), then
judged by its exit code and its files, and by the line the launcher makes of them
(launcher.launch.ranks.outcome).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from launcher.config.precision import Device
from launcher.config.ranges import check_config
from launcher.core.errors import LauncherError, TrainingFailed
from launcher.core.rundir import RunDir
from launcher.job.planning import plan_job
from launcher.job.spec import Job
from launcher.launch.ranks import free_port, outcome
from launcher.train.watchdog import StepWatchdog
from tests.helpers import ROOT, compose_typed, hydra_job

HEADER = """
import socket, sys, time
from pathlib import Path
from launcher.train.watchdog import StepWatchdog
run_dir = Path(sys.argv[1])
"""


def _script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "rank.py"
    script.write_text(HEADER + textwrap.dedent(body))
    return script


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(script: Path, *args: str, timeout: float = 30) -> tuple[subprocess.CompletedProcess, float]:
    """Run `script RUN_DIR ARGS...` to its end; the result and how long it took."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), *args], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    return done, time.monotonic() - started


def _record(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / "errors" / f"rank{rank}.json").read_text())


def job_of(run_dir: Path, world_size: int = 1, zero_stage: int = 0) -> Job:
    """The job the launcher planned: its world size and ZeRO stage are what a rank's line is judged by."""
    overrides = [f"dist.nproc_per_node={world_size}", f"deepspeed=z{zero_stage}"]
    device = Device("cpu", bf16=True, fp16=False)
    job = plan_job(
        compose_typed(overrides), hydra_job(overrides, run_dir), device=device, hidden_size=64, validate=False
    )
    assert (job.world_size, job.zero_stage) == (world_size, zero_stage)
    return job


# ----------------------------------------------------------------------------- a hung step ends its rank
BLOCKING = {
    "sleep": "time.sleep(60)",
    "busy Python loop": "while True: pass",  # holds the GIL but for the switch interval
    "socket recv": "pair = socket.socketpair(); pair[0].recv(1)",  # blocked in C, as in a collective
}


@pytest.mark.parametrize("how", list(BLOCKING))
def test_a_hung_step_ends_the_rank_with_its_stacks_and_one_line(tmp_path, how):
    run_dir = tmp_path / "run"
    script = _script(
        tmp_path,
        f"""
        def stuck_in_step():
            {BLOCKING[how]}

        watchdog = StepWatchdog(run_dir, 0, 1)
        with watchdog.step(3):
            stuck_in_step()
        """,
    )
    done, took = _run(script, str(run_dir))
    assert done.returncode == TrainingFailed.exit_code, done.stderr
    assert took < 8
    assert done.stdout == done.stderr == ""  # a failing rank prints nothing: the launcher shows its record
    stacks = (run_dir / "errors" / "rank0_stacks.txt").read_text()
    assert "stuck_in_step" in stacks
    record = _record(run_dir, 0)
    assert record["exit_code"] == 1
    assert record["error"].startswith("step 3 did not finish within dist.step_timeout_s=1 s (")
    assert "\n" not in record["error"] and str(run_dir / "errors" / "rank0_stacks.txt") in record["error"]
    assert "raise dist.step_timeout_s" in record["error"]
    assert (run_dir / "errors" / "rank0.txt").read_text() == stacks  # the "traceback" the launcher points to

    # The line the launcher (the ranks' parent) raises, and prints as "error: ..."
    with pytest.raises(TrainingFailed) as failed:
        outcome(job_of(run_dir), RunDir(run_dir), done.returncode)
    assert str(failed.value) == f"rank 0: {record['error']} (traceback: {run_dir / 'errors' / 'rank0.txt'})"


@pytest.mark.parametrize(("timeout_s", "world_size", "zero_stage"), [(0, 2, 3), (60, 2, 3), (60, 1, 3), (0, 2, 2)])
def test_a_rank_killed_by_a_signal_mid_step_is_named_with_its_step(tmp_path, timeout_s, world_size, zero_stage):
    """A rank that dies by SIGABRT (as gloo and NCCL end one) records nothing; its step file survives it,
    and the launcher's line names the step, with the cause's hint where other ranks were involved."""
    run_dir = tmp_path / "run"
    script = _script(
        tmp_path,
        f"""
        import os
        watchdog = StepWatchdog(run_dir, 1, {timeout_s})
        for step in (1, 2):
            with watchdog.step(step):
                pass
        with watchdog.step(3):
            os.abort()
        """,
    )
    run_dir.mkdir()
    done, _ = _run(script, str(run_dir))
    assert done.returncode == -6
    assert not (run_dir / "errors" / "rank1.json").exists()
    with pytest.raises(TrainingFailed) as failed:
        outcome(job_of(run_dir, world_size, zero_stage), RunDir(run_dir), 128 + 6)  # as torchrun reports signal 6
    line = str(failed.value)
    assert line.startswith("step 3: a rank was killed by SIGABRT")
    assert line.endswith(f"; checkpoints saved before it resume with resume={run_dir}")
    assert ("another rank failed" in line) == (world_size > 1)
    assert ("keep data.modality_guard on" in line) == (world_size > 1 and zero_stage == 3)


def test_a_rank_killed_between_steps_names_no_step(tmp_path):
    run_dir = tmp_path / "run"
    watchdog = StepWatchdog(run_dir, 0, 0)
    with watchdog.step(4):
        assert (run_dir / "errors" / "rank0.in_step").read_text().strip() == "4"
    assert (run_dir / "errors" / "rank0.in_step").read_text().strip() == ""  # evaluating, saving: not a step
    with pytest.raises(TrainingFailed, match=r"^a rank was killed by SIGKILL \(the kernel's out-of-memory"):
        outcome(job_of(run_dir, 2, 3), RunDir(run_dir), -9)
    watchdog.close()
    assert not (run_dir / "errors").exists()


def test_an_announcing_watchdog_prints_the_line_itself(tmp_path):
    """Under SLURM no parent launcher reads errors/: the rank prints its one line before it ends."""
    run_dir = tmp_path / "run"
    script = _script(
        tmp_path,
        """
        watchdog = StepWatchdog(run_dir, 2, 1, announce=True)
        with watchdog.step(7):
            time.sleep(60)
        """,
    )
    done, _ = _run(script, str(run_dir))
    assert done.returncode == TrainingFailed.exit_code
    assert done.stderr.splitlines() == [f"error: rank 2: {_record(run_dir, 2)['error']}"]
    assert "step 7 did not finish" in done.stderr


def test_steps_that_finish_in_time_never_fire(tmp_path):
    """Many quick steps, a step that raises, and idle time between steps longer than the timeout."""
    run_dir = tmp_path / "run"
    script = _script(
        tmp_path,
        """
        watchdog = StepWatchdog(run_dir, 0, 0.5)
        for step in range(200):
            with watchdog.step(step):
                time.sleep(0.001)
        try:
            with watchdog.step(200):
                raise ValueError("a failing step disarms too")
        except ValueError:
            pass
        with watchdog.step(201):
            time.sleep(0.1)
        time.sleep(1.0)  # no step armed: the rank evaluates, saves, or waits, as long as it likes
        watchdog.close()
        watchdog.close()
        """,
    )
    done, _ = _run(script, str(run_dir))
    assert done.returncode == 0, done.stderr
    assert not (run_dir / "errors").exists()


# ----------------------------------------------------------------------------- on and off, in this process
@pytest.mark.parametrize("timeout_s", [0, None])
def test_a_disabled_watchdog_starts_no_thread(tmp_path, timeout_s):
    before = set(threading.enumerate())
    watchdog = StepWatchdog(tmp_path, 0, timeout_s)
    with watchdog.step(1):
        time.sleep(0.01)
    assert set(threading.enumerate()) == before
    watchdog.close()
    assert not (tmp_path / "errors").exists()


def test_an_enabled_watchdog_has_one_thread_until_closed(tmp_path):
    watchdog = StepWatchdog(tmp_path, 0, 60)
    for step in range(3):
        with watchdog.step(step):
            pass
    assert [t.name for t in threading.enumerate()].count("step-watchdog") == 1
    watchdog.close()
    watchdog.close()
    assert "step-watchdog" not in [t.name for t in threading.enumerate()]


def test_a_negative_timeout_is_refused_with_the_key_to_fix():
    """Refused with the config's other ranges (launcher.config.ranges), before any rank starts: the
    watchdog itself no longer checks its timeout."""
    with pytest.raises(
        LauncherError, match=r"^dist.step_timeout_s=-1(\.0)? must be a number of seconds, or 0 \(or null\)"
    ):
        check_config(compose_typed(["dist.step_timeout_s=-1"]))
    check_config(compose_typed(["dist.step_timeout_s=null"]))
    check_config(compose_typed(["dist.step_timeout_s=0"]))


# ----------------------------------------------------------------------------- a real collective
@pytest.mark.slow  # two processes that import torch: several seconds on two cores
def test_a_rank_stuck_in_a_gloo_collective_is_ended(tmp_path):
    """Rank 0 enters all_reduce, rank 1 never does: rank 0 ends within its timeout, not dist.timeout_s."""
    run_dir = tmp_path / "run"
    timeout_s = 2
    script = _script(
        tmp_path,
        f"""
        from datetime import timedelta
        import torch
        import torch.distributed as dist

        rank = int(sys.argv[2])
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))

        def collective_step():
            dist.all_reduce(torch.ones(4))

        watchdog = StepWatchdog(run_dir, rank, {timeout_s})
        if rank == 0:
            (run_dir / "armed").write_text(repr(time.time()))
            with watchdog.step(5):
                collective_step()
        else:
            time.sleep(60)  # skipped the collective rank 0 waits in
        """,
    )
    run_dir.mkdir()
    env = {**_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen([sys.executable, str(script), str(run_dir), str(rank)], env=env, cwd=ROOT, text=True)
        for rank in (0, 1)
    ]
    try:
        assert ranks[0].wait(timeout=60) == TrainingFailed.exit_code
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    stacks = run_dir / "errors" / "rank0_stacks.txt"
    armed = float((run_dir / "armed").read_text())
    assert timeout_s - 0.1 <= stacks.stat().st_mtime - armed < timeout_s + 3
    assert "all_reduce" in stacks.read_text() and "collective_step" in stacks.read_text()
    assert _record(run_dir, 0)["error"].startswith("step 5 did not finish within dist.step_timeout_s=2 s")
    assert not (run_dir / "errors" / "rank1.json").exists()
