"""A job trained on a DeepSpeed JSON, beside the default job: each is labelled by the dict it trained with,
in its summary.json and in the comparison written over both (the labels themselves:
tests/unit/job/test_spec.py; a sweep writing its comparison at its end: tests/e2e/test_sweep.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from launcher.compare.render import write_comparison
from launcher.compare.runs import load_runs

GOLDEN_JSON = "tests/golden/z3_offload_bf16_ws1.json"  # ZeRO-3, optimizer and parameters on the CPU, bf16
JSON_LABELS = {"deepspeed": "json:z3_offload_bf16_ws1.json", "zero": "stage3", "offload": "all", "precision": "bf16"}


@pytest.mark.slow
def test_a_deepspeed_json_job_is_compared_by_what_it_trained_with(train_in_process, quick_run, tmp_path):
    """A 2-step ZeRO-3 + CPU offload bf16 JSON run beside the default job: summary.json and the comparison
    say stage 3, offload all, bf16 for the JSON job."""
    runs = tmp_path / "runs"
    args = [f"deepspeed_json={GOLDEN_JSON}", "logger=none", "train.max_steps=2", "train.warmup_steps=1"]
    ran = train_in_process(*args, "train.eval_every=0", "data.eval_accuracy=false", run_dir=runs / "0")
    assert ran.outcome.status == "completed", ran.outcome.error
    with_json = json.loads((runs / "0" / "summary.json").read_text())
    assert (with_json["zero_stage"], with_json["offload"], with_json["precision"]) == (3, "all", "bf16")
    assert with_json["deepspeed"] == "json:z3_offload_bf16_ws1.json"
    assert {key: with_json["choices"][key] for key in JSON_LABELS} == JSON_LABELS
    shutil.copytree(quick_run.run_dir, runs / "1")  # the default job
    plain = json.loads((runs / "1" / "summary.json").read_text())
    assert (plain["deepspeed"], plain["zero_stage"], plain["offload"], plain["precision"]) == ("z0", 0, "none", "fp32")

    rows = {row.name: row for row in load_runs([runs])}
    assert {key: rows["0"].settings[key] for key in JSON_LABELS} == JSON_LABELS
    lines = write_comparison(runs).read_text().splitlines()
    header = next(line for line in lines if line.startswith("| run |"))
    assert [cell.strip() for cell in header.split("|")[2:6]] == ["deepspeed", "zero", "offload", "precision"]
    (json_row,) = [line for line in lines if "| json:" in line]
    assert [cell.strip() for cell in json_row.split("|")[2:6]] == list(JSON_LABELS.values())
