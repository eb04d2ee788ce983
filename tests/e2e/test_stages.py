"""train.stages on two ranks (`python train.py`, dist=local): a two-stage run gives the losses of its two
stages run as two jobs, the second from the first's saved model, at ZeRO 3 (where the stage's model is
gathered from the partitions, and the next stage's partitioned again as it loads). One rank (ZeRO 0), a
resume in each stage, the rates per stage and offload: tests/unit/train/test_stages.py."""

from __future__ import annotations

import math

import pytest

from tests.helpers import losses, read_summary

pytestmark = pytest.mark.slow

COMMON = ("dist.nproc_per_node=2", "train.micro_batch_size=4", "train.eval_every=0", "data.eval_accuracy=false",
          "data.n_train=128", "data.n_eval=16", "logger=none")  # fmt: skip
SCHEDULE = "train.stages=[{steps: 3, train: [projector], lr: 3e-3}, {train: [projector, language]}]"


# ZeRO-3 only: ZeRO-0's stages are tested in one process (tests/unit/train/test_stages.py), and what two ranks
# add (the stage's model gathered from both partitions, each rank's optimizer rebuilt over its own) is ZeRO-3's.
def test_two_stages_on_two_ranks_train_as_two_jobs(run_train, tmp_path):
    def train(*overrides: str, name: str):
        result = run_train("deepspeed=z3", *COMMON, *overrides, f"hydra.run.dir={tmp_path / name}")
        assert result.returncode == 0, result.stderr[-3000:]
        return tmp_path / name

    staged = train("train.max_steps=8", SCHEDULE, name="staged")
    first = train("train.max_steps=3", "train.lr=3e-3", "model.freeze_vision=true", "model.freeze_language=true",
                  name="first")  # fmt: skip
    second = train("train.max_steps=5", "model.freeze_vision=true", "model.source=pretrained",
                   f"model.path={first / 'model'}", name="second")  # fmt: skip
    expected = losses(first) + losses(second)
    assert len(losses(staged)) == 8
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses(staged), expected, strict=True))
    summary = read_summary(staged)
    assert (summary["zero_stage"], summary["world_size"], summary["status"]) == (3, 2, "completed")
    assert [stage["param_groups"][0]["params"] for stage in summary["stages"]] == [
        read_summary(job)["params_trainable"] for job in (first, second)
    ]
