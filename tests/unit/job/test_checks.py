"""launcher.job.checks: the rules that need DeepSpeed's classes, the file system or the machine, each
called on its own. What the user sees of them (one line from `run_job`, before any rank starts):
tests/unit/launch/test_run.py."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

from launcher.config.ranges import usable_cores
from launcher.core.errors import LauncherError
from launcher.job import checks
from tests.helpers import compose_typed


def _ds(optimizer: dict | None = None, scheduler: dict | None = None, offload: str = "none") -> dict:
    ds: dict = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": offload}}}
    if optimizer:
        ds["optimizer"] = optimizer
    if scheduler:
        ds["scheduler"] = scheduler
    return ds


@pytest.mark.parametrize(
    ("optimizer", "offload", "expected"),
    [
        ({"type": "AdamW", "params": {"lr": 1e-3}}, "none", FusedAdam),
        ({"type": "AdamW", "params": {"lr": 1e-3}}, "cpu", DeepSpeedCPUAdam),
        ({"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": True}}, "nvme", DeepSpeedCPUAdam),
        ({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True, "fused": True}}, "cpu", torch.optim.AdamW),
        ({"type": "Adagrad", "params": {}}, "none", torch.optim.Adagrad),
        ({"type": "Adagrad", "params": {}}, "cpu", None),  # DeepSpeed's CPU Adagrad: its own op
        ({"type": "Lamb", "params": {}}, "none", None),  # checked by DeepSpeed itself
        ({"type": "SGD", "params": {"lr": 0.1}}, "none", torch.optim.SGD),
    ],
)
def test_the_optimizer_class_is_the_one_deepspeed_builds(optimizer, offload, expected):
    cls, params = checks._optimizer_class(optimizer, _ds(offload=offload))
    assert cls is expected
    # DeepSpeed's own keys never reach the class's signature check.
    assert not {"torch_adam", "adam_w_mode", "fp32_optimizer_states"} & set(params)


def test_an_optimizer_torch_does_not_have_names_the_spelling():
    with pytest.raises(LauncherError, match=r"optimizer.type=sgd is not an optimizer .* spelt as torch spells it"):
        checks.check_optimizer_and_scheduler(_ds({"type": "sgd", "params": {}}))


def test_unknown_and_missing_parameters_name_the_key():
    with pytest.raises(LauncherError, match=r"optimizer.params.betas is not a parameter of the optimizer \(type SGD\)"):
        checks.check_optimizer_and_scheduler(_ds({"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}))
    one_cycle = {"type": "OneCycle", "params": {"cycle_min_lr": 0.0}}
    with pytest.raises(LauncherError, match=r"scheduler.params.cycle_max_lr is required by the scheduler OneCycle"):
        checks.check_optimizer_and_scheduler(_ds(scheduler=one_cycle))
    one_cycle["params"]["cycle_max_lr"] = 1e-3
    checks.check_optimizer_and_scheduler(_ds({"type": "AdamW", "params": {"lr": 1e-3}}, one_cycle))


def test_a_torch_scheduler_is_accepted_by_its_own_signature():
    checks.check_optimizer_and_scheduler(_ds(scheduler={"type": "StepLR", "params": {"step_size": 10}}))
    with pytest.raises(LauncherError, match=r"scheduler.params.step_size is required by the scheduler StepLR"):
        checks.check_optimizer_and_scheduler(_ds(scheduler={"type": "StepLR", "params": {}}))


def test_an_nvme_path_must_be_a_directory(tmp_path):
    zero = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    checks.check_paths({"zero_optimization": zero})
    zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(tmp_path / "missing")}
    with pytest.raises(LauncherError, match=rf"offload.nvme_path={tmp_path / 'missing'} does not exist"):
        checks.check_paths({"zero_optimization": zero})
    checks.check_paths({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/x"}}})


def test_only_ranks_started_on_this_machine_need_a_core_each():
    too_many = usable_cores() + 1
    local = compose_typed([f"dist.nproc_per_node={too_many}"]).dist
    with pytest.raises(LauncherError, match=rf"dist.nproc_per_node={too_many} is more than the {too_many - 1} CPU"):
        checks.check_local_ranks(local, "cpu")
    elsewhere = compose_typed(["dist=slurm", f"dist.nproc_per_node={too_many}"]).dist
    checks.check_local_ranks(elsewhere, "cpu")  # SLURM places the ranks: its nodes' cores count there


def test_deepspeeds_own_models_name_the_section_of_the_key_they_reject():
    ds = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": "many"}},
    }
    with pytest.raises(LauncherError, match=r"DeepSpeed rejects zero_optimization.offload_optimizer.buffer_count"):
        checks.validate_with_deepspeed(ds)
    ds["zero_optimization"]["offload_optimizer"]["buffer_count"] = 4
    checks.validate_with_deepspeed(ds)  # train_batch_size is the world's: DeepSpeed is shown one rank's


def _data_job(tmp_path, rows: list[dict], *extra: str):
    from PIL import Image

    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    (tmp_path / "data.json").write_text(json.dumps(rows))
    data = [f"data.path={tmp_path / 'data.json'}", f"cache_dir={tmp_path / 'c'}"]
    return compose_typed(["model=qwen2_vl_2b", "data=llava_json", *data, *extra])


def test_the_launcher_indexes_the_records_its_ranks_will_open_once_before_they_start(tmp_path):
    """A pretrained model's job started here: the launcher reads (and indexes) the data, so a bad record
    stops it in one line and the ranks open the index; a dry run, or ranks placed by SLURM, leave it to them."""
    good = {
        "image": "a.png",
        "conversations": [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "yo"}],
    }
    index = tmp_path / "c" / "record_index"
    checks.check_records(_data_job(tmp_path, [good] * 4), micro_batch=2, world_size=2, launching=False)
    checks.check_records(_data_job(tmp_path, [good] * 4, "dist=slurm"), micro_batch=2, world_size=2, launching=True)
    assert not index.exists()
    checks.check_records(_data_job(tmp_path, [good] * 4), micro_batch=2, world_size=2, launching=True)
    assert len(list(index.glob("*.arrow"))) == 1
    with pytest.raises(LauncherError, match=r"data.json record 1: .*missing.png"):
        checks.check_records(
            _data_job(tmp_path, [good, {**good, "image": "missing.png"}]), micro_batch=1, world_size=1, launching=True
        )
    with pytest.raises(LauncherError, match=r"fewer than one global micro-batch \(2 x 4 ranks\)"):
        checks.check_records(_data_job(tmp_path, [good] * 4), micro_batch=2, world_size=4, launching=True)


def test_packing_is_refused_for_a_language_model_whose_attention_cannot_keep_records_apart():
    """Restarting positions keep packed records apart only in models on transformers' masking utilities;
    an ALiBi model (Falcon, BLOOM, MPT) would let a record attend to the ones before it in its row."""
    from transformers import LlavaConfig, Qwen2VLConfig

    from launcher.job.checks import check_packing_model

    check_packing_model(LlavaConfig())  # a Llama language model
    check_packing_model(Qwen2VLConfig())
    for model_type in ("falcon", "bloom"):
        with pytest.raises(LauncherError) as refused:
            check_packing_model(LlavaConfig(text_config={"model_type": model_type}))
        assert str(refused.value).startswith(f"data.packing=true with a {model_type} language model (")
        assert "cannot keep packed records apart" in str(refused.value)
        assert str(refused.value).endswith("use data.group_by_length=true instead")


def test_a_deepspeed_monitor_without_its_package_is_refused_before_any_rank_starts():
    import importlib.util

    from launcher.job.checks import check_monitor_packages

    check_monitor_packages({"comet": {"enabled": False}, "wandb": {"enabled": True}})  # wandb is installed
    if importlib.util.find_spec("comet_ml") is None:
        with pytest.raises(LauncherError, match=r"comet monitor is enabled .* the comet_ml package is not installed"):
            check_monitor_packages({"comet": {"enabled": True}})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.pairs=true"], "data.pairs=True with loss=sft: the loss decides"),
        (["loss=dpo", "data.pairs=false"], "data.pairs=False with loss=dpo"),
        (["loss=dpo", "loss.beta=0"], "loss.beta=0.0: it must be a positive number"),
        (["loss=dpo", "loss.label_smoothing=0.5"], "loss.label_smoothing=0.5: it must be at least 0 and below 0.5"),
        (["loss=ipo", "loss.label_smoothing=0.1"], "loss.label_smoothing=0.1 with loss=ipo: only dpo smooths"),
        (["loss=dpo", "data.packing=true", "data.max_length=64"], "loss=dpo with data.packing=true: a pair's"),
        (["loss=dpo", "data.streaming=true"], "loss=dpo with data.streaming=true"),
        (["loss=dpo", "data=mixture", "data.sources=[{path: a.json}]"], "loss=dpo with data.sources"),
        (["loss=dpo", "train.stages=[{steps: 2, train: [language]}]"], "loss=dpo with train.stages"),
        (["loss=dpo", "loss.reference=adapter"], "loss.reference=adapter needs method=lora or qlora"),
        (["loss=dpo", "loss.reference=live", "method=qlora"], "loss.reference=live with method=qlora"),
        (["loss=dpo", "data.cache=false"], "loss.reference=precomputed with data.cache=false"),
        (["loss=dpo", "loss.reference=live", "loss.reference_path=/x"], "loss.reference_path is set with"),
    ],
)
def test_a_preference_loss_refuses_what_it_cannot_honour_in_one_line(overrides, message):
    with pytest.raises(LauncherError, match=re.escape(message)) as caught:
        checks.check_loss(compose_typed(overrides))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["loss=dpo"],
        ["loss=ipo"],
        ["loss=dpo", "method=lora", "loss.reference=adapter"],
        ["loss=dpo", "loss.reference=live"],
    ],
)
def test_the_preference_losses_people_run_pass_the_checks(overrides):
    checks.check_loss(compose_typed(overrides))


def test_a_hub_model_without_a_reachable_hub_is_named_with_its_fix_or_loaded_from_the_hub_cache(tmp_path, monkeypatch):
    """A real preset where the hub cannot be reached: refused before any rank asks it (a minute of retries,
    then advice about copying directories, in issue 44), unless the local hub cache holds it: then the ranks
    load it from there (HF_HUB_OFFLINE=1, inherited)."""
    from huggingface_hub import constants

    from launcher.job.checks import check_model_files

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # recorded, so the "1" the check sets is undone after the test
    model = compose_typed(["model=qwen2_vl_2b"]).model
    check_model_files(model, launching=False)  # a dry run plans offline
    with pytest.raises(LauncherError) as refused:
        check_model_files(model, launching=True)
    assert str(refused.value).startswith(
        "model.path=Qwen/Qwen2-VL-2B-Instruct is a hub id, but the hub cannot be reached (HF_HUB_OFFLINE=1) and the "
        f"model is not in the local hub cache ({tmp_path / 'hub'}): download it where the hub is reachable"
    )
    assert "give model.path=DIR" in str(refused.value) and "model.source=random" in str(refused.value)
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2-VL-2B-Instruct" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    check_model_files(model, launching=True)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
