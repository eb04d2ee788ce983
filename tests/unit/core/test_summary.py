"""launcher.core.summary: summary.json as one typed record, valid JSON, read back by field."""

from __future__ import annotations

import json
import math

import pytest

from launcher.core.summary import LEARNT, Summary


def strict(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))


def test_a_summary_is_valid_json_without_nan_and_round_trips():
    summary = Summary(status="failed", final_loss=math.nan, eval_loss=math.inf, objective=-math.inf)
    summary.memory = {"host_peak_bytes": 10}
    data = strict(json.dumps(summary.to_json(), allow_nan=False))
    assert (data["final_loss"], data["eval_loss"], data["objective"]) == (None, None, None)
    assert data["memory"] == {"host_peak_bytes": 10}
    assert Summary.from_json(data).to_json() == data


def test_what_training_learns_is_left_out_until_known():
    """Learnt fields (the optimizer, the memory reading, a resume's step, ...) are absent while None;
    the fields every summary has are written as null."""
    data = Summary().to_json()
    assert not LEARNT & set(data)
    assert data["final_loss"] is None and data["status"] == "running" and data["steps"] == 0
    assert {"records_skipped", "data_cache", "memory", "resumed_from_step", "base_model", "optimizer"} <= LEARNT
    assert "params_held_per_rank" in LEARNT and "status" not in LEARNT
    learnt = Summary(resumed_from_step=4, optimizer="AdamW", params_held_per_rank=[10, 10]).to_json()
    assert (learnt["resumed_from_step"], learnt["optimizer"], learnt["params_held_per_rank"]) == (4, "AdamW", [10, 10])
    assert "memory" not in learnt


def test_keys_another_launcher_wrote_are_left_out_when_read():
    """No `extra`: a key this launcher does not know (an older or newer one's) is dropped on reading."""
    summary = Summary.from_json({"status": "completed", "steps": 4, "grad_norms": [1.0], "future_key": 1})
    assert (summary.status, summary.steps) == ("completed", 4)
    assert "grad_norms" not in summary.to_json() and not hasattr(summary, "extra")


def test_a_planned_summary_takes_its_labels_from_the_choices():
    choices = {"precision": "bf16", "offload": "cpu", "comm": "default", "deepspeed": "z2", "model": "tiny_llava"}
    summary = Summary.planned(world_size=2, zero_stage=2, overrides=("deepspeed=z2",), choices=choices)
    assert (summary.status, summary.world_size, summary.zero_stage) == ("running", 2, 2)
    assert (summary.precision, summary.offload, summary.comm, summary.deepspeed, summary.model) == (
        "bf16",
        "cpu",
        "default",
        "z2",
        "tiny_llava",
    )
    assert summary.overrides == ["deepspeed=z2"] and summary.choices == choices
    assert Summary.planned(precision="fp32", choices=choices).precision == "fp32"  # the given one wins


def test_a_failure_keeps_the_first_line_and_the_first_wall_time():
    summary = Summary()
    summary.failed("boom\nTraceback ...", wall_s=1.23456)
    assert (summary.status, summary.error, summary.wall_s) == ("failed", "boom", 1.235)
    summary.failed("stopped by SIGTERM", wall_s=9.0, status="interrupted")
    assert (summary.status, summary.error, summary.wall_s) == ("interrupted", "stopped by SIGTERM", 1.235)
