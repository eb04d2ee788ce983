"""A stop signal in every phase of a job, as schedulers and terminals deliver them (issue 28's matrix).

Each case holds the job in one phase with the test hook `LAUNCHER_TEST_PAUSE=PHASE:SECONDS:FILE`
(launcher.core.signals.pause_for_test: held until the stop reaches it) and signals it once it is there, so
the signal lands inside that phase, with its DataLoader workers alive, however loaded the machine is: during
an evaluation, a checkpoint's save, the data cache build, planning, an export and `launcher.prepare`. The
cases cover, between them, each way a signal arrives (the launcher only, its process group as `timeout` and
a terminal send it, every process as SLURM does), each stop signal, 1 and 2 ranks, ZeRO 0 and 3, 0 and 2
workers; a stop during a train step: tests/e2e/test_resume.py. What each ending leaves: the table in
docs/runs.md ("What each ending leaves").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.core.rundir import RunDir
from launcher.core.signals import PAUSE_ENV
from tests.helpers import (
    ROOT,
    last_step,
    latest,
    read_metrics,
    read_summary,
    run_train_py,
    signal_every_process,
    signal_group,
    start_train,
    wait_for,
)

pytestmark = pytest.mark.slow

STEPS = 6
RUN = (
    "logger=none",
    "train.micro_batch_size=8",
    "data.n_train=64",
    "data.n_eval=16",
    "data.eval_accuracy=false",
    f"train.max_steps={STEPS}",
    "train.save_every=3",
    "train.eval_every=2",
    "train.seed=1",
)
TWO_RANKS = ("dist.nproc_per_node=2", "dist.timeout_s=300")
PAUSE_S = 600  # a safety net: a held process goes on once the stop reaches it


def start_paused(env: dict[str, str], tmp_path: Path, phase: str, *args: str, command: tuple[str, ...] = ()) -> tuple:
    """`python train.py ARGS` (or `command`) in its own process group, to be held in `phase`; (process, the
    file that says it is there)."""
    mark = tmp_path / f"in-{phase}"
    env = {**env, PAUSE_ENV: f"{phase}:{PAUSE_S}:{mark}"}
    log = tmp_path / f"{phase}-{time.monotonic_ns()}.out"
    if not command:
        return start_train(env, *args, log=log), mark
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, *command, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    return process, mark


def ended(process: subprocess.Popen, family: list[psutil.Process] = ()) -> int:
    """The job's exit code, once it and every process it had (ranks, agents, workers) are gone."""
    code = process.wait(timeout=300)
    _, alive = psutil.wait_procs(list(family), timeout=30)
    assert not alive, f"left running: {alive}"
    return code


def output(tmp_path: Path, phase: str) -> str:
    return "".join(path.read_text() for path in sorted(tmp_path.glob(f"{phase}-*.out")))


def assert_stopped_with_a_checkpoint(run_dir: Path, step: int) -> None:
    """Preempted after `step`: its checkpoint complete and `latest`, metrics.jsonl up to it, summary honest."""
    summary = read_summary(run_dir)
    assert summary["status"] == "preempted" and summary["steps"] == step, summary
    assert latest(run_dir) == f"step{step}" and RunDir(run_dir).marker(f"step{step}").is_file()
    assert last_step(run_dir) == step
    assert not (RunDir(run_dir).model / "config.json").exists()  # the final model waits for the last step


