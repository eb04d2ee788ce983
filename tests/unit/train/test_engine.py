"""launcher.train.engine: the gradient norm a step reports (DeepSpeed's, the one its clipping computed, or
the launcher's at ZeRO-0 in fp32), on real DeepSpeed engines of a small torch model in this process, and
through a job trained here."""

from __future__ import annotations

import math

import pytest
import torch

from launcher.train.engine import (
    GradNormSource,
    engine_dtype,
    params_held_per_rank,
    seed_everything,
    unpartitioned_grad_norm,
)
from tests.helpers import read_metrics

pytestmark = pytest.mark.slow  # DeepSpeed engines


def engine_of(*, clip: float, stage: int = 0):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    return engine


def backward(engine) -> float:
    """One forward and backward; the gradients' norm, as torch computes it."""
    torch.manual_seed(1)
    loss = engine(torch.randn(4, 8)).pow(2).mean()
    engine.backward(loss)
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else math.nan


def test_with_clipping_the_norm_is_the_one_deepspeeds_clipping_computed(process_group):
    engine = engine_of(clip=1.0)
    source = GradNormSource(engine)
    assert not source.computed_here  # DeepSpeed computes it: kept, not computed twice
    expected = backward(engine)
    engine.step()
    assert source.of_step(engine, math.nan) == pytest.approx(expected, rel=1e-5)
    assert math.isnan(source.take(math.nan))  # taken once


def test_without_clipping_the_launcher_computes_it_before_the_step(process_group):
    engine = engine_of(clip=0.0)
    source = GradNormSource(engine)
    assert source.computed_here
    expected = backward(engine)
    computed = unpartitioned_grad_norm(engine)
    assert computed == pytest.approx(expected, rel=1e-6)
    engine.step()
    assert source.of_step(engine, computed) == computed


def test_above_zero_0_deepspeed_keeps_the_norm_itself(process_group):
    """ZeRO-1 moves the gradients into its partitions (no `.grad` left to read): its own norm is the one
    a ZeRO-0 engine of the same model and batch has."""
    reference = engine_of(clip=0.0)
    expected = backward(reference)
    engine = engine_of(clip=1.0, stage=1)
    source = GradNormSource(engine)
    assert not source.computed_here
    backward(engine)
    engine.step()
    assert source.of_step(engine, math.nan) == pytest.approx(expected, rel=1e-5)


def test_an_engine_in_fp32_holds_every_parameter_on_its_one_rank(process_group):
    engine = engine_of(clip=0.0)
    assert engine_dtype(engine) == torch.float32
    assert params_held_per_rank(engine, torch.device("cpu")) == [sum(p.numel() for p in engine.module.parameters())]
    assert math.isnan(unpartitioned_grad_norm(engine))  # no backward yet: no gradients


def test_the_same_seed_draws_the_same_numbers():
    import random

    import numpy as np

    seed_everything(7)
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    seed_everything(7)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first


QUICK = ["logger=none", "train.micro_batch_size=8", "train.eval_every=0", "data.eval_accuracy=false", "train.seed=1"]


def test_zero0_fp32_grad_norm_is_the_one_deepspeed_clipped_by(train_in_process, tmp_path):
    """With clipping on, train/grad_norm is what DeepSpeed's clipping computed (kept, not recomputed);
    without clipping the launcher computes it. Step 1 is before any update: the two must agree."""
    norms = {}
    for clip in ("1.0", "0"):
        run_dir = tmp_path / f"clip{clip}"
        ran = train_in_process("train.max_steps=2", f"train.grad_clip={clip}", *QUICK, run_dir=run_dir)
        assert ran.outcome.status == "completed", ran.outcome.error
        norms[clip] = [row["train/grad_norm"] for row in read_metrics(run_dir)]
    assert all(norm is not None and norm > 0 for norm in norms["1.0"] + norms["0"])
    assert norms["1.0"][0] == pytest.approx(norms["0"][0], rel=1e-6)
