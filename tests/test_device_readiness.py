"""What a GPU machine's first run depends on, checked here: the optimizer fallback, build locks, fp16's
loss-scale reading, and the memory figures (their CUDA side runs in tests/test_gpu.py)."""

from __future__ import annotations

import math
import os
import time

import pytest

from launcher.train import memory_meter as device_memory
from launcher.train import ops
from launcher.train.memory_meter import MemoryMeter, pinned_host_bytes
from launcher.train.trainer import _loss_scale
from tests.test_train_e2e import SHORT, losses, summary


def _ds(offload: str, **params) -> dict:
    return {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": offload}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}},
    }


def test_only_an_offloaded_deepspeed_optimizer_has_an_op_to_fall_back_from():
    planned = _ds("none", torch_adam=True, fused=True)  # what the composition plans without offload
    assert ops.optimizer_fallback(planned) is None
    assert planned == _ds("none", torch_adam=True, fused=True)
    asked = _ds("cpu", torch_adam=True)  # a JSON that already asks for torch's optimizer
    assert ops.optimizer_fallback(asked) is None and "fused" not in asked["optimizer"]["params"]
    assert ops.optimizer_fallback({"zero_optimization": {"stage": 0}}) is None  # no optimizer block


def test_a_build_lock_older_than_any_build_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ops.stale_build_lock("cpu_adam") is None
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert ops.stale_build_lock("cpu_adam") is None  # a build may be running now
    old = time.time() - ops.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert ops.stale_build_lock("cpu_adam") == lock


def test_every_deepspeed_fp16_optimizer_reports_its_loss_scale_the_way_the_metric_reads_it():
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # ZeRO-0's FP16_Optimizer has no `cur_scale` (the metric used to read it, and was NaN there).
    assert not hasattr(FP16_Optimizer, "cur_scale")
    for optimizer in (FP16_Optimizer, FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3):
        assert isinstance(optimizer.loss_scale, property), optimizer.__name__

    class Scaled:
        loss_scale = 1024.0

    assert _loss_scale(Scaled()) == 1024.0
    assert math.isnan(_loss_scale(object()))


def test_on_a_cpu_the_memory_figure_is_the_process_peak_resident_set():
    reading = MemoryMeter(device=type("Device", (), {"type": "cpu"})()).read()
    assert reading[device_memory.PEAK] == reading[device_memory.HOST_PEAK] > 0
    assert set(reading) == {device_memory.PEAK, device_memory.HOST_PEAK}


def test_pinned_bytes_are_read_from_the_host_allocator_stats_of_any_layout():
    assert pinned_host_bytes({"allocated_bytes.peak": 4096, "allocated_bytes.current": 0}) == 4096
    assert pinned_host_bytes({"allocated_bytes.all.peak": 8}) == 8
    assert pinned_host_bytes({}) is None  # CUDA not initialised: torch returns no stats


@pytest.mark.slow
def test_an_offloaded_optimizer_trains_with_torch_adamw_when_cpu_adam_cannot_be_built(run_train, tmp_path):
    """No C++ compiler (CXX fails) and no cached op: one line says so, and the job trains anyway."""
    run_dir = tmp_path / "run"
    env = {"CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    result = run_train("deepspeed=z2_offload", *SHORT, f"hydra.run.dir={run_dir}", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "cpu_adam op could not be built" in line]
    assert len(lines) == 1 and "torch's fused AdamW" in lines[0], result.stderr[-3000:]
    assert summary(run_dir)["optimizer"] == "AdamW"
    curve = losses(run_dir)
    assert curve[-1] < curve[0]
