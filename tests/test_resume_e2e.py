"""Resume and preemption, end to end: runs killed (SIGKILL, SIGTERM, during a save) and resumed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

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
# A hang in a collective fails in 5 minutes instead of DeepSpeed's 30 (see the known issue in docs/runs.md).
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
    # Step N+2 hangs on rank 0 (the test's fault hook), so the kill cannot come after the run's short
    # steps have all finished between two looks at its metrics.
    hang = {**isolated_env, "LAUNCHER_TEST_FAULT": f"0:{N + 2}:hang"}
    process = start(run_dir, [*RUN, *WORLDS[world]], hang)
    wait_for(process, lambda: last_step(run_dir) >= N + 1 and latest(run_dir) == f"step{N}")
    kill_group(process)
    assert last_step(run_dir) == N + 1

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
    finished = summary(run_dir)
    again = run_train(*args, timeout=900)  # a requeued job: same command, same directory
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resume: {run_dir} already finished at step 2" in again.stderr  # a finished run stays as it is
    assert summary(run_dir) == finished
    longer = [arg if arg != "train.max_steps=2" else "train.max_steps=3" for arg in args]
    more = run_train(*longer, timeout=900)  # the same job given more steps: continues from its checkpoint
    assert more.returncode == 0, more.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 2
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3]

    mismatch = run_train(f"resume={run_dir}", "precision=bf16", timeout=300)
    assert mismatch.returncode == 2
    (line,) = [line for line in mismatch.stderr.splitlines() if line.startswith("error:")]
    assert "precision fp32 -> bf16" in line

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
    longer = [arg if arg != "train.max_steps=2" else "train.max_steps=3" for arg in args]
    for attempt, command in enumerate((args, longer, longer)):
        result = run_train(*command, timeout=900)
        assert result.returncode == 0, (attempt, result.stderr[-3000:])
    assert result.stderr.count("already finished at step 3") == 2  # the third: nothing left to train
    for job in ("0", "1"):
        assert summary(sweep / job)["status"] == "completed"
        assert summary(sweep / job)["resumed_from_step"] == 2
        assert [m["step"] for m in metrics(sweep / job)] == [1, 2, 3]


# ----------------------------------------------------------------------------- the resume matrix
# Resumed from every save point of one uninterrupted run (its directory copied, only the resumed
# checkpoint kept, as a kill after that save leaves it), each continuation must equal it bitwise: the
# loss and gradient-norm curves, every rank's random state and the final weights. Data sizes put the
# save points mid-epoch, on an epoch's end, and before a dropped partial batch (drop_last).
MATRIX_STEPS, MATRIX_SAVE = 12, 3  # checkpoints at steps 3, 6 and 9 (and 12, the final one)
MATRIX_RUN = [
    "logger=none",
    "train.micro_batch_size=8",
    f"train.max_steps={MATRIX_STEPS}",
    f"train.save_every={MATRIX_SAVE}",
    "train.keep_checkpoints=10",
    "train.eval_every=4",  # evaluations between checkpoints: the eval loader must not shift the random state
    "data.eval_accuracy=false",
    "train.seed=1",
]
MATRIX = {  # id: (data= kind, train records, num_workers, world size)
    "shapes-n24-w0": ("shapes", 24, 0, 1),  # 3 batches an epoch: every save point ends an epoch
    "shapes-n44-w0": ("shapes", 44, 0, 1),  # 5 batches and 4 records dropped each epoch
    "shapes-n64-w0": ("shapes", 64, 0, 1),  # 8 batches: save points inside the first and second epoch
    "llava_json-n24-w2": ("llava_json", 24, 2, 1),
    "llava_json-n44-w2": ("llava_json", 44, 2, 1),
    "llava_json-n64-w2": ("llava_json", 64, 2, 1),
    "shapes-n44-w2-z3-ws2": ("shapes", 44, 2, 2),  # 2 batches a rank and epoch
}


def matrix_args(kind: str, n_train: int, workers: int, world: int, data_dir: Path) -> list[str]:
    if kind == "shapes":
        data = [f"data.n_train={n_train}", "data.n_eval=16"]
    else:  # a file in LLaVA format: the shapes set, written where the test says
        from launcher.data.shapes import generate_shapes

        train_json, eval_json, images = generate_shapes(data_dir, seed=0, n_train=n_train, n_eval=16, image_size=32)
        data = ["data=llava_json", f"data.path={train_json}", f"data.eval_path={eval_json}"]
        data.append(f"data.image_root={images}")
    return [*MATRIX_RUN, *data, f"data.num_workers={workers}", *WORLDS[world]]


def resumed_copy(reference: Path, run_dir: Path, step: int, damage: int | None = None) -> None:
    """`reference` as a kill after step `step`'s save leaves it (and, with `damage`, also checkpoint
    `damage`, newer, with one of its files truncated)."""
    shutil.copytree(reference, run_dir)
    kept = {f"step{step}"} | ({f"step{damage}"} if damage else set())
    for tag in (run_dir / "checkpoints").iterdir():
        if tag.name.startswith("step") and tag.name not in kept:
            shutil.rmtree(tag)
    (run_dir / "checkpoints" / "latest").write_text(f"step{damage or step}")


def final_state(run_dir: Path, world: int) -> tuple[list[Any], bytes]:
    """Every rank's saved random state at the last step (as plain lists), and the final weights' bytes."""
    last = run_dir / "checkpoints" / f"step{MATRIX_STEPS}"
    rng = [plain(torch.load(last / f"launcher_rank{r}.pt", weights_only=False)["rng"]) for r in range(world)]
    return rng, (run_dir / "model" / "model.safetensors").read_bytes()


def plain(value: Any) -> Any:
    """Tensors and arrays as lists, recursively, so that states compare with ==."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


