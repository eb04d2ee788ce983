"""One optimizer step of one rank, and what it measures: loss, learning rate, gradient norm, throughput.

    accum batches -> their answer tokens (pairs), summed over ranks (one all-reduce; none on one rank)
    accum x (batch -> the loss's forward (launcher.train.losses), weighted by its share of the answer
             tokens -> engine.backward -> engine.step)
    one all-reduce: the loss's sums and the tokens over ranks, and whether any rank was asked to stop

The loss is the mean over every answer token of the step, on every rank: a micro-batch's mean is
weighted by its answer tokens, so how records are split into micro-batches, rows or ranks changes no
loss and no gradient (a packed row of 11 short records counts 11 records, not one row; a micro-batch of
long answers outweighs one of short answers, as in one large batch). Transformers' Trainer normalises
the same way (num_items_in_batch).

A non-finite loss stops the run at once (fp32 and bf16: the update was applied, the weights are
spoiled), except under fp16, whose loss scaler skips such an update (up to train.max_nonfinite_steps in
a row).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from launcher.core.checkpoints import find_resume_tag
from launcher.core.errors import TrainingFailed
from launcher.core.rundir import RunDir
from launcher.core.scopes import scope
from launcher.data.packing import REAL_TOKENS, RECORD_LENGTHS
from launcher.data.video import takes_model_dtype
from launcher.model.flops import FlopModel
from launcher.model.packing import packed_inputs
from launcher.train.distributed import Rank, all_reduce_sum
from launcher.train.engine import Engine, unpartitioned_grad_norm
from launcher.train.faults import Fault
from launcher.train.loaders import Data
from launcher.train.losses import Loss
from launcher.train.memory_meter import MemoryMeter


@dataclass
class Work:
    """What a step's batches held, summed over its micro-batches (and, once reduced, over the ranks)."""

    tokens: float = 0.0
    padded: float = 0.0
    image_tokens: float = 0.0
    flops: float = 0.0
    samples: float = 0.0  # records: a packed row holds several

    def add(self, batch: dict[str, Any], flops: FlopModel | None) -> None:
        packed = RECORD_LENGTHS in batch
        mask = batch[REAL_TOKENS] if packed else batch["attention_mask"]
        self.tokens += float(mask.sum())
        self.padded += float(mask.numel())
        # Attention is per record: a packed row's records each attend within themselves.
        lengths = [n for row in batch[RECORD_LENGTHS] for n in row] if packed else mask.sum(dim=1).tolist()
        self.samples += len(lengths)
        if flops is None:
            return
        for token_id in (flops.image_token_id, flops.video_token_id):  # a video's tokens count as image tokens
            if token_id is not None:
                self.image_tokens += float((batch["input_ids"] == token_id).sum())
        self.flops += flops.step_flops(lengths, flops.image_rows(batch))

    def metrics(self, seconds: float, peak: float | None, world_size: int) -> dict[str, float]:
        """Real tokens/s, padding and image shares, model TFLOP/s and MFU (against `peak` per device)."""
        figures = {
            "perf/tokens_per_sec": self.tokens / seconds,
            "perf/padding_frac": 1.0 - self.tokens / self.padded if self.padded else 0.0,
            "perf/image_token_frac": self.image_tokens / self.tokens if self.tokens else 0.0,
        }
        if self.flops:
            figures["perf/model_tflops_per_sec"] = self.flops / seconds / 1e12
            if peak:
                figures["perf/mfu"] = self.flops / seconds / (peak * world_size)
        return figures


@dataclass
class Throughput:
    """Samples and tokens per second over the measured steps (the first few warm up allocators and JIT)."""

    skip_steps: int
    seconds: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0  # real (non-padding) tokens
    padded: float = 0.0  # token slots, padding included
    image_tokens: float = 0.0  # of the real tokens, those an image's rows fill
    flops: float = 0.0  # model FLOPs of the useful work (launcher.model.flops)

    def add(self, step: int, seconds: float, samples: float, work: Work) -> None:
        if step > self.skip_steps:
            self.seconds += seconds
            self.samples += samples
            self.tokens += work.tokens
            self.padded += work.padded
            self.image_tokens += work.image_tokens
            self.flops += work.flops

    def per_second(self, what: float) -> float | None:
        return what / self.seconds if self.seconds else None


