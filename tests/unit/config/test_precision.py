"""Which dtype a job trains in, what it offloads, and the labels that say so (launcher.config.precision).

Runs are labelled by what they train: the final DeepSpeed dict, not the Hydra choices it overrode. A
`deepspeed_json=` run composes over the default preset (`deepspeed=z0`, `zero=stage0`, `offload=none`,
`precision=fp32`); its labels must still say the stage, offload and precision of the JSON it trained with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config.precision import (
    Device,
    fastest_precisions,
    labelled_choices,
    offload_of,
    precision_of,
    resolve_precision,
    with_bf16_spelling,
)
from launcher.core.errors import DeviceLacks, LauncherError
from launcher.core.rundir import RunDir
from tests.helpers import QUICK, ROOT

CPU = Device(kind="cpu", bf16=True, fp16=False, name="")
GPU = Device(kind="cuda", bf16=True, fp16=True, name="H100")
OLD_GPU = Device(kind="cuda", bf16=False, fp16=True, name="V100")

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
JSON_LABELS = {"deepspeed": "json:z3_offload_bf16_ws1.json", "zero": "stage3", "offload": "all", "precision": "bf16"}


def _ds(stage: int = 0, optimizer: str = "none", param: str = "none", dtype: str = "fp32") -> dict:
    zero: dict = {"stage": stage}
    if optimizer != "none":
        zero["offload_optimizer"] = {"device": optimizer}
    if param != "none":
        zero["offload_param"] = {"device": param}
    return {"zero_optimization": zero, "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"}}


# ----------------------------------------------------------------------------- resolving precision=
@pytest.mark.parametrize(
    ("requested", "device", "expected"),
    [
        ("auto", CPU, "fp32"),  # bf16 works on a CPU but is slower there (fastest_precisions)
        ("auto", GPU, "bf16"),
        ("auto", OLD_GPU, "fp16"),
        ("auto", Device("cpu", bf16=False, fp16=False), "fp32"),
        ("auto", Device("cpu", bf16=False, fp16=True), "fp32"),  # fp16 is never auto's choice on a CPU
        ("auto", Device("cuda", bf16=False, fp16=False), "fp32"),
        ("fp32", CPU, "fp32"),
        ("bf16", CPU, "bf16"),
        ("fp16", GPU, "fp16"),
        ("fp16", Device("cpu", bf16=True, fp16=True), "fp16"),  # asked for where the CPU has it
    ],
)
def test_precision_resolves_against_the_device(requested, device, expected):
    assert resolve_precision(requested, device) == expected


def test_fp16_on_cpu_is_refused_with_the_alternatives():
    """As DeviceLacks: one job exits 2 with the line; a sweep records that job as skipped (tests/unit/compare)."""
    with pytest.raises(DeviceLacks, match="precision=fp16 is not supported on this cpu: use precision=bf16 or"):
        resolve_precision("fp16", CPU)
    assert issubclass(DeviceLacks, LauncherError) and DeviceLacks.exit_code == 2


def test_bf16_on_a_gpu_without_it_suggests_fp16():
    with pytest.raises(LauncherError, match="not supported on this cuda V100: use precision=fp16 or precision=fp32"):
        resolve_precision("bf16", OLD_GPU)
    with pytest.raises(LauncherError, match=r"precision=bf16 is not supported on this cpu: use precision=fp32$"):
        resolve_precision("bf16", Device("cpu", bf16=False, fp16=False))


def test_an_unknown_dtype_is_refused_with_the_choices():
    with pytest.raises(LauncherError, match=r"precision\.dtype=fp8 is unknown: use one of fp32, bf16, fp16, auto"):
        resolve_precision("fp8", GPU)


def test_fastest_first_fp32_on_a_cpu_16_bit_on_a_gpu():
    assert fastest_precisions("cpu") == ("fp32", "bf16", "fp16")
    assert fastest_precisions("cuda") == ("bf16", "fp16", "fp32")


# ----------------------------------------------------------------------------- reading the dict
@pytest.mark.parametrize(
    ("ds", "expected"),
    [
        ({}, "fp32"),
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bf16"),
        ({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}}, "fp32"),  # DeepSpeed reads "bf16" first
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"fp16": {"enabled": False}, "bf16": {"enabled": "true"}}, "bf16"),
        ({"fp16": {"enabled": "True"}}, "fp16"),
        ({"bf16": {"enabled": "false"}}, "fp32"),
    ],
)
def test_one_function_answers_which_precision(ds, expected):
    assert precision_of(ds) == expected


@pytest.mark.parametrize(
    ("ds", "expected"),
    [
        (_ds(), "none"),
        (_ds(2, "cpu"), "optimizer"),
        (_ds(3, "none", "cpu"), "param"),
        (_ds(3, "cpu", "cpu"), "all"),
        (_ds(3, "nvme", "nvme"), "nvme"),
        (_ds(3, "cpu", "nvme"), "optimizer:cpu,param:nvme"),  # a mix no choice makes
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "CPU"}}}, "optimizer"),
        ({"zero_optimization": {"offload_optimizer": {"device": None}}}, "none"),
        ({}, "none"),
    ],
)
def test_the_offload_is_named_as_the_offload_group_names_it(ds, expected):
    assert offload_of(ds) == expected


def test_the_older_bfloat16_spelling_is_renamed_and_both_at_once_refused():
    tree = {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    assert with_bf16_spelling(tree, "x.json") == {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    assert "bfloat16" in tree  # the caller's dict stays
    plain = {"bf16": {"enabled": False}}
    assert with_bf16_spelling(plain, "x.json") == plain and with_bf16_spelling(plain, "x.json") is not plain
    with pytest.raises(LauncherError, match=r'^x\.json: has both "bf16" and its older spelling "bfloat16": keep only'):
        with_bf16_spelling({"bf16": {}, "bfloat16": {}}, "x.json")


# ----------------------------------------------------------------------------- labels
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
    assert labelled_choices(DEFAULT_CHOICES, _ds(stage=3), device=CPU)["deepspeed"] == "z0"
    assert offload_of(_ds(3, "cpu", "nvme")) == "optimizer:cpu,param:nvme"
    assert offload_of(_ds(2, "cpu")) == "optimizer"


def test_labels_add_no_group_the_choices_lack_and_leave_them_unchanged():
    choices = {"model": "tiny_llava"}  # e.g. a job whose choices were not recorded
    assert labelled_choices(choices, _ds(3, "cpu", "cpu", "bf16"), device=GPU) == choices
    assert choices == {"model": "tiny_llava"}
    assert labelled_choices(choices, _ds(), device=GPU, deepspeed_json="ds.json") == {
        **choices,
        "deepspeed": "json:ds.json",
    }


# ----------------------------------------------------------------------------- a run that trains
@pytest.mark.slow
def test_a_json_base_with_bfloat16_trains_in_bf16(train_in_process, tmp_path):
    base = tmp_path / "ds.json"
    base.write_text(json.dumps({"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 1}}))
    ran = train_in_process(f"deepspeed_json={base}", *QUICK, run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed", ran.outcome.error
    run_dir = RunDir(tmp_path / "run")
    assert ran.summary()["precision"] == "bf16"  # read from the engine (bfloat16_enabled), not from the dict
    assert json.loads(run_dir.ds_config.read_text())["bf16"] == {"enabled": True}
    assert json.loads(run_dir.marker("step2").read_text())["precision"] == "bf16"
