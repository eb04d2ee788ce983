"""Resuming on another number of ranks or another ZeRO stage, end to end (issue 15's acceptance).

A run is stopped after the checkpoint of step N (a copy of an uninterrupted run's directory as a stop
there leaves it) and resumed on another shape; the steps after N must repeat the uninterrupted run's
losses to 1e-4 relative (fp32). Micro batch 1: a step's samples are the same on any world size (the
samplers deal one shuffled order), but with larger micro batches they are grouped into micro batches
differently, and the loss is a mean per micro batch over its answer tokens, which would differ
legitimately for answers of different lengths. With one sample per micro batch grouping cannot matter.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launcher.train.checkpoint import checkpoint_damage
from launcher.train.universal import DONE_FILE, KILL_CONVERSION_ENV, universal_path
from tests.test_export import export
from tests.test_sweep_e2e import inspect_summary
from tests.test_train_e2e import losses, summary

pytestmark = pytest.mark.slow

N = 4  # the checkpoint the run stops after; runs are 2N steps
GLOBAL = 8
RUN = [
    "logger=wandb",  # offline (tests/conftest.py): the resumed segment continues the same W&B run
    "train.micro_batch_size=1",
    f"train.global_batch_size={GLOBAL}",
    "train.grad_accum=null",
    f"train.max_steps={2 * N}",
    f"train.save_every={N}",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
    "precision=fp32",
    "dist.timeout_s=300",
]
SHAPES = {
    "2 ranks, ZeRO-3": ["dist.nproc_per_node=2", "deepspeed=z3"],
    "1 rank, ZeRO-0": ["dist.nproc_per_node=1", "deepspeed=z0"],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Run directories of uninterrupted runs, per shape, made on first use."""
    made: dict[str, Path] = {}

    def get(shape: str, run_train) -> Path:
        if shape not in made:
            run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
            result = run_train(*RUN, *SHAPES[shape], f"hydra.run.dir={run_dir}", timeout=900)
            assert result.returncode == 0, result.stderr[-3000:]
            assert len(losses(run_dir)) == 2 * N
            made[shape] = run_dir
        return made[shape]

    return get


def stopped_after(reference: Path, run_dir: Path, step: int) -> None:
    """`reference` as a stop after step `step`'s checkpoint leaves it."""
    shutil.copytree(reference, run_dir)
    for tag in (run_dir / "checkpoints").iterdir():
        if tag.name.startswith("step") and tag.name != f"step{step}":
            shutil.rmtree(tag)
    (run_dir / "checkpoints" / "latest").write_text(f"step{step}")
    shutil.rmtree(run_dir / "model", ignore_errors=True)


def assert_continues_like(reference: Path, run_dir: Path) -> None:
    expected, resumed = losses(reference), losses(run_dir)
    assert len(resumed) == 2 * N
    assert resumed[:N] == expected[:N]  # the steps before the stop, kept
    for step, (mine, theirs) in enumerate(zip(resumed[N:], expected[N:], strict=True), start=N + 1):
        assert abs(mine - theirs) <= 1e-4 * abs(theirs), (step, resumed, expected)


