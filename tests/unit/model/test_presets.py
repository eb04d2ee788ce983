"""The real presets' shipped architecture configs (launcher/model/presets/): planning, dry runs and the memory
preflight of llava_1_5_7b, qwen2_vl_2b and qwen2_5_vl_7b work offline, and say the same as a local copy.

The hub is offline here (`offline`: HF_HUB_OFFLINE, and any TCP connection refused), so a test that passed
by asking the hub would fail instead.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from launcher.config.compose import compose
from launcher.config.schema import typed
from launcher.job.planning import model_hidden_size
from launcher.model.loading import PRESET_CONFIGS, read_config
from launcher.plan import report as plan
from launcher.plan.report import report
from tests.helpers import run_here

HUB_IDS = {
    "qwen2_vl_2b": "Qwen/Qwen2-VL-2B-Instruct",
    "llava_1_5_7b": "llava-hf/llava-1.5-7b-hf",
    "qwen2_5_vl_7b": "Qwen/Qwen2.5-VL-7B-Instruct",
}
HIDDEN = {"qwen2_vl_2b": 1536, "llava_1_5_7b": 4096, "qwen2_5_vl_7b": 3584}  # the text models' hidden sizes
PLAN = ["dist.nproc_per_node=8", "plan.gpu_memory_gb=80"]  # the README's plan command, less the model


@pytest.fixture
def offline(monkeypatch):
    """No hub: HF_HUB_OFFLINE=1 (as huggingface_hub read it at import), and every TCP connection refused."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    connect = socket.socket.connect

    def refuse(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"a test without network tried to connect to {address}")
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", refuse)


def local_copy(tmp_path, model: str):
    """The shipped config.json as a local directory (what a hub download holds)."""
    local = tmp_path / "local"
    local.mkdir()
    (local / "config.json").write_text((PRESET_CONFIGS / HUB_IDS[model].replace("/", "--") / "config.json").read_text())
    return local


def test_every_real_preset_ships_its_config():
    shipped = {path.name for path in PRESET_CONFIGS.iterdir() if (path / "config.json").is_file()}
    assert shipped == {hub_id.replace("/", "--") for hub_id in HUB_IDS.values()}
    for model, hub_id in HUB_IDS.items():
        assert typed(compose([f"model={model}"])).model.path == hub_id


@pytest.mark.parametrize("model", list(HUB_IDS))
def test_a_real_presets_config_reads_offline_as_a_local_copy_does(offline, tmp_path, model):
    config = read_config(HUB_IDS[model])
    copy = read_config(str(local_copy(tmp_path, model)))
    assert {**config.to_dict(), "_name_or_path": ""} == {**copy.to_dict(), "_name_or_path": ""}
    assert model_hidden_size(typed(compose([f"model={model}"])).model) == HIDDEN[model]


def test_a_hub_id_that_is_not_shipped_fails_at_once_offline(offline, capsys):
    started = time.perf_counter()
    assert plan.main(["model=qwen2_vl_2b", "model.path=someone/not-shipped"]) == 2
    err = capsys.readouterr().err
    expected = "model.path=someone/not-shipped: cannot read its config: not a local directory, and the hub cannot"
    assert expected in err and "HF_HUB_OFFLINE=1" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert time.perf_counter() - started < 30  # no 30 s of retries


@pytest.mark.slow  # two plans of every preset and precision
@pytest.mark.parametrize("model", list(HUB_IDS))
def test_real_presets_plan_offline_with_the_same_table_as_a_local_copy(offline, tmp_path, model):
    overrides = [f"model={model}", *PLAN]
    offline_report = report(typed(compose(overrides)), overrides)
    assert "recommendation: deepspeed=" in offline_report
    local = [f"model={model}", f"model.path={local_copy(tmp_path, model)}", *PLAN]
    assert report(typed(compose(local)), local) == offline_report


def test_dry_run_of_a_real_preset_works_offline(offline, tmp_path):
    run_dir = tmp_path / "run"
    ran = run_here(
        ["model=qwen2_vl_2b", "dist.nproc_per_node=8", "precision=bf16", "deepspeed=z3", "dry_run=true"], run_dir
    )
    assert ran.outcome.status == "planned" and ran.outcome.exit_code == 0, ran.error
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds == ran.outcome.ds_config
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1536 * 1536  # the text model's hidden size
    # The Qwen2-VL full recipe (conf/recipe/qwen2_vl_2b_full.yaml): micro batch 1 x 2 accumulated per rank.
    assert ds["train_batch_size"] == 1 * 2 * 8 and ds["gradient_accumulation_steps"] == 2
    assert ds["scheduler"]["params"]["total_num_steps"] == 750  # 3 epochs x 4,000 built-in records / 16
    assert any(line.endswith("train.max_steps=750") for line in ran.lines), ran.lines
