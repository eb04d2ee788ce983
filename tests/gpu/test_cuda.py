"""The paths only a CUDA device runs, through `python train.py` (NCCL ranks in child processes): bf16 and
fp16 at ZeRO 0-3, fp16's loss scale, the memory metrics, the pinned loader, the optimizer offload, QLoRA
(bitsandbytes), flash attention, and the tuner's memory cap.

Skipped without CUDA; on a lent GPU machine they run in `bench/device_check.sh`, or with

    python -m pytest -m gpu -q
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from launcher.train.distributed import CUDA_MEMORY_CAP_ENV
from tests.helpers import ROOT, losses, read_metrics, read_summary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Long enough for the loss to fall on every preset.
SHORT = [
    "logger=none",
    "train.micro_batch_size=8",
    "train.max_steps=20",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("preset", ["z0", "z1", "z2", "z3"])
def test_cuda_trains_at_every_zero_stage_with_its_memory_metrics(run_train, tmp_path, preset, precision):
    run_dir = tmp_path / "run"
    result = run_train(f"deepspeed={preset}", f"precision={precision}", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    done = read_summary(run_dir)
    assert done["precision"] == precision and done["zero_stage"] == int(preset[1])
    curve = losses(run_dir)
    assert curve[-1] < curve[0]
    last = read_metrics(run_dir)[-1]
    # The allocator's peak reserve holds its peak of live tensors; the device-wide use adds the context.
    assert last["mem/peak_bytes"] >= last["mem/peak_allocated_bytes"] > 0
    assert last["mem/device_used_bytes"] >= last["mem/peak_allocated_bytes"]
    assert done["peak_memory_bytes"] >= last["mem/peak_bytes"]  # the summary's is read after the last save
    assert done["memory"]["host_peak_bytes"] > 0
    # The DataLoader pins its batches (torch's host allocator counts them).
    assert done["memory"].get("pinned_host_bytes", 0) > 0
    if precision == "fp16":  # every DeepSpeed fp16 optimizer reports its dynamic loss scale
        scales = [m["train/loss_scale"] for m in read_metrics(run_dir)]
        assert all(math.isfinite(scale) and scale > 0 for scale in scales), scales


def test_an_offloaded_optimizer_uses_deepspeeds_cpu_adam_and_pinned_host_memory(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("deepspeed=z2_offload", "precision=bf16", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    done = read_summary(run_dir)
    assert done["optimizer"] == "DeepSpeedCPUAdam"
    assert done["memory"]["pinned_host_bytes"] > 0  # DeepSpeed's offload buffers are page-locked
    curve = losses(run_dir)
    assert curve[-1] < curve[0]


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs the flash-attn package")
def test_auto_attention_picks_flash_attention_2_on_cuda_in_bf16(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("precision=bf16", "model.attn_implementation=auto", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(run_dir)["attn_implementation"] == "flash_attention_2"


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
@pytest.mark.parametrize("preset", ["z2", "z3"])
def test_qlora_trains_and_exports(run_train, tmp_path, preset):
    run_dir = tmp_path / "run"
    result = run_train("method=qlora", "precision=bf16", f"deepspeed={preset}", *SHORT, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_summary(run_dir)["method"] == "qlora"
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
    args = ["model.hidden_size=1024", "model.num_layers=4", *SHORT, f"hydra.run.dir={tmp_path / 'capped'}"]
    result = run_train(*args, env={CUDA_MEMORY_CAP_ENV: "0.05"})  # 50 MiB: below this model's states
    assert result.returncode == 1 and "out of memory" in result.stderr.lower(), result.stderr[-3000:]