@pytest.mark.parametrize(
    ("saved", "resumed_on"),
    [
        ("2 ranks, ZeRO-3", ["dist.nproc_per_node=1", "deepspeed=z2"]),
        ("1 rank, ZeRO-0", ["dist.nproc_per_node=2", "deepspeed=z1"]),
        ("2 ranks, ZeRO-3", ["dist.nproc_per_node=2", "deepspeed=z3_offload"]),  # CPU Adam from torch's AdamW
    ],
)
def test_a_run_resumes_on_another_world_size_and_stage_with_the_same_losses(
    run_train, isolated_env, uninterrupted, tmp_path, saved, resumed_on
):
    reference = uninterrupted(saved, run_train)
    run_dir = tmp_path / "run"
    stopped_after(reference, run_dir, N)
    original = {path: path.read_bytes() for path in (run_dir / "checkpoints" / f"step{N}").rglob("*") if path.is_file()}

    result = run_train(f"resume={run_dir}", *resumed_on, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_continues_like(reference, run_dir)
    done = summary(run_dir)
    assert done["status"] == "completed" and done["resumed_from_step"] == N
    assert done["world_size"] == int(resumed_on[0].split("=")[1])
    assert done["zero_stage"] == int(resumed_on[1].removeprefix("deepspeed=z")[0])
    assert done["resharded_from"]["global_batch"] == GLOBAL
    assert f"converted {run_dir / 'checkpoints' / f'step{N}'}" in result.stderr
    # The original is untouched; its universal copy is kept beside it.
    assert {path: path.read_bytes() for path in original} == original
    assert (universal_path(run_dir / "checkpoints", f"step{N}") / DONE_FILE).is_file()
    # The new shape's own checkpoint resumes plainly (global batch kept in the run's overrides).
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert f"train.global_batch_size={GLOBAL}" in overrides and resumed_on[0] in overrides
    # The same W&B run, read back with W&B's own CLI: its resumed segment says what was resharded.
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert run_id == (reference / "wandb_run_id").read_text().strip()
    segments = sorted(run_dir.rglob(f"offline-run-*-{run_id}"))
    assert len(segments) == 2, segments
    logged = inspect_summary(segments[-1], isolated_env)["summary"]
    assert logged["steps"] == 2 * N and logged["resharded_from"] == done["resharded_from"]
    last = losses(reference)[-1]
    assert abs(logged["final_loss"] - last) <= 1e-4 * abs(last)
    # W&B's last row holds the mean of the steps since its previous row (logger.log_every=10): the
    # resumed segment's steps N+1..2N.
    window = sum(losses(reference)[N:]) / N
    assert abs(logged["train/loss"] - window) <= 1e-4 * abs(window)


def test_a_kill_during_the_conversion_leaves_the_original_and_the_next_resume_converts_again(
    run_train, uninterrupted, tmp_path
):
    reference = uninterrupted("2 ranks, ZeRO-3", run_train)
    run_dir = tmp_path / "run"
    stopped_after(reference, run_dir, N)
    checkpoints = run_dir / "checkpoints"
    killed = run_train(
        f"resume={run_dir}",
        "dist.nproc_per_node=1",
        "deepspeed=z2",
        env={KILL_CONVERSION_ENV: "1"},
        timeout=900,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (checkpoints / "universal" / f".step{N}.partial").is_dir()  # half-written, and hidden
    assert not universal_path(checkpoints, f"step{N}").exists()
    assert checkpoint_damage(checkpoints / f"step{N}") is None
    assert (checkpoints / "latest").read_text() == f"step{N}"

    result = run_train(f"resume={run_dir}", "dist.nproc_per_node=1", "deepspeed=z2", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_continues_like(reference, run_dir)
    assert not (checkpoints / "universal" / f".step{N}.partial").exists()

    # launcher.export reads the universal copy too: the same weights as from the original.
    exported = {}
    for tag in (f"step{N}", f"universal/step{N}"):
        out = tmp_path / tag.replace("/", "-")
        done = export(run_dir, "--checkpoint", tag, "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
        exported[tag] = load_file(next(out.glob("*.safetensors")))
    original, converted = exported.values()
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[name], converted[name]) for name in original)


def test_the_uninterrupted_runs_of_both_shapes_agree(run_train, uninterrupted):
    """So each resume above also repeats the other shape's uninterrupted losses: a step's samples and
    the global batch are the same on 1 and 2 ranks, at any ZeRO stage."""
    one, two = (losses(uninterrupted(shape, run_train)) for shape in ("1 rank, ZeRO-0", "2 ranks, ZeRO-3"))
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(one, two, strict=True)), (one, two)
