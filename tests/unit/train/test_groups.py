"""train.groups reach the optimizer DeepSpeed steps (the LLaVA-NeXT#492 trap: a vision-tower rate that
never did), read back from the engine's own `optimizer.param_groups` after `deepspeed.initialize`, at every
ZeRO stage, with CPU offload (DeepSpeedCPUAdam) and with a user's optimizer block; and a part whose
rate is 0 keeps its weights bitwise while the rest moves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.core.checkpoints import read_marker
from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.job.planning import plan_job
from launcher.model.loading import load_model_and_processor
from launcher.model.stats import model_dir
from launcher.train.distributed import init_distributed
from launcher.train.engine import build_engine
from tests.helpers import PRESET_OPTIMIZERS, compose_typed, hydra_job, rates_in_use, read_summary

GROUPS = ("train.groups.vision.lr=0", "train.groups.projector.lr_scale=2", "train.weight_decay=0.1", "train.lr=1e-3")


def built(overrides: list[str], run_dir: Path):
    """The engine this job's rank builds, in this process."""
    config = compose_typed(overrides)
    job = plan_job(config, hydra_job(overrides, run_dir))
    job = job.replace(model_path=model_dir(config))
    rank, _ = init_distributed(job)
    summary = Summary()
    return build_engine(job, rank, summary), summary


@pytest.mark.parametrize(("preset", "optimizer"), PRESET_OPTIMIZERS)
def test_every_stage_and_offload_steps_the_groups_rates(process_group, tmp_path, preset, optimizer):
    engine, summary = built([f"deepspeed={preset}", *GROUPS], tmp_path / "run")
    assert type(engine.engine.optimizer).__name__ == optimizer
    if preset.endswith("offload"):
        assert summary.optimizer == "DeepSpeedCPUAdam"
    assert rates_in_use(engine) == {
        "vision": (0.0, 0.1),
        "vision.no_decay": (0.0, 0.0),  # biases and norm weights: no weight decay
        "projector": (2e-3, 0.1),
        "projector.no_decay": (2e-3, 0.0),
        "default": (1e-3, 0.1),
        "default.no_decay": (1e-3, 0.0),
    }
    assert [(group["name"], group["lr"]) for group in summary.param_groups] == [
        (name, peak) for name, (peak, _) in rates_in_use(engine).items()
    ]


def test_a_users_optimizer_block_is_the_base_the_groups_scale(process_group, tmp_path):
    base = tmp_path / "ds.json"
    # torch_adam: a base's optimizer block is taken whole, and without it DeepSpeed JIT-builds its fused_adam op
    # (two minutes of the suite's time) for what this test does not look at.
    params = {"lr": 4e-3, "weight_decay": 0.05, "torch_adam": True}
    base.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": params}}))
    engine, _ = built([f"deepspeed_json={base}", "train.groups.projector.lr_scale=0.5"], tmp_path / "run")
    assert rates_in_use(engine) == {
        "projector": (2e-3, 0.05),
        "projector.no_decay": (2e-3, 0.0),
        "default": (4e-3, 0.05),
        "default.no_decay": (4e-3, 0.0),
    }


@pytest.mark.parametrize("preset", ["z0", "z3_offload"])
def test_a_part_at_rate_zero_keeps_its_weights_bitwise_while_the_rest_moves(train_in_process, tmp_path, preset):
    run = train_in_process(
        f"deepspeed={preset}", *GROUPS, "train.max_steps=2", "train.micro_batch_size=4", "train.eval_every=0",
        "data.eval_accuracy=false", "logger=none", run_dir=tmp_path / "run",
    )  # fmt: skip
    assert run.outcome.status == "completed", run.outcome.error
    summary = read_summary(run.run_dir)
    start, end = (
        load_model_and_processor(str(directory), attn_implementation="sdpa")[0].state_dict()
        for directory in (Path(summary["base_model"]), run.run_dir / "model")
    )
    vision = [key for key in start if "vision_tower" in key]
    assert vision and all(torch.equal(start[key], end[key]) for key in vision)
    moved = [key for key in start if "vision_tower" not in key and not torch.equal(start[key], end[key])]
    assert any("multi_modal_projector" in key for key in moved) and any("language_model" in key for key in moved)
    # The optimizer's state is indexed in its groups' order: what a ZeRO-0 checkpoint's conversion reads.
    marker = read_marker(RunDir(run.run_dir), "step2")
    order = ["vision" if "vision_tower" in name else "projector" if "projector" in name else "default"
             for name in marker.param_names]  # fmt: skip
    assert order == sorted(order, key=["vision", "projector", "default"].index)
    assert [name for name, _ in marker.param_groups][:2] == ["vision", "vision.no_decay"]
    rows = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train/lr/vision"] == 0.0
    assert rows[-1]["train/lr/projector"] == pytest.approx(2 * rows[-1]["train/lr"])
