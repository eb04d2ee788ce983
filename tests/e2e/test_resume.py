"""Preemption and kills, as schedulers deliver them, then `resume=`: `python train.py` in its own process
group, stopped by SIGTERM (saved, "preempted", exit 143) and killed by SIGKILL (after a checkpoint, and
during a save), at one rank and at two (torchrun, ZeRO-3); each resumed run ends with the losses of an
uninterrupted one, bitwise.

Resume decisions and resumes without a signal: tests/unit/job/test_resume.py and
tests/unit/train/test_trainer.py (the resume matrix at one rank).
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher.core.rundir import RunDir
from launcher.core.signals import PAUSE_ENV
from tests.helpers import (
    kill_group,
    last_step,
    latest,
    losses,
    plain,
    read_metrics,
    read_summary,
    run_train_py,
    signal_every_process,
    start_train,
    subprocess_env,
    wait_for,
)

pytestmark = pytest.mark.slow

N = 4  # a checkpoint every N steps; runs are 2N steps
RUN = (
    "logger=none",
    "train.micro_batch_size=8",
    f"train.max_steps={2 * N}",
    f"train.save_every={N}",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
)
# Two ranks: ZeRO-3 on 44 records (2 micro-batches a rank and epoch, 6 dropped), DataLoader workers,
# evaluations between checkpoints; a checkpoint every 3 steps (mid-epoch at 3 and 9, an epoch's end at 6).
STEPS, SAVE = 12, 3
TWO_RANKS = (
    "logger=none",
    "train.micro_batch_size=8",
    f"train.max_steps={STEPS}",
    f"train.save_every={SAVE}",
    "train.keep_checkpoints=10",
    "train.eval_every=4",
    "data.eval_accuracy=false",
    "train.seed=1",
    "data.n_train=44",
    "data.n_eval=16",
    "data.num_workers=2",
    "dist.nproc_per_node=2",
    "deepspeed=z3",
    "dist.timeout_s=300",  # a hang in a collective fails in 5 minutes, not DeepSpeed's 30 (docs/runs.md)
)


def start(env: dict[str, str], run_dir: Path, *args: str) -> subprocess.Popen:
    """`python train.py ARGS` in its own process group (so the test can signal every process of it)."""
    return start_train(env, *args, log=run_dir.parent / f"{run_dir.name}-{time.monotonic_ns()}.out")


def held(env: dict[str, str], run_dir: Path, phase: str) -> tuple[dict[str, str], Path]:
    """The environment that holds the ranks in `phase` until a stop reaches them (a kill ends it too), and the
    file that says they are there (launcher.core.signals.pause_for_test): each signal and kill lands at that
    point, however loaded the machine is; 600 s is only a safety net."""
    mark = run_dir.parent / f"in-{phase}-{time.monotonic_ns()}"
    return {**env, PAUSE_ENV: f"{phase}:600:{mark}"}, mark


def preempt(env: dict[str, str], run_dir: Path, args: tuple[str, ...]) -> int:
    """Start the job, SIGTERM its launcher while the ranks are held after step 2: the launcher passes the
    signal on to the ranks, which agree on it in step 3 and save and stop there as "preempted" (exit 143).
    Returns the step it stopped after (3)."""
    hold, mark = held(env, run_dir, "step2")
    process = start(hold, run_dir, *args, f"hydra.run.dir={run_dir}")
    wait_for(process, mark.exists)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=300) == 143
    stopped = read_summary(run_dir)
    assert stopped["status"] == "preempted" and stopped["steps"] == 3
    assert latest(run_dir) == "step3" and last_step(run_dir) == 3
    return stopped["steps"]


def resume(run_train, run_dir: Path) -> None:
    # Only resume= is given: the old run's overrides come back from its run directory.
    result = run_train(f"resume={run_dir}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(run_dir)["status"] == "completed"


# ----------------------------------------------------------------------------- one rank
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the one-rank job uninterrupted."""
    # Run as a process of its own, like the runs it is compared with: the test process's own arithmetic once
    # differed from a started rank's in the 7th digit after other tests had run in it (issue 45), whatever
    # its thread count.
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_train_py(subprocess_env(run_dir.parent), *RUN, f"hydra.run.dir={run_dir}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(run_dir)) == 2 * N
    return losses(run_dir)


def test_a_preempted_run_killed_during_a_save_resumes_to_the_losses_of_an_uninterrupted_one(
    run_train, isolated_env, tmp_path, uninterrupted
):
    """SIGTERM: saved and "preempted" at step 3. Its resume is SIGKILLed while it saves step 2N (the
    checkpoint's files written, not yet marked complete): the next resume continues from the complete
    checkpoint before it (step N), and the run ends bitwise where an uninterrupted one does."""
    run_dir = tmp_path / "run"
    assert preempt(isolated_env, run_dir, RUN) < N

    in_save, mark = held(isolated_env, run_dir, f"save-step{2 * N}")  # between DeepSpeed's files and the marker
    process = start(in_save, run_dir, f"resume={run_dir}")
    wait_for(process, mark.exists)
    kill_group(process)
    previous = f"step{N}"  # the newest complete save before step 2N
    assert RunDir(run_dir).checkpoint(f"step{2 * N}").is_dir()
    assert latest(run_dir) == previous and not RunDir(run_dir).marker(f"step{2 * N}").exists()

    resume(run_train, run_dir)
    assert read_summary(run_dir)["resumed_from_step"] == N
    assert [row["step"] for row in read_metrics(run_dir)] == list(range(1, 2 * N + 1))
    assert losses(run_dir) == uninterrupted  # bitwise: same data order, same states, same arithmetic
    assert latest(run_dir) == f"step{2 * N}" and RunDir(run_dir).marker(f"step{2 * N}").is_file()
    kept = {path.name for path in RunDir(run_dir).checkpoints.glob("step*")}
    assert kept == {previous, f"step{2 * N}"}  # train.keep_checkpoints=2
    assert (RunDir(run_dir).model / "config.json").is_file()


# ----------------------------------------------------------------------------- two ranks
def final_state(run_dir: Path) -> tuple[list[Any], bytes]:
    """Every rank's saved random state at the last step (as plain lists), and the final weights' bytes."""
    last = RunDir(run_dir).checkpoint(f"step{STEPS}")
    rng = [plain(torch.load(last / f"launcher_rank{r}.pt", weights_only=False)["rng"]) for r in (0, 1)]
    return rng, (RunDir(run_dir).model / "model.safetensors").read_bytes()


def curves(run_dir: Path) -> dict[str, list[float]]:
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    return {key: [row[key] for row in rows] for key in ("train/loss", "train/grad_norm", "train/lr")}


def test_two_ranks_preempted_then_killed_after_a_checkpoint_resume_bitwise(run_train, isolated_env, tmp_path):
    """At two ranks (ZeRO-3): SIGTERM reaches the launcher, which passes it on to both ranks; the resume
    is SIGKILLed, every rank with it, after its next checkpoint; the last resume ends with the loss,
    gradient-norm and learning-rate curves, every rank's random state and the final weights of an
    uninterrupted run. (Every save point, mid-epoch and at an epoch's end, resumed bitwise at one rank:
    tests/unit/train/test_trainer.py::test_resume_from_every_save_point_is_bitwise_identical.)"""
    reference = tmp_path / "reference"
    result = run_train(*TWO_RANKS, f"hydra.run.dir={reference}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    expected, expected_state = curves(reference), final_state(reference)

    run_dir = tmp_path / "run"
    stopped = preempt(isolated_env, run_dir, TWO_RANKS)
    saved = (stopped // SAVE + 1) * SAVE  # the resume's next checkpoint
    # Both ranks held after step saved+1 (the checkpoint at `saved` complete), and killed there.
    hold, mark = held(isolated_env, run_dir, f"step{saved + 1}")
    process = start(hold, run_dir, f"resume={run_dir}")
    wait_for(process, mark.exists)
    kill_group(process)
    assert last_step(run_dir) == saved + 1 and latest(run_dir) == f"step{saved}"

    resume(run_train, run_dir)
    assert read_summary(run_dir)["resumed_from_step"] == saved
    assert curves(run_dir) == expected  # steps stopped+1.. came from the first resume, saved+1.. from this one
    assert final_state(run_dir) == expected_state


# ----------------------------------------------------------------------------- stop signals to every process
# A process group's SIGTERM (with DataLoader workers) at one rank: tests/e2e/test_stops.py.
def test_a_stop_signal_to_every_process_of_two_ranks_saves_as_preempted(isolated_env, tmp_path):
    """As SLURM stops a step (every process: the launcher, torch's agent, both ranks, their workers), here
    with Ctrl-C's SIGINT: "preempted", exit 143, a complete checkpoint at the last step. torch's agent used to
    turn it into a traceback and kill the ranks ("failed", exit 1). SIGHUP and SIGQUIT are stop signals of
    the same handlers (launcher.core.signals.STOP_SIGNALS; torch's agent: tests/unit/launch/test_torchrun.py)."""
    signum = signal.SIGINT
    run_dir = tmp_path / "run"
    hold, mark = held(isolated_env, run_dir, "step2")
    process = start(hold, run_dir, *TWO_RANKS, f"hydra.run.dir={run_dir}")
    wait_for(process, mark.exists)
    signal_every_process(process, signum)
    assert process.wait(timeout=300) == 143
    stopped = read_summary(run_dir)
    assert stopped["status"] == "preempted" and stopped["steps"] == last_step(run_dir) == 3
    assert latest(run_dir) == "step3" and RunDir(run_dir).marker("step3").is_file()