class CpuClock:
    """CPU seconds this rank used per loop iteration: its whole process (every thread: torch's
    intra-op pool, W&B's, the watchdog) and its main thread alone. DataLoader workers are other processes.

    Each lap covers one full iteration (the step, and the previous step's metrics, logging and stop
    check), so what the launcher adds around the step is in it. Other processes on the machine disturb
    CPU time far less than wall time: this is the figure to compare loops by (bench/overhead.py)."""

    def __init__(self) -> None:
        self.process, self.thread = time.process_time(), time.thread_time()

    def lap(self) -> dict[str, float]:
        process, thread = time.process_time(), time.thread_time()
        lap = {"perf/step_cpu_s": process - self.process, "perf/step_main_thread_cpu_s": thread - self.thread}
        self.process, self.thread = process, thread
        return lap


@dataclass
class StepState:
    """What one step hands the next, and what every step reads."""

    run_dir: RunDir  # named in the line of a non-finite loss, with its last checkpoint
    throughput: Throughput
    memory: MemoryMeter
    fault: Fault
    max_nonfinite: int  # train.max_nonfinite_steps: fp16 updates its loss scaler may skip in a row
    flops: FlopModel | None = None  # counts the model FLOPs of a batch (None: a layout it does not know)
    peak_flops: float | None = None  # this device's peak FLOP/s (launcher.train.peak; None: unknown)
    last_loss: float = math.nan
    nonfinite_in_a_row: int = 0
    stop_agreed: bool = False  # some rank was asked to stop: all stop after this step
    loss: Loss | None = None  # the objective (launcher.train.losses; None until the trainer sets it)


def train_step(engine: Engine, data: Data, rank: Rank, state: StepState, step: int, *, stop: bool) -> dict[str, float]:
    """One optimizer step over `accum` micro-batches; its metrics (the loss averaged over ranks).

    `stop`: this rank was asked to stop; the ranks agree on it in the step's one all-reduce."""
    ds, device = engine.engine, rank.device
    step_start = time.perf_counter()
    wait = 0.0
    work = Work()
    grad_norm = math.nan
    applied_rates = engine.applied_rates()  # what this step's update applies (the scheduler steps after it)
    fetch_start = time.perf_counter()
    with scope("data"):
        batches = [next(data.batches) for _ in range(engine.accum)]
    wait += time.perf_counter() - fetch_start
    loss = state.loss
    units = [loss.units(batch) for batch in batches]  # what the step's loss is the mean over: answer tokens, pairs
    (step_units,) = all_reduce_sum([float(sum(units))], device)
    sums = loss.new_sums()
    for batch, micro_units in zip(batches, units, strict=True):
        work.add(batch, state.flops)
        if RECORD_LENGTHS in batch:  # packed rows: positions that restart at every record, no attention mask
            batch = packed_inputs(ds.module, batch)
        # The mean over the micro-batch's units (its answer tokens, or its pairs).
        with scope("forward"):
            micro_loss = loss.forward(ds, batch, "train", lambda inputs: to_device(inputs, device, engine.dtype), sums)
        # DeepSpeed divides by accum (and averages gradients over ranks): weighted so the sum over the
        # step's micro-batches and ranks is the mean over all its answer tokens (or pairs).
        weight = micro_units * engine.accum * rank.world_size / max(step_units, 1.0)
        with scope("backward"):
            ds.backward(micro_loss * weight if weight != 1.0 else micro_loss)
        if engine.grad_norm.computed_here and ds.is_gradient_accumulation_boundary():
            grad_norm = unpartitioned_grad_norm(ds)
        with scope("optimizer"):
            ds.step()
    state.fault.at(step)
    counts = [work.tokens, work.padded, work.image_tokens, work.flops, work.samples]
    reduced = all_reduce_sum([float(stop), *counts, *sums.as_list()], device)
    state.stop_agreed = reduced[0] > 0
    work = Work(*reduced[1 : 1 + len(counts)])
    loss_metrics = type(sums)(*reduced[1 + len(counts) :]).metrics("train")
    step_loss = loss_metrics["train/loss"]
    check_finite(state, step, step_loss, fp16=engine.dtype == torch.float16)
    step_time = time.perf_counter() - step_start
    samples = work.samples  # records (micro x accum x ranks, unless rows are packed)
    state.throughput.add(step, step_time, samples, work)
    state.last_loss = step_loss
    metrics = {
        **loss_metrics,
        **applied_rates,
        "train/grad_norm": engine.grad_norm.of_step(ds, grad_norm),
        "perf/samples_per_sec": samples / step_time,
        **work.metrics(step_time, state.peak_flops, rank.world_size),
        "perf/step_time_s": step_time,
        "perf/data_wait_frac": wait / step_time,
        **state.memory.read(),
    }
    for name, count in data.source_counts().items():
        metrics[f"data/samples_{name}"] = count  # cumulative: the mixture's realised shares
    if engine.dtype == torch.float16:
        metrics["train/loss_scale"] = loss_scale(ds.optimizer)
    return metrics


