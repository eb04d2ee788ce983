"""Preference training in this process, on gloo (loss=dpo): the loss starts at log 2, the three references
give the same losses (LLaVA and Qwen2-VL), a stopped run resumes bitwise, and a reference of other data is
refused in one line.
Two ranks, ZeRO-3 and learning the built-in preference task: tests/e2e/test_preference.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher.core.rundir import RunDir
from tests.helpers import losses, read_metrics, read_summary

JOB = (
    "loss=dpo",
    "logger=none",
    "data.task=colour",
    "data.n_train=48",
    "data.n_eval=16",
    "data.eval_accuracy=false",
    "train.micro_batch_size=4",
    "train.max_steps=4",
    "train.eval_every=2",
    "train.save_every=2",
)


def _eval_losses(run_dir) -> list[float]:
    return [row["eval/loss"] for row in read_metrics(run_dir) if "eval/loss" in row]


def test_dpo_starts_at_log_2_and_its_references_agree_and_a_stopped_run_resumes_bitwise(train_in_process, tmp_path):
    precomputed = train_in_process(*JOB, run_dir=tmp_path / "precomputed")
    assert precomputed.outcome.status == "completed", precomputed.outcome.error
    rows = read_metrics(precomputed.run_dir)
    assert rows[0]["train/loss"] == pytest.approx(math.log(2.0), abs=1e-6)  # the policy is the reference
    assert rows[0]["train/rewards_margin"] == pytest.approx(0.0, abs=1e-6)
    for key in ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"):
        assert f"train/{key}" in rows[-1] and f"eval/{key}" in rows[-1]
    assert rows[-1]["train/loss"] < math.log(2.0)  # it learns
    reference = precomputed.summary()["reference"]
    assert reference["kind"] == "precomputed"
    meta = json.loads((Path(reference["path"]) / "meta.json").read_text())
    assert meta["pairs"] == {"train": 48, "eval": 16} and meta["model"] == precomputed.summary()["base_model"]

    live = train_in_process(*JOB, "loss.reference=live", run_dir=tmp_path / "live")
    assert live.outcome.status == "completed", live.outcome.error
    assert losses(live.run_dir) == pytest.approx(losses(precomputed.run_dir), abs=1e-5)
    assert _eval_losses(live.run_dir) == pytest.approx(_eval_losses(precomputed.run_dir), abs=1e-5)

    stopped = RunDir(tmp_path / "stopped")
    stopped.path.mkdir()
    stopped.stop_file.touch()
    first = train_in_process(*JOB, run_dir=stopped.path)
    assert first.outcome.status == "preempted" and read_summary(stopped.path)["steps"] == 1
    stopped.stop_file.unlink()
    kept = Path(reference["path"]).rename(tmp_path / "kept")  # the reference gone: a trained run cannot remake it
    refused = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert refused.outcome.status == "failed" and "is missing, and this run has trained steps" in refused.outcome.error
    kept.rename(reference["path"])
    resumed = train_in_process(f"resume={stopped.path}", run_dir=stopped.path)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert read_summary(stopped.path)["reference"]["computed"] is False
    assert losses(stopped.path) == losses(precomputed.run_dir)  # bitwise: the reference read back, not recomputed
    assert _eval_losses(stopped.path) == _eval_losses(precomputed.run_dir)

    other_data = train_in_process(
        *JOB, "data.n_train=40", f"loss.reference_path={reference['path']}", run_dir=tmp_path / "other"
    )
    assert other_data.outcome.status == "failed"
    assert "computed for another model or data" in other_data.outcome.error
    assert "\n" not in other_data.outcome.error


@pytest.mark.parametrize(
    ("extra", "other"),
    [
        # LoRA: the base under the disabled adapter (and data other than the test above's, whose reference
        # it moves away for a while).
        (("data.n_train=56", "method=lora"), "adapter"),
        # Qwen2-VL: its rows carry image grids and token types beside the pixels, which the pairs' batches keep.
        (("model=tiny_qwen2_vl", "train.max_steps=2"), "live"),
    ],
    ids=["lora-adapter", "qwen2_vl-live"],
)
def test_another_reference_gives_the_precomputed_ones_losses_from_log_2(train_in_process, tmp_path, extra, other):
    runs = {}
    for reference in ("precomputed", other):
        ran = train_in_process(*JOB, *extra, f"loss.reference={reference}", run_dir=tmp_path / reference)
        assert ran.outcome.status == "completed", ran.outcome.error
        runs[reference] = ran.run_dir
    assert losses(runs[other])[0] == pytest.approx(math.log(2.0), abs=1e-6)
    assert losses(runs[other]) == pytest.approx(losses(runs["precomputed"]), abs=1e-5)
    assert _eval_losses(runs[other]) == pytest.approx(_eval_losses(runs["precomputed"]), abs=1e-5)