def curves(run_dir: Path) -> dict[str, list[float]]:
    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == list(range(1, MATRIX_STEPS + 1))
    return {key: [m[key] for m in rows] for key in ("train/loss", "train/grad_norm", "train/lr")}


@pytest.mark.parametrize("case", list(MATRIX))
def test_resume_from_every_save_point_is_bitwise_identical(run_train, tmp_path, case):
    kind, n_train, workers, world = MATRIX[case]
    reference = tmp_path / "reference"
    result = run_train(*matrix_args(kind, n_train, workers, world, tmp_path / "data"), f"hydra.run.dir={reference}")
    assert result.returncode == 0, result.stderr[-3000:]
    expected, expected_state = curves(reference), final_state(reference, world)
    for step in range(MATRIX_SAVE, MATRIX_STEPS, MATRIX_SAVE):
        run_dir = tmp_path / f"from{step}"
        resumed_copy(reference, run_dir, step)
        result = resume(run_train, run_dir)
        assert result.returncode == 0, result.stderr[-3000:]
        assert summary(run_dir)["resumed_from_step"] == step
        assert curves(run_dir) == expected, f"{case}: resumed from step {step}"
        rng, weights = final_state(run_dir, world)
        assert rng == expected_state[0], f"{case}: random state at step {MATRIX_STEPS}, resumed from step {step}"
        assert weights == expected_state[1], f"{case}: final weights, resumed from step {step}"


def test_a_damaged_newest_checkpoint_is_named_and_the_older_one_resumed(run_train, tmp_path):
    """A truncated file in the newest checkpoint: one line names it, and the run continues, bitwise,
    from the checkpoint before it."""
    reference = tmp_path / "reference"
    result = run_train(*matrix_args("shapes", 44, 0, 1, tmp_path), f"hydra.run.dir={reference}")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    resumed_copy(reference, run_dir, 3, damage=6)
    damaged = run_dir / "checkpoints" / "step6" / "mp_rank_00_model_states.pt"
    size = damaged.stat().st_size
    with open(damaged, "r+b") as handle:
        handle.truncate(size // 2)

    result = resume(run_train, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "is damaged" in line]
    expected = f"checkpoint step6 is damaged ({damaged}: {size // 2} bytes, {size} at save); resuming from step3"
    assert line == f"warning: {expected}"
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["resumed_from_step"] == 3
    assert curves(run_dir) == curves(reference)

    # Every checkpoint damaged: the resume is refused in one line and the finished run is left as it was.
    for tag in (run_dir / "checkpoints").glob("step*"):
        with open(tag / "mp_rank_00_model_states.pt", "r+b") as handle:
            handle.truncate(100)
    finished = (run_dir / "summary.json").read_bytes()
    refused = resume(run_train, run_dir)
    assert refused.returncode == 2
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert f"every checkpoint in {run_dir / 'checkpoints'} is damaged" in line
    assert (run_dir / "summary.json").read_bytes() == finished


def test_a_resume_with_more_steps_says_once_that_the_schedule_is_re_stretched(run_train, tmp_path):
    """train.max_steps 4 -> 8 on resume: DeepSpeed restores only the scheduler's step count, so the cosine
    schedule is rebuilt for 8 steps and the learning rate jumps at step 5; one line says so, with both rates."""
    run_dir = tmp_path / "run"
    short = [arg for arg in RUN if not arg.startswith(("train.max_steps=", "train.save_every="))]
    first = run_train(*short, "train.max_steps=4", "train.save_every=2", f"hydra.run.dir={run_dir}", timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]

    more = resume(run_train, run_dir, "train.max_steps=8")
    assert more.returncode == 0, more.stderr[-3000:]
    (line,) = [line for line in more.stderr.splitlines() if "learning-rate schedule" in line]
    lr = {m["step"]: m["train/lr"] for m in metrics(run_dir)}
    assert line == (
        "resume: train.max_steps 4 -> 8: the learning-rate schedule is re-stretched to 8 steps from step 5 on "
        f"(lr at step 5: {5e-5:.1e} -> {lr[5]:.1e})"  # the 4-step schedule had reached its floor, 0.05 x lr
    )
    assert summary(run_dir)["status"] == "completed" and summary(run_dir)["resumed_from_step"] == 4
    assert sorted(lr) == list(range(1, 9)) and lr[5] > lr[4]
