"""A sweep over a DeepSpeed JSON and the default job: each job is labelled by the dict it trained with, in
its summary.json and in the comparison the sweep writes (the labels themselves: tests/unit/job/test_spec.py)."""

from __future__ import annotations

import json

import pytest

from launcher.compare.runs import load_runs

GOLDEN_JSON = "tests/golden/z3_offload_bf16_ws1.json"  # ZeRO-3, optimizer and parameters on the CPU, bf16
JSON_LABELS = {"deepspeed": "json:z3_offload_bf16_ws1.json", "zero": "stage3", "offload": "all", "precision": "bf16"}


@pytest.mark.slow
def test_a_sweep_over_a_deepspeed_json_compares_what_each_job_trained_with(run_train, tmp_path):
    """A 2-step ZeRO-3 + CPU offload bf16 JSON run beside the default job, as a sweep: summary.json and
    the comparison the sweep writes say stage 3, offload all, bf16 for the JSON job."""
    sweep = tmp_path / "sweep"
    args = ["-m", f"deepspeed_json={GOLDEN_JSON},null", "logger=none", "train.max_steps=2", "train.warmup_steps=1"]
    args += ["train.eval_every=0", "data.eval_accuracy=false", f"hydra.sweep.dir={sweep}"]
    result = run_train(*args, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    with_json = json.loads((sweep / "0" / "summary.json").read_text())
    assert with_json["status"] == "completed"
    assert (with_json["zero_stage"], with_json["offload"], with_json["precision"]) == (3, "all", "bf16")
    assert with_json["deepspeed"] == "json:z3_offload_bf16_ws1.json"
    assert {key: with_json["choices"][key] for key in JSON_LABELS} == JSON_LABELS
    plain = json.loads((sweep / "1" / "summary.json").read_text())
    assert (plain["deepspeed"], plain["zero_stage"], plain["offload"], plain["precision"]) == ("z0", 0, "none", "fp32")

    rows = {row.name: row for row in load_runs([sweep])}
    assert {key: rows["0"].settings[key] for key in JSON_LABELS} == JSON_LABELS
    lines = (sweep / "compare.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| run |"))
    assert [cell.strip() for cell in header.split("|")[2:6]] == ["deepspeed", "zero", "offload", "precision"]
    (json_row,) = [line for line in lines if "| json:" in line]
    assert [cell.strip() for cell in json_row.split("|")[2:6]] == list(JSON_LABELS.values())
