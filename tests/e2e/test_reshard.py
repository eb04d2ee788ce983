"""Resuming on another number of ranks or another ZeRO stage, end to end (issue 15's acceptance).

A run is stopped after the checkpoint of step N (a copy of an uninterrupted run's directory as a stop
there leaves it) and resumed on another shape; the steps after N must repeat the uninterrupted run's
losses to 1e-4 relative (fp32). N = 2 and two steps after it: the first resumed step shows the weights,
the second the optimizer's moments (Adam's update of step N+1 uses them).

Micro batch 1: a step's samples are the same on any world size (the samplers deal one shuffled order),
but with larger micro batches they are grouped into micro batches differently, and the loss is a mean
per micro batch over its answer tokens, which would differ legitimately for answers of different
lengths. With one sample per micro batch grouping cannot matter.

What runs on 2 ranks runs as `python train.py` (torchrun); what runs on 1 rank trains in this process
(the launcher plans, converts and resumes here too), except the resume whose launcher is killed.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launcher.core.checkpoints import checkpoint_damage
from launcher.core.rundir import RunDir
from launcher.export.export import export
from launcher.train.universal import DONE_FILE, KILL_CONVERSION_ENV
from tests.e2e.wandb_inspect import inspect_summary
from tests.helpers import losses, read_summary, run_here, run_train_py, subprocess_env, train_here

pytestmark = pytest.mark.slow

N = 2  # the checkpoint the run stops after; runs are 2N steps
GLOBAL = 8
RUN = [
    "logger=wandb",  # offline (tests/helpers.py): the resumed segment continues the same W&B run
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
TWO_RANKS_Z3 = ["dist.nproc_per_node=2", "deepspeed=z3"]
ONE_RANK_Z0 = ["dist.nproc_per_node=1", "deepspeed=z0"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """W&B offline, for `python train.py` and for the jobs trained in this process alike."""
    return subprocess_env(tmp_path_factory.mktemp("reshard_env"))


@pytest.fixture(scope="module")
def in_this_process(env):
    """W&B's environment for the jobs trained in this process (restored after the module)."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            if key.startswith("WANDB_") or key == "VLM_LAUNCHER_CACHE":
                patch.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def two_ranks_z3(tmp_path_factory, env) -> Path:
    """An uninterrupted run on 2 ranks at ZeRO-3 (torchrun)."""
    run_dir = tmp_path_factory.mktemp("two_ranks_z3") / "run"
    result = run_train_py(env, *RUN, *TWO_RANKS_Z3, f"hydra.run.dir={run_dir}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(run_dir)) == 2 * N
    return run_dir


@pytest.fixture(scope="module")
def one_rank_z0(tmp_path_factory, process_group, in_this_process) -> Path:
    """An uninterrupted run on 1 rank at ZeRO-0, trained in this process."""
    run_dir = tmp_path_factory.mktemp("one_rank_z0") / "run"
    ran = run_here([*RUN, *ONE_RANK_Z0], run_dir, start=train_here)
    assert ran.outcome.status == "completed", ran.error
    assert len(losses(run_dir)) == 2 * N
    return run_dir


def stopped_after(reference: Path, run_dir: Path, step: int) -> RunDir:
    """`reference` as a stop after step `step`'s checkpoint leaves it."""
    shutil.copytree(reference, run_dir)
    stopped = RunDir(run_dir)
    for tag in stopped.checkpoints.iterdir():
        if tag.name.startswith("step") and tag.name != f"step{step}":
            shutil.rmtree(tag)
    stopped.latest.write_text(f"step{step}")
    shutil.rmtree(stopped.model, ignore_errors=True)
    return stopped


def assert_continues_like(reference: Path, run_dir: Path) -> None:
    expected, resumed = losses(reference), losses(run_dir)
    assert len(resumed) == 2 * N
    assert resumed[:N] == expected[:N]  # the steps before the stop, kept
    for step, (mine, theirs) in enumerate(zip(resumed[N:], expected[N:], strict=True), start=N + 1):
        assert abs(mine - theirs) <= 1e-4 * abs(theirs), (step, resumed, expected)


def resume_on_one_rank(train_in_process, run_dir: Path, *shape: str) -> list[str]:
    """Resume `run_dir` on 1 rank, in this process; what the launcher said."""
    ran = train_in_process(f"resume={run_dir}", *shape, run_dir=run_dir)
    assert ran.outcome.status == "completed", ran.error
    return ran.lines


def resume_on_two_ranks(env: dict[str, str], run_dir: Path, *shape: str) -> list[str]:
    """Resume `run_dir` on 2 ranks (`python train.py`); what the launcher said (its stderr)."""
    result = run_train_py(env, f"resume={run_dir}", *shape, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr.splitlines()


@pytest.mark.parametrize(
    ("saved", "resumed_on"),
    [
        ("two_ranks_z3", ["dist.nproc_per_node=1", "deepspeed=z2"]),
        ("one_rank_z0", ["dist.nproc_per_node=2", "deepspeed=z1"]),
        ("two_ranks_z3", ["dist.nproc_per_node=2", "deepspeed=z3_offload"]),  # CPU Adam from torch's AdamW
        # Several sub-groups, each stepped on its own: DeepSpeed gave them all one step tensor, advanced per group.
        ("one_rank_z0", ["dist.nproc_per_node=1", "deepspeed=z3", "zero.sub_group_size=50000"]),
    ],
    ids=[
        "2 ranks ZeRO-3 to 1 rank ZeRO-2",
        "1 rank ZeRO-0 to 2 ranks ZeRO-1",
        "ZeRO-3 to ZeRO-3 offloaded",
        "1 rank ZeRO-0 to 1 rank ZeRO-3 in sub-groups",
    ],
)
def test_a_run_resumes_on_another_world_size_and_stage_with_the_same_losses(
    request, train_in_process, env, tmp_path, saved, resumed_on
):
    reference = request.getfixturevalue(saved)
    run_dir = tmp_path / "resumed"
    stopped = stopped_after(reference, run_dir, N)
    checkpoint = stopped.checkpoint(f"step{N}")
    original = {path: path.read_bytes() for path in checkpoint.rglob("*") if path.is_file()}

    world_size = int(resumed_on[0].split("=")[1])
    if world_size == 1:
        said = resume_on_one_rank(train_in_process, run_dir, *resumed_on)
    else:
        said = resume_on_two_ranks(env, run_dir, *resumed_on)
    assert_continues_like(reference, run_dir)
    done = read_summary(run_dir)
    assert done["status"] == "completed" and done["resumed_from_step"] == N
    assert done["world_size"] == world_size
    assert done["zero_stage"] == int(resumed_on[1].removeprefix("deepspeed=z")[0])
    assert done["resharded_from"]["global_batch"] == GLOBAL
    assert any(f"converted {checkpoint}" in line for line in said), said
    # The original is untouched; its universal copy is kept beside it.
    assert {path: path.read_bytes() for path in original} == original
    assert (stopped.universal(f"step{N}") / DONE_FILE).is_file()
    # The new shape's own checkpoint resumes plainly (global batch kept in the run's overrides).
    overrides = stopped.overrides.read_text()
    assert f"train.global_batch_size={GLOBAL}" in overrides and resumed_on[0] in overrides
    # The same W&B run, read back with W&B's own CLI: its resumed segment says what was resharded.
    run_id = stopped.wandb_run_id.read_text().strip()
    assert run_id == RunDir(reference).wandb_run_id.read_text().strip()
    segments = sorted(run_dir.rglob(f"offline-run-*-{run_id}"))
    assert len(segments) == 2, segments
    logged = inspect_summary(segments[-1], env)["summary"]
    assert logged["steps"] == 2 * N and logged["resharded_from"] == done["resharded_from"]
    last = losses(reference)[-1]
    assert abs(logged["final_loss"] - last) <= 1e-4 * abs(last)
    # W&B's last row holds the mean of the steps since its previous row (logger.log_every=10): the
    # resumed segment's steps N+1..2N.
    window = sum(losses(reference)[N:]) / N
    assert abs(logged["train/loss"] - window) <= 1e-4 * abs(window)


def test_a_kill_during_the_conversion_leaves_the_original_and_the_next_resume_converts_again(
    two_ranks_z3, train_in_process, env, tmp_path
):
    run_dir = tmp_path / "resumed"
    stopped = stopped_after(two_ranks_z3, run_dir, N)
    tag = f"step{N}"
    # The launcher converts before any rank starts: `python train.py`, killed (SIGKILL) half-way through.
    killed = run_train_py(
        env, f"resume={run_dir}", "dist.nproc_per_node=1", "deepspeed=z2", extra_env={KILL_CONVERSION_ENV: "1"}
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (stopped.checkpoints / "universal" / f".{tag}.partial").is_dir()  # half-written, and hidden
    assert not stopped.universal(tag).exists()
    assert checkpoint_damage(stopped, tag) is None
    assert stopped.latest.read_text() == tag

    resume_on_one_rank(train_in_process, run_dir, "dist.nproc_per_node=1", "deepspeed=z2")
    assert_continues_like(two_ranks_z3, run_dir)
    assert not (stopped.checkpoints / "universal" / f".{tag}.partial").exists()

    # launcher.export reads the universal copy too: the same weights as from the original.
    exported = {}
    for source in (tag, f"universal/{tag}"):
        out = tmp_path / source.replace("/", "-")
        export(run_dir, out=out, checkpoint=source)
        exported[source] = load_file(next(out.glob("*.safetensors")))
    original, converted = exported.values()
    assert original.keys() == converted.keys()
    assert all(torch.equal(original[name], converted[name]) for name in original)


def test_the_uninterrupted_runs_of_both_shapes_agree(two_ranks_z3, one_rank_z0):
    """So each resume above also repeats the other shape's uninterrupted losses: a step's samples and
    the global batch are the same on 1 and 2 ranks, at any ZeRO stage."""
    one, two = losses(one_rank_z0), losses(two_ranks_z3)
    assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(one, two, strict=True)), (one, two)
