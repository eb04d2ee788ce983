"""The paths only a CUDA device runs: QLoRA (bitsandbytes), flash attention, bf16 on a GPU.

Skipped without CUDA; on a lent GPU machine run them all with one command:

    python -m pytest -m gpu -q
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.test_train_e2e import SHORT, losses, summary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_bf16_on_cuda_trains_at_zero2_and_zero3(run_train, tmp_path):
    for preset in ("z2", "z3"):
        run_dir = tmp_path / preset
        result = run_train(f"deepspeed={preset}", "precision=bf16", *SHORT, f"hydra.run.dir={run_dir}")
        assert result.returncode == 0, result.stderr[-3000:]
        assert summary(run_dir)["precision"] == "bf16"
        curve = losses(run_dir)
        assert curve[-1] < curve[0]


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs the flash-attn package")
def test_auto_attention_picks_flash_attention_2_on_cuda_in_bf16(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("precision=bf16", "model.attn_implementation=auto", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["attn_implementation"] == "flash_attention_2"


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
@pytest.mark.parametrize("preset", ["z2", "z3"])
def test_qlora_trains_and_exports(run_train, tmp_path, preset):
    import subprocess
    import sys

    from tests.conftest import ROOT

    run_dir = tmp_path / "run"
    result = run_train("method=qlora", "precision=bf16", f"deepspeed={preset}", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["method"] == "qlora"
    config = json.loads((run_dir / "model" / "adapter_config.json").read_text())
    assert config["modules_to_save"]
    curve = losses(run_dir)
    assert curve[-1] < curve[0]
    exported = subprocess.run(
        [sys.executable, "-m", "launcher.export", str(run_dir), "--merge", "--out", str(tmp_path / "merged")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert exported.returncode == 0, exported.stderr[-3000:]


def test_the_cuda_memory_cap_makes_an_over_budget_run_a_real_out_of_memory(run_train, tmp_path):
    """launcher.tune caps each candidate's allocator at its budget (LAUNCHER_CUDA_MEMORY_GB): a job that
    needs more fails with CUDA's own out-of-memory error, which the tuner records as "does not fit"."""
    from launcher.job import CUDA_MEMORY_CAP_ENV

    args = ["model.hidden_size=1024", "model.num_layers=4", *SHORT, f"hydra.run.dir={tmp_path / 'capped'}"]
    result = run_train(*args, env={CUDA_MEMORY_CAP_ENV: "0.05"})  # 50 MiB: below this model's states
    assert result.returncode == 1 and "out of memory" in result.stderr.lower(), result.stderr[-3000:]
