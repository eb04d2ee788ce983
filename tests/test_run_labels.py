"""Runs are labelled by what they train: the final DeepSpeed dict, not the Hydra choices it overrode.

A `deepspeed_json=` run composes over the default preset (`deepspeed=z0`, `zero=stage0`,
`offload=none`, `precision=fp32`); summary.json, the comparison and W&B's tags must still say the
stage, offload and precision of the JSON it trained with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.compare import compare
from launcher.config.precision import Device, labelled_choices, offload_of
from launcher.core.rundir import Summary
from launcher.job.spec import HydraJob, plan_job
from launcher.tracking.wandb_run import tags_from_choices
from tests.conftest import ROOT, compose_config

GOLDEN_JSON = "tests/golden/z3_offload_bf16_ws1.json"  # ZeRO-3, optimizer and parameters on the CPU, bf16
# Hydra's choices for a command line that names no group (conf/config.yaml's defaults).
DEFAULT_CHOICES = {
    "zero": "stage0",
    "precision": "fp32",
    "offload": "none",
    "comm": "default",
    "train": "default",
    "deepspeed": "z0",
    "model": "tiny_llava",
    "method": "full",
    "data": "shapes",
    "dist": "local",
    "logger": "wandb",
}
CPU = Device("cpu", bf16=True, fp16=False)
GPU = Device("cuda", bf16=True, fp16=True)
JSON_LABELS = {"deepspeed": "json:z3_offload_bf16_ws1.json", "zero": "stage3", "offload": "all", "precision": "bf16"}


def _ds(stage: int = 0, optimizer: str = "none", param: str = "none", dtype: str = "fp32") -> dict:
    zero: dict = {"stage": stage}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer}
    if param != "none":
        zero["offload_param"] = {"device": param}
    return {"zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}


def test_labels_follow_the_final_dict_and_a_plain_run_keeps_its_choices():
    json_dict = json.loads((ROOT / GOLDEN_JSON).read_text())
    labels = labelled_choices(
        DEFAULT_CHOICES, json_dict, device=CPU, deepspeed_json=f"/anywhere/{Path(GOLDEN_JSON).name}"
    )
    assert {key: labels[key] for key in JSON_LABELS} == JSON_LABELS
    assert labels["model"] == "tiny_llava" and labels["comm"] == "default"  # groups the dict does not decide stay

    # Composed from the groups alone: the choices already say what the dict trains with.
    assert labelled_choices(DEFAULT_CHOICES, _ds(), device=CPU) == DEFAULT_CHOICES
    z3_offload = {**DEFAULT_CHOICES, "deepspeed": "z3_offload", "zero": "stage3", "offload": "all", "precision": "bf16"}
    assert labelled_choices(z3_offload, _ds(3, "cpu", "cpu", "bf16"), device=GPU) == z3_offload
    # precision=auto stays where auto chose the dict's dtype; a dict that says otherwise wins.
    auto = {**DEFAULT_CHOICES, "precision": "auto"}
    assert labelled_choices(auto, _ds(dtype="bf16"), device=GPU)["precision"] == "auto"
    assert labelled_choices(auto, _ds(dtype="fp32"), device=CPU)["precision"] == "auto"
    assert labelled_choices(auto, _ds(dtype="bf16"), device=CPU)["precision"] == "bf16"
    # deepspeed_extra raising the stage is labelled too; the preset's name is the one chosen.
    assert labelled_choices(DEFAULT_CHOICES, _ds(stage=3), device=CPU)["zero"] == "stage3"
    assert offload_of(_ds(3, "cpu", "nvme")) == "optimizer:cpu,param:nvme"
    assert offload_of(_ds(2, "cpu")) == "optimizer"


def test_a_deepspeed_json_job_is_labelled_by_its_dict_in_job_json_summary_compare_and_wandb_tags(tmp_path):
    overrides = (f"deepspeed_json={GOLDEN_JSON}", "logger=none")
    spec = plan_job(
        compose_config(list(overrides)), HydraJob(run_dir=tmp_path, overrides=overrides, choices=DEFAULT_CHOICES)
    )
    job = spec.to_json()
    assert {key: job["choices"][key] for key in JSON_LABELS} == JSON_LABELS
    summary = Summary.for_job(job).to_json()  # what rank 0 writes first, before the engine exists
    assert (summary["zero_stage"], summary["offload"], summary["precision"]) == (3, "all", "bf16")
    assert summary["deepspeed"] == "json:z3_offload_bf16_ws1.json" and summary["choices"] == job["choices"]

    row = compare.build_row("run", str(tmp_path), "completed", summary, summary["choices"], list(overrides), {}, [])
    assert {key: row.settings[key] for key in JSON_LABELS} == JSON_LABELS

    tags = tags_from_choices(job["choices"])  # what wandb_logger.start_for_job tags the run with
    assert tags[:4] == ["deepspeed=json:z3_offload_bf16_ws1.json", "zero=stage3", "offload=all", "precision=bf16"]


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

    rows = {row.name: row for row in compare.load_runs([sweep])}
    assert {key: rows["0"].settings[key] for key in JSON_LABELS} == JSON_LABELS
    lines = (sweep / "compare.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| run |"))
    assert [cell.strip() for cell in header.split("|")[2:6]] == ["deepspeed", "zero", "offload", "precision"]
    (json_row,) = [line for line in lines if "| json:" in line]
    assert [cell.strip() for cell in json_row.split("|")[2:6]] == list(JSON_LABELS.values())
