"""launcher.train.step: what a non-finite loss does, fp16's loss scale, throughput and CPU time per step,
and the metrics a step writes (read from one short run, `quick_run`)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from PIL import Image

from launcher.core import checkpoints
from launcher.core.checkpoints import CheckpointMarker
from launcher.core.errors import TrainingFailed
from launcher.core.rundir import RunDir
from launcher.data.collate import Collator
from launcher.model.flops import FlopModel
from launcher.model.loading import load_model_and_processor
from launcher.train.faults import Fault
from launcher.train.memory_meter import MemoryMeter
from launcher.train.step import (
    CpuClock,
    StepState,
    Throughput,
    Work,
    check_finite,
    loss_scale,
    nonfinite_action,
    to_device,
)
from tests.helpers import read_metrics
from tests.unit.model.test_flops import sample
from tests.unit.model.tiny_sizes import build


def test_a_nonfinite_loss_stops_unless_fp16_may_skip_it():
    assert nonfinite_action(1.5, fp16=False, in_a_row=0, allowed=0) == "ok"
    for loss in (math.nan, math.inf, -math.inf):
        assert nonfinite_action(loss, fp16=False, in_a_row=1, allowed=5) == "stop"  # fp32/bf16: always
        assert nonfinite_action(loss, fp16=True, in_a_row=1, allowed=0) == "stop"  # the default
        assert nonfinite_action(loss, fp16=True, in_a_row=2, allowed=2) == "skip"
        assert nonfinite_action(loss, fp16=True, in_a_row=3, allowed=2) == "stop"


def state_of(run_dir: RunDir, max_nonfinite: int = 0) -> StepState:
    return StepState(
        run_dir=run_dir,
        throughput=Throughput(skip_steps=0),
        memory=MemoryMeter(torch.device("cpu")),
        fault=Fault(0),
        max_nonfinite=max_nonfinite,
    )


def test_a_nonfinite_loss_names_the_step_and_the_checkpoint_saved_before_it(tmp_path):
    run_dir = RunDir(tmp_path)
    state = state_of(run_dir)
    check_finite(state, 1, 2.5, fp16=False)
    with pytest.raises(TrainingFailed) as failed:
        check_finite(state, 2, math.nan, fp16=False)
    assert str(failed.value) == "loss is nan at step 2: lower train.lr or check the data"  # no checkpoint yet
    run_dir.checkpoint("step4").mkdir(parents=True)
    checkpoints.write_marker(run_dir, CheckpointMarker(step=4, tag="step4"))
    with pytest.raises(TrainingFailed) as failed:
        check_finite(state, 5, math.inf, fp16=True)
    assert str(failed.value) == (
        "loss is inf at step 5: lower train.lr, use precision=bf16 instead of fp16, or check the data; "
        f"checkpoint step4, saved before it, resumes with resume={tmp_path}"
    )


def test_fp16_skips_nonfinite_steps_up_to_its_budget_in_a_row(tmp_path):
    state = state_of(RunDir(tmp_path), max_nonfinite=2)
    check_finite(state, 1, math.nan, fp16=True)
    check_finite(state, 2, math.nan, fp16=True)
    check_finite(state, 3, 1.0, fp16=True)  # a finite loss starts the count again
    assert state.nonfinite_in_a_row == 0
    check_finite(state, 4, math.nan, fp16=True)
    check_finite(state, 5, math.nan, fp16=True)
    with pytest.raises(TrainingFailed, match=r"^loss is nan at step 6"):
        check_finite(state, 6, math.nan, fp16=True)


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

    assert loss_scale(Scaled()) == 1024.0
    assert math.isnan(loss_scale(object()))


def test_throughput_leaves_out_the_warm_up_steps():
    throughput = Throughput(skip_steps=2)
    assert throughput.per_second(10) is None  # nothing measured yet
    for step in (1, 2, 3, 4):
        throughput.add(step, seconds=step * 1.0, samples=8, work=Work(tokens=100, padded=125, flops=1e9))
    assert (throughput.seconds, throughput.samples, throughput.tokens) == (7.0, 16, 200)
    assert (throughput.padded, throughput.flops) == (250, 2e9)
    assert throughput.per_second(throughput.samples) == pytest.approx(16 / 7)


@pytest.fixture(scope="module")
def model_dirs_llava(tmp_path_factory):
    return load_model_and_processor(str(build("tiny_llava", tmp_path_factory.mktemp("tiny") / "tiny_llava")))


def test_a_steps_work_counts_real_tokens_padding_image_tokens_and_model_flops(model_dirs_llava):
    """Two samples, one padded: real tokens and padding from the attention mask, image tokens from the
    image placeholder, model FLOPs from launcher.model.flops on the real tokens; MFU against the peak."""
    model, processor = model_dirs_llava
    flops = FlopModel.of(model)
    image = Image.new("RGB", (32, 32), "red")
    samples = [sample([image], "red circle"), sample([], "hi")]
    batch = Collator(processor)(samples)
    work = Work()
    work.add(batch, flops)
    real = int(batch["attention_mask"].sum())
    assert work.tokens == real and work.padded == batch["input_ids"].numel() > real
    assert work.image_tokens == int((batch["input_ids"] == model.config.image_token_id).sum()) > 0
    assert work.flops == flops.step_flops(batch["attention_mask"].sum(dim=1).tolist(), flops.image_rows(batch))
    figures = work.metrics(seconds=2.0, peak=1e9, world_size=2)
    assert figures["perf/tokens_per_sec"] == real / 2
    assert figures["perf/padding_frac"] == pytest.approx(1 - real / work.padded)
    assert figures["perf/image_token_frac"] == pytest.approx(work.image_tokens / real)
    assert figures["perf/mfu"] == pytest.approx(work.flops / 2.0 / 2e9)
    assert "perf/mfu" not in work.metrics(seconds=2.0, peak=None, world_size=2)  # an unknown peak: no MFU


def test_cpu_time_per_lap_counts_the_process_and_its_main_thread():
    clock = CpuClock()
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # busy in this thread
        pass
    lap = clock.lap()
    assert lap["perf/step_main_thread_cpu_s"] >= 0.05
    assert lap["perf/step_cpu_s"] >= lap["perf/step_main_thread_cpu_s"] * 0.99
    assert clock.lap()["perf/step_main_thread_cpu_s"] < 0.05  # the next lap starts where this one ended


def test_a_batch_moves_to_the_device_with_floating_inputs_in_the_training_dtype():
    batch = {"input_ids": torch.ones(2, 3, dtype=torch.long), "pixel_values": torch.ones(2, 4), "n_images": [1, 1]}
    moved = to_device(batch, torch.device("cpu"), torch.bfloat16)
    assert moved["input_ids"].dtype == torch.long and moved["pixel_values"].dtype == torch.bfloat16
    assert moved["n_images"] == [1, 1]


def test_an_expanded_view_reaches_another_device_as_a_view_of_its_one_value():
    """Packing's all-true mask is a rows x length^2 view of one value: moved whole, a GPU got 256 MiB per
    micro-batch for 4 rows of 8,192, copied through the host ("meta" stands for the GPU: no values, strides)."""
    mask = torch.ones((1, 1, 1, 1), dtype=torch.bool).expand(4, 1, 8192, 8192)
    grid = torch.arange(6).reshape(2, 3).expand(5, 2, 3)  # a batch-wide view of a real block
    moved = to_device({"attention_mask": mask, "grid": grid}, torch.device("meta"), torch.bfloat16)
    assert moved["attention_mask"].shape == mask.shape and moved["attention_mask"].stride() == (0, 1, 0, 0)
    assert moved["grid"].shape == grid.shape and moved["grid"].stride() == (0, 3, 1)
    assert mask.to("meta").stride() == (8192 * 8192,) * 2 + (8192, 1)  # what `.to` alone makes of it
    # Its values are the view's ("cpu:0" is another device than a tensor's "cpu" to `to_device`, with values).
    assert torch.equal(to_device({"grid": grid}, torch.device("cpu", 0), torch.float32)["grid"], grid)


@pytest.mark.slow
def test_every_step_records_its_loss_rate_norm_speed_and_cpu_time(quick_run):
    rows = read_metrics(quick_run.run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0
        assert row["perf/samples_per_sec"] > 0 and 0 <= row["perf/data_wait_frac"] <= 1
        # each rank's CPU per loop iteration: the whole process, and its main thread
        assert 0 < row["perf/step_main_thread_cpu_s"] <= row["perf/step_cpu_s"] * 1.01
        assert "train/loss_scale" not in row  # fp32: no loss scaler
        assert row["perf/tokens_per_sec"] > 0 and 0 <= row["perf/padding_frac"] < 1
        assert 0 < row["perf/image_token_frac"] < 1 and 0 < row["perf/mfu"] < 1  # the built-in set: 1 image each
    assert rows[0]["train/lr"] > 0  # the rate step 1 applied: the first update moves the weights