def resume_to_the_end(run_train, run_dir: Path) -> None:
    result = run_train(f"resume={run_dir}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(run_dir)["status"] == "completed"


def uninterrupted(env: dict[str, str], tmp_path: Path, *overrides: str) -> list[dict]:
    """The metrics of the job run to its end."""
    # Run as a process of its own, like the runs it is compared with: the test process's own arithmetic once
    # differed from a started rank's in the 7th digit after other tests had run in it (issue 45), whatever
    # its thread count.
    result = run_train_py(env, *RUN, *overrides, f"hydra.run.dir={tmp_path / 'uninterrupted'}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(tmp_path / "uninterrupted")


# ----------------------------------------------------------------------------- during an evaluation, a save
def test_a_stop_during_an_evaluation_then_one_during_a_save_and_the_resumes_end_bitwise(
    run_train, isolated_env, tmp_path
):
    """1 rank, ZeRO-0, 2 workers. SIGTERM to the process group while step 2's evaluation runs: the ranks agree
    on the stop in the evaluation's own all-reduce, so the run saves at step 2 (not after one more step), that
    evaluation recorded. Its resume gets SIGHUP (a closed terminal) at the launcher alone while step 3's
    checkpoint is written: the save completes (marked complete, kept) and the rank stops after step 4 with a
    checkpoint there. The last resume ends with the uninterrupted run's losses and evaluations, bitwise."""
    overrides = ("deepspeed=z0", "data.num_workers=2")
    run_dir = tmp_path / "run"
    process, mark = start_paused(isolated_env, tmp_path, "eval", *RUN, *overrides, f"hydra.run.dir={run_dir}")
    wait_for(process, mark.exists)
    family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    os.killpg(process.pid, signal.SIGTERM)
    assert ended(process, family) == 143, output(tmp_path, "eval")[-3000:]
    assert_stopped_with_a_checkpoint(run_dir, 2)
    assert "eval/loss" in read_metrics(run_dir)[-1]

    # Held between DeepSpeed's files of step 3 and the checkpoint's completion marker until the stop comes.
    process, mark = start_paused(isolated_env, tmp_path, "save-step3", f"resume={run_dir}")
    wait_for(process, mark.exists)
    process.send_signal(signal.SIGHUP)
    assert ended(process) == 143, output(tmp_path, "save")[-3000:]
    assert_stopped_with_a_checkpoint(run_dir, 4)
    assert RunDir(run_dir).marker("step3").is_file()

    resume_to_the_end(run_train, run_dir)
    expected = uninterrupted(isolated_env, tmp_path, *overrides)
    assert [arithmetic(row) for row in read_metrics(run_dir)] == [arithmetic(row) for row in expected]


def arithmetic(row: dict) -> dict:
    """A metrics line without what differs between two runs of the same arithmetic (times, rates, memory)."""
    return {key: value for key, value in row.items() if not key.startswith(("perf/", "mem/"))}


# ----------------------------------------------------------------------------- 2 ranks: a cache build, an evaluation
def test_two_ranks_stopped_during_the_cache_build_then_during_an_evaluation(isolated_env, tmp_path):
    """2 ranks, ZeRO-0, 2 workers, SIGQUIT to every process (the cache build's DataLoader workers among them)
    while the training split's cache is built: that split's build finishes (its one shard was being written),
    the held-out split's is not begun, the ranks agree to stop and the job ends "interrupted" (exit 143,
    0 steps, one line). Then 2 ranks at ZeRO-3 without workers start on that cache (reused) and get Ctrl-C's
    SIGINT at every process (the launcher, torch's agent, both ranks) inside step 2's evaluation: "preempted"
    at step 2 with a complete checkpoint, exit 143, nothing left running."""
    cache = tmp_path / "cache"
    run_dir = tmp_path / "run"
    args = (*RUN, *TWO_RANKS, f"cache_dir={cache}")
    process, mark = start_paused(
        isolated_env, tmp_path, "cache", *args, "deepspeed=z0", "data.num_workers=2", f"hydra.run.dir={run_dir}"
    )
    wait_for(process, mark.exists)
    family = signal_every_process(process, signal.SIGQUIT)
    assert ended(process, family) == 143, output(tmp_path, "cache")[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["steps"] == 0, summary
    assert "while building the data cache" in summary["error"] and "shards are written and kept" in summary["error"]
    said = output(tmp_path, "cache")
    assert "Traceback" not in said and "DataLoader worker" not in said
    complete = sorted(path.parent for path in (cache / "data_cache").glob("*/meta.json"))
    assert len(complete) == 1  # the training split's

    run_dir = tmp_path / "again"
    process, mark = start_paused(
        isolated_env, tmp_path, "eval", *args, "deepspeed=z3", "data.num_workers=0", f"hydra.run.dir={run_dir}"
    )
    wait_for(process, mark.exists)
    family = signal_every_process(process, signal.SIGINT)
    assert ended(process, family) == 143, output(tmp_path, "eval")[-3000:]
    assert_stopped_with_a_checkpoint(run_dir, 2)
    assert read_summary(run_dir)["data_cache"]["path"] == str(complete[0])
    assert read_summary(run_dir)["data_cache"]["built"] is False
    assert "Traceback" not in output(tmp_path, "eval")


# ----------------------------------------------------------------------------- during a reference pass
def test_sigterm_during_the_reference_pass_stops_it_within_a_forward_pass_and_the_same_command_computes_it(
    isolated_env, tmp_path
):
    """DPO with a precomputed reference, 1 rank, 1 worker: SIGTERM to the group while the pass computes its
    first chunk (the training pairs', after its first forward pass): the pass stops before its next forward
    pass, not at the end of the chunk (a chunk takes minutes on a large model), the chunk under way is
    dropped, and the job ends "interrupted" (exit 143, 0 steps, one line). The same command then computes
    the whole reference and trains from log 2."""
    cache = tmp_path / "cache"
    args = (*RUN, "loss=dpo", "data.task=colour", "data.num_workers=1", f"cache_dir={cache}")
    process, mark = start_paused(isolated_env, tmp_path, "reference", *args, f"hydra.run.dir={tmp_path / 'run'}")
    wait_for(process, mark.exists)
    signal_group(process, signal.SIGTERM)
    assert ended(process) == 143, output(tmp_path, "reference")[-3000:]
    summary = read_summary(tmp_path / "run")
    assert summary["status"] == "interrupted" and summary["steps"] == 0, summary
    assert "while computing the reference log-probs" in summary["error"] and "\n" not in summary["error"]
    assert "Traceback" not in output(tmp_path, "reference")
    (reference,) = (cache / "reference").iterdir()
    assert not list(reference.glob("*.npy")) and not (reference / "meta.json").exists()

    process = start_train(isolated_env, *args, f"hydra.run.dir={tmp_path / 'again'}", log=tmp_path / "again.out")
    assert ended(process) == 0, (tmp_path / "again.out").read_text()[-3000:]
    assert (reference / "meta.json").is_file()
    assert "computing the log-probs of 80 pairs once, into" in (tmp_path / "again.out").read_text()
    assert sorted(path.name for path in reference.glob("*.npy")) == ["eval-00000.npy", "train-00000.npy"]
    assert read_metrics(tmp_path / "again")[0]["train/loss"] == pytest.approx(0.6931471805599453, abs=1e-6)


# ----------------------------------------------------------------------------- at the first line
def test_sighup_in_train_pys_first_moments_ends_the_job_interrupted_with_a_summary(isolated_env, tmp_path):
    """A terminal closed while `python train.py` starts (before Hydra, its config not yet composed): the stop
    is remembered from train.py's first statement, so the job still gets its run dir and a summary saying
    "interrupted" (exit 143, one line). It used to die of the signal with nothing written (exit 129)."""
    run_dir = tmp_path / "run"
    process, mark = start_paused(isolated_env, tmp_path, "start", *RUN, f"hydra.run.dir={run_dir}")
    wait_for(process, mark.exists)
    process.send_signal(signal.SIGHUP)
    assert ended(process) == 143, output(tmp_path, "start")[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["steps"] == 0
    assert summary["error"] == "stopped by SIGHUP before training started; start the job again"
    assert output(tmp_path, "start").strip().splitlines()[-1] == f"error: {summary['error']}"
    assert not RunDir(run_dir).job.exists()


# ----------------------------------------------------------------------------- during planning
def test_sigusr1_to_the_group_while_planning_ends_the_job_interrupted_before_any_rank(isolated_env, tmp_path):
    """SLURM's warning signal to the process group while the launcher plans a 2-rank job: "interrupted",
    exit 143, 0 steps, one line; no rank started, no job.json (the plan the ranks read) written."""
    run_dir = tmp_path / "run"
    process, mark = start_paused(isolated_env, tmp_path, "plan", *RUN, *TWO_RANKS, f"hydra.run.dir={run_dir}")
    wait_for(process, mark.exists)
    assert not psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGUSR1)
    assert ended(process) == 143
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["steps"] == 0
    assert summary["error"] == "stopped by SIGUSR1 before training started; start the job again"
    assert not RunDir(run_dir).job.exists()
    assert "Traceback" not in output(tmp_path, "plan")


# ----------------------------------------------------------------------------- during an export, a prepare
def test_sigterm_to_the_group_during_an_export_leaves_nothing_written(isolated_env, tmp_path, quick_run):
    """`python -m launcher.export` stopped while it writes: exit 143, one line, neither the export nor its
    partial directory left."""
    out = tmp_path / "exported"
    process, mark = start_paused(
        isolated_env, tmp_path, "export", str(quick_run.run_dir), "--out", str(out), command=("-m", "launcher.export")
    )
    wait_for(process, mark.exists)
    os.killpg(process.pid, signal.SIGTERM)
    assert ended(process) == 143
    assert output(tmp_path, "export").strip().splitlines()[-1] == (
        "error: export stopped by SIGTERM; nothing was written (run it again)"
    )
    assert not out.exists() and not list(tmp_path.glob(".exported*"))


def test_sigint_during_prepare_keeps_the_shards_built_and_the_same_command_finishes_it(isolated_env, tmp_path):
    """`python -m launcher.prepare` and Ctrl-C while the training split's cache is built (2 workers): that
    shard is finished and kept, the held-out split's build is not begun; exit 143 and one line. The same
    command again builds only what is missing."""
    args = ("data.n_train=64", "data.n_eval=16", "data.num_workers=2", f"cache_dir={tmp_path / 'cache'}")
    process, mark = start_paused(isolated_env, tmp_path, "cache", *args, command=("-m", "launcher.prepare"))
    wait_for(process, mark.exists)
    os.killpg(process.pid, signal.SIGINT)
    assert ended(process) == 143
    last = output(tmp_path, "cache").strip().splitlines()[-1]
    assert last.startswith("error: stopped by a signal while building the data cache"), last
    assert "0 of its 1 shards are written and kept" in last

    again = subprocess.run(
        [sys.executable, "-m", "launcher.prepare", *args], cwd=ROOT, env=isolated_env, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "reused" in again.stdout.splitlines()[1] and "built in" in again.stdout.splitlines()[2]
