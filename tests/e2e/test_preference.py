"""Preference training as a user runs it (slow): `python train.py loss=dpo` on 2 ranks learns the built-in
preference task (the right colour chosen over a wrong one) to a held-out reward accuracy of 0.95, at ZeRO-0
with the reference precomputed (and logged to W&B, read back with W&B's own CLI; then resumed on another
shape) and at ZeRO-3 with a live reference partitioned like the policy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.e2e.wandb_inspect import inspect_summary
from tests.helpers import read_metrics, read_summary, run_train_py, subprocess_env

pytestmark = pytest.mark.slow

RUN = (
    "loss=dpo",
    "data.task=colour",
    "data.n_train=1024",
    "data.n_eval=128",
    "data.eval_accuracy=false",
    "train.micro_batch_size=8",
    "train.max_steps=30",
    "train.eval_every=15",
    "dist.nproc_per_node=2",
)


@pytest.mark.parametrize(("preset", "reference"), [("z0", "precomputed"), ("z3", "live")])
def test_two_ranks_learn_the_built_in_preference_task(preset, reference, tmp_path):
    env = subprocess_env(tmp_path)
    run_dir = tmp_path / "run"
    logger = "logger=wandb" if reference == "precomputed" else "logger=none"
    args = [*RUN, logger, f"deepspeed={preset}", f"loss.reference={reference}", f"hydra.run.dir={run_dir}"]
    result = run_train_py(env, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["world_size"] == 2 and summary["zero_stage"] == int(preset[1])
    rows = read_metrics(run_dir)
    assert rows[0]["train/loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert summary["eval_rewards_accuracy"] >= 0.95, summary
    assert rows[-1]["eval/rewards_accuracy"] == summary["eval_rewards_accuracy"]
    assert rows[-1]["eval/rewards_margin"] > 0
    assert "reward accuracy" in result.stdout
    if reference == "live":  # a second model, partitioned as the policy is
        assert summary["reference"]["params_held"] == summary["params_held_per_rank"][0] < summary["params_total"]
        return
    assert (Path(summary["reference"]["path"]) / "meta.json").is_file()  # computed by this run or an earlier one
    wandb_summary = inspect_summary(next((run_dir / "wandb").glob("offline-run-*")), env)["summary"]
    assert wandb_summary["eval/rewards_accuracy"] == pytest.approx(summary["eval_rewards_accuracy"])

    # Resumed on another shape (1 rank, ZeRO-3): allowed; the reference is read back, not computed again.
    more = run_train_py(env, f"resume={run_dir}", "dist.nproc_per_node=1", "deepspeed=z3", "train.max_steps=32")
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "resumed on another shape: 2 rank(s) at ZeRO-0 -> 1 rank(s) at ZeRO-3" in more.stdout + more.stderr
    resumed = read_summary(run_dir)
    assert resumed["steps"] == 32 and resumed["reference"]["computed"] is False
