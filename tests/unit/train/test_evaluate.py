"""launcher.train.evaluate: when a held-out evaluation runs, and what it reports (the loss, and the exact
match of greedy answers with data.eval_accuracy), through jobs trained in this process."""

from __future__ import annotations

import pytest

from launcher.config.precision import Device
from launcher.job.planning import plan_job
from launcher.train.evaluate import eval_line, evaluation_due
from tests.helpers import compose_typed, hydra_job, read_metrics, read_summary


def job_of(tmp_path, *overrides: str):
    return plan_job(
        compose_typed(list(overrides)),
        hydra_job(list(overrides), tmp_path),
        device=Device("cpu", bf16=True, fp16=False),
        hidden_size=64,
        validate=False,
    )


def test_an_evaluation_every_k_steps_and_at_the_last(tmp_path):
    every_two = job_of(tmp_path, "train.max_steps=5", "train.eval_every=2")
    assert [step for step in range(1, 6) if evaluation_due(every_two, step)] == [2, 4, 5]
    never = job_of(tmp_path, "train.max_steps=5", "train.eval_every=0")
    assert [step for step in range(1, 6) if evaluation_due(never, step)] == [5]  # the final figures


@pytest.mark.slow
def test_the_held_out_loss_is_recorded_at_the_last_step(quick_run):
    rows = read_metrics(quick_run.run_dir)
    assert "eval/loss" not in rows[0] and rows[-1]["eval/loss"] > 0
    assert "eval/accuracy" not in rows[-1]  # data.eval_accuracy=false
    summary = read_summary(quick_run.run_dir)
    assert summary["eval_loss"] == rows[-1]["eval/loss"] and summary["eval_accuracy"] is None


@pytest.mark.slow
def test_exact_match_accuracy_is_recorded_with_the_loss_at_each_evaluation(train_in_process, tmp_path):
    ran = train_in_process(
        "logger=none",
        "train.max_steps=2",
        "train.micro_batch_size=4",
        "train.eval_every=1",
        "data.eval_accuracy=true",
        "data.eval_samples=4",
        "data.max_new_tokens=2",
        "data.n_eval=8",
        run_dir=tmp_path / "run",
    )
    assert ran.outcome.status == "completed", ran.outcome.error
    rows = read_metrics(tmp_path / "run")
    assert [sorted(key for key in row if key.startswith("eval/")) for row in rows] == [
        ["eval/accuracy", "eval/loss"]
    ] * 2
    assert all(0.0 <= row["eval/accuracy"] <= 1.0 for row in rows)
    summary = read_summary(tmp_path / "run")
    assert (summary["eval_loss"], summary["eval_accuracy"]) == (rows[-1]["eval/loss"], rows[-1]["eval/accuracy"])


def test_the_eval_line_reads_as_the_step_lines_do():
    """It printed a Python dict ("eval: {'eval/loss': 3.8997, ...}"; issue 44)."""
    assert eval_line({"eval/loss": 3.89971, "eval/accuracy": 0.015}) == "eval | loss 3.8997 | accuracy 0.0150"
    assert eval_line({"eval/loss": 0.5, "eval/reward_accuracy": 1.0}) == "eval | loss 0.5000 | reward_accuracy 1.0000"