def nonfinite_action(loss: float, fp16: bool, in_a_row: int, allowed: int) -> str:
    """What a step's loss means for the run: "ok", "skip" (fp16, whose loss scaler skipped the update), "stop".

    fp32 and bf16 have no loss scaler: a non-finite loss means the update was applied and the weights
    are spoiled, so the run stops at once (naming the step) and the last checkpoint stays the good one."""
    if math.isfinite(loss):
        return "ok"
    return "skip" if fp16 and in_a_row <= allowed else "stop"


def check_finite(state: StepState, step: int, loss: float, *, fp16: bool) -> None:
    """Stop on a non-finite loss, unless fp16's loss scaler skipped that update (within the budget)."""
    state.nonfinite_in_a_row = 0 if math.isfinite(loss) else state.nonfinite_in_a_row + 1
    if nonfinite_action(loss, fp16, state.nonfinite_in_a_row, state.max_nonfinite) != "stop":
        return
    saved = find_resume_tag(state.run_dir)
    fixes = "lower train.lr, use precision=bf16 instead of fp16," if fp16 else "lower train.lr"
    raise TrainingFailed(
        f"loss is {loss} at step {step}: {fixes} or check the data"
        + (f"; checkpoint {saved}, saved before it, resumes with resume={state.run_dir.path}" if saved else "")
    )


def loss_scale(optimizer: Any) -> float:
    """fp16's current loss scale. Every DeepSpeed fp16 optimizer has `loss_scale` (ZeRO-0's FP16_Optimizer
    has no `cur_scale`, which only ZeRO 1-3 add)."""
    scale = getattr(optimizer, "loss_scale", None)
    return float(scale) if scale is not None else math.nan


def to_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Move tensors to the device; floating inputs (pixels) take the engine's training dtype (not a video's
    seconds per temporal patch: Qwen2.5-VL's time index, fp32 as its processor makes them)."""
    moved = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            value = _moved(value, device)
            if takes_model_dtype(key, value):
                value = value.to(dtype)
        moved[key] = value
    return moved


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; an expanded view (packing's all-true mask) stays one there. `.to` would copy every
    element it repeats: rows x length^2 bytes (256 MiB for 4 rows of 8,192), through the host, per micro-batch."""
    if tensor.device == device or 0 not in tensor.stride():
        return tensor.to(device, non_blocking=True)
    repeated = tuple(slice(0, 1) if stride == 0 else slice(None) for stride in tensor.stride())
    return tensor[repeated].to(device, non_blocking=True).expand(tensor.shape)
