"""Throughput, MFU and memory of a ~2B-parameter vision-language model per DeepSpeed preset, one GPU.

    python bench/gpu_presets.py                                  # one CUDA GPU (written for an H200)
    python bench/gpu_presets.py --deadline-unix "$T" --out-dir "$OUT/gpu_presets"    # inside a timed check
    python bench/gpu_presets.py --presets z2 z3 --micro-batch 8
    python bench/gpu_presets.py --device cpu --tiny --presets z0 z2 --out-dir /tmp/gp   # the code path, CPU
    python bench/gpu_presets.py --dry-run                        # sizes, FLOPs and DeepSpeed dicts; trains nothing

The model is a LLaVA built from config with random weights (no download): a CLIP ViT-L/14 at 336 px
(1024 wide, 24 layers) + a 2-layer MLP projector + a Llama-style language model (2048 wide, 30
layers, vocabulary 32064), about 2.0 B parameters in all (counted on the meta device and printed).
All vision layers feed the projector (`vision_feature_layer=-1`), so every layer does work.

Steps:
  1. the bf16 matmul rate of this device, in a process of its own (so the sweep's process holds no CUDA
     context while the presets run): torch.matmul of 8192 x 8192 bf16 matrices (2 n^3 FLOPs each),
     back to back for about 1 s first (GPU clocks ramp up under load; timing from a cold start reads
     low), then 7 synchronised batches of 20 products; the median batch rate is the one MFU uses, and
     the header line gives the min-max too. On a CPU: 256 x 256, 0.2 s of warm-up, 3 batches of 5;
  2. per preset, a fresh process (DeepSpeed keeps process-wide state; an out-of-memory must not end the
     sweep): the DeepSpeed dict is the one `python train.py deepspeed=PRESET precision=bf16` would give
     `deepspeed.initialize` (composed by Hydra and `launcher.job.planning.plan_job`, buckets from the language
     model's hidden size), used as it is: without an offloaded optimizer that is torch's fused AdamW
     (`"torch_adam": true, "fused": true`, nothing to build); an offload preset uses DeepSpeed's
     cpu_adam op, loaded from TORCH_EXTENSIONS_DIR (inherited when set; a CPU run defaults it to
     outputs/bench/torch_extensions), where it is JIT-built on first use (1-2 minutes) unless built
     beforehand. The model is built on the GPU (ZeRO-3: partitioned at construction by
     `HfDeepSpeedConfig` + zero.Init, as train.py does) and trained for --warmup + --steps steps on one
     synthetic batch already on the device (random pixels and tokens: this measures the model and
     DeepSpeed, not data loading). `launcher.train.memory_meter.MemoryMeter` reads memory after every step;
  3. a Markdown table, one row per preset, rewritten as each preset ends (see Files).

Columns: samples/s and tokens/s (all sequence positions, image tokens included) over the measured
steps; step s; MFU = model FLOPs per second / the median measured matmul rate of step 1 (not the
data-sheet peak); memory, the worker's last MemoryMeter reading (peaks over the whole process):
  - peak reserved GiB: the CUDA caching allocator's peak reserved bytes (`mem/peak_bytes` on a GPU),
    what an out-of-memory error counts: live tensors plus the allocator's cache;
  - peak allocated GiB: the peak of live tensors alone (`torch.cuda.max_memory_allocated`);
  - device used GiB: the largest device-wide use seen at a reading (cudaMemGetInfo: total - free):
    adds the CUDA context, NCCL's buffers and anything else on the GPU (another process's use counts);
  - pinned host GiB: the peak of page-locked host memory from torch's host allocator (where DeepSpeed's
    offload keeps optimizer states and their transfer buffers);
  - host RSS GiB: the worker's peak resident set size (offloaded states, the CPU optimizer's work).
  n/a where the reading has no such figure: on a CPU only host RSS exists. Then the optimizer actually
  built (DeepSpeed's basic optimizer: AdamW, DeepSpeedCPUAdam), the worker's setup (model build +
  `deepspeed.initialize`) and its whole wall time (imports included), and the status: ok, failed (with
  the reason; an out-of-memory says so), stopped (budget, deadline or a signal), skipped (not enough time
  left) or not run (the sweep got a signal first).

Model FLOPs: launcher.model.flops, the count train.py's `perf/mfu` uses (each part on its own rows: the
vision tower per patch and class token, the projector per image token, the language model per token;
attention per image and per sample; no recomputation counted; checked against torch.utils.flop_counter
within 5% in tests/unit/model/test_flops.py).

Files, in --out-dir DIR (default outputs/bench/gpu_presets/<YYYYmmdd-HHMMSS>), written as the sweep goes,
so a sweep stopped half-way (a check's time limit) still leaves what it measured:
  presets.md     the header lines (model size, FLOPs per sample, matmul rate, device, settings) and the
                 table so far: written at the start, when the matmul rate is measured and after each preset;
  presets.jsonl  one JSON object per preset, appended as it ends (ok, failed, stopped or skipped): the
                 worker's figures (memory under MemoryMeter's `mem/...` keys), status and wall time; a
                 failed or stopped preset carries the last 20 lines of its log (`log_tail`);
  work/          matmul.json, matmul.log, and per preset PRESET.json (the worker's figures) and PRESET.log.

Time: the sweep ends at the earlier of --budget-s after the script's start (default 450 s) and
--deadline-unix (an absolute time.time(); a timed check passes its own deadline). Before each preset
the script estimates what it needs, 1.2 x the slowest preset run so far (before the first, it assumes
it fits), and skips it when that is more than what is left; a worker still running at the end is
stopped (SIGTERM to its process group, SIGKILL 3 s later) and recorded as "stopped: budget" or
"stopped: deadline": the script exits a few seconds after the end at most (the grace, then writing
and exiting; ~1.5 s in the CPU checks), so a check should pass a deadline that leaves it that margin.
SIGTERM, SIGINT or SIGHUP to the script stop the running worker the same way, record the presets left
as not run, and exit with 128 + the signal's number (otherwise 0, whatever the presets' statuses). A
worker also dies when the script dies any other way (Linux PR_SET_PDEATHSIG): nothing is left running
on the GPU. Without CUDA (and without --device cpu) the script stops at once and says so.

Timings. CPU, --tiny, 2 cores (this repository's VM, idle): `--presets z0 z2` 17 s in all, ~5 s before the
first preset (imports, the meta-device count, the matmul process), then ~5-6 s per preset, nearly all of
it the worker's imports; z2_offload ~12 s (4 s of it loading the cached cpu_adam op). Other work on the
VM doubles these easily, and makes the CPU matmul rate (two threads) swing 100-fold: CPU MFU means nothing.
One H200 (not yet measured; defaults chosen for a 3-5 minute share of a check): the matmul step takes
~5-10 s (the process's start included); a preset's worker ~20-40 s for z0-z2 (imports, building 2 B
parameters, `deepspeed.initialize`, 7 steps of micro batch 16 at a fraction of a second each), more for
z3 (partitioning at construction) and the offloads (pinned host states; DeepSpeedCPUAdam steps over
2 B parameters on the host: seconds each), plus 1-2 minutes when cpu_adam must be JIT-built first.
Presets run in the order given (by default offloads last), so a short budget keeps the cheap ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

STARTED = time.monotonic()  # the budget counts from the script's start, its own imports included

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["z0", "z1", "z2", "z3", "z2_offload", "z3_offload"]  # offloads last: slowest, need cpu_adam
# What a preset is assumed to need: this factor x the slowest preset run so far (offloads run last and are
# slower, so a too-low estimate ends as "stopped: budget" rather than not being tried).
ESTIMATE_FACTOR = 1.2
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL: a worker stuck in a CUDA call may ignore SIGTERM
LOG_TAIL_LINES = 20

# (vision: hidden, layers, heads, image, patch; language: hidden, layers, heads, intermediate, vocab)
FULL = {
    "vision": {"hidden": 1024, "layers": 24, "heads": 16, "image": 336, "patch": 14},
    "language": {"hidden": 2048, "layers": 30, "heads": 16, "intermediate": 5632, "vocab": 32064},
    "text_tokens": 64,
}
TINY = {
    "vision": {"hidden": 64, "layers": 2, "heads": 2, "image": 32, "patch": 8},
    "language": {"hidden": 64, "layers": 2, "heads": 2, "intermediate": 256, "vocab": 512},
    "text_tokens": 16,
}


# ----------------------------------------------------------------------------- model and FLOPs
def llava_config(size: dict[str, Any]) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision, language = size["vision"], size["language"]
    patches = (vision["image"] // vision["patch"]) ** 2
    return LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=vision["hidden"],
            intermediate_size=4 * vision["hidden"],
            num_hidden_layers=vision["layers"],
            num_attention_heads=vision["heads"],
            image_size=vision["image"],
            patch_size=vision["patch"],
            projection_dim=vision["hidden"],
        ),
        text_config=LlamaConfig(
            vocab_size=language["vocab"],
            hidden_size=language["hidden"],
            intermediate_size=language["intermediate"],
            num_hidden_layers=language["layers"],
            num_attention_heads=language["heads"],
            num_key_value_heads=language["heads"],
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        image_token_index=language["vocab"] - 1,  # the last id; random text tokens never take it
        image_seq_length=patches,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",  # drops CLS: one image token per patch
        tie_word_embeddings=False,
    )


def sequence_lengths(size: dict[str, Any]) -> dict[str, int]:
    patches = (size["vision"]["image"] // size["vision"]["patch"]) ** 2
    # bos, one token per patch, then text (the question and answer a real sample would hold)
    return {"vision": patches + 1, "image": patches, "text": 1 + patches + size["text_tokens"]}


def parameter_counts(size: dict[str, Any]) -> dict[str, int]:
    """Parameters per component (launcher.model.components) and in all, counted on the meta device."""
    import torch
    from transformers import LlavaForConditionalGeneration

    from launcher.model.components import component_parameter_counts

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(llava_config(size))
    return {**component_parameter_counts(model), "total": sum(p.numel() for p in model.parameters())}


def flops_per_sample(size: dict[str, Any]) -> float:
    """Training FLOPs of one sample (forward + backward): launcher.model.flops, which train.py's MFU uses,
    on the model built on the meta device (every part trains, so gradients flow through every part)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    from launcher.model.flops import FlopModel, ImageRows

    with torch.device("meta"):
        flop_model = FlopModel.of(LlavaForConditionalGeneration(llava_config(size)))
    tokens = sequence_lengths(size)
    image = ImageRows(vision=tokens["vision"], projector=tokens["image"], patches=tokens["image"])
    return flop_model.step_flops([tokens["text"]], [image])


def matmul_rates(device: str, n: int) -> dict[str, Any]:
    """bf16 torch.matmul rates (TFLOP/s) of n x n products: warm-up, then synchronised timed batches."""
    import torch

    cuda = device == "cuda"
    # A GPU's clocks ramp up over the first few hundred ms of load; ~1 s of back-to-back products first
    # makes the timed batches read the sustained rate. A CPU needs no ramp: keep its check cheap.
    warm_s, batches, per_batch = (1.0, 7, 20) if cuda else (0.2, 3, 5)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)  # no allocation inside the timed loops

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    start, warm_products = time.perf_counter(), 0
    while time.perf_counter() - start < warm_s:
        for _ in range(per_batch):
            torch.matmul(a, b, out=out)
        sync()  # the clock is checked against work done, not work queued
        warm_products += per_batch
    warm_elapsed = time.perf_counter() - start
    rates = []
    for _ in range(batches):
        begin = time.perf_counter()
        for _ in range(per_batch):
            torch.matmul(a, b, out=out)
        sync()
        rates.append(2 * n**3 * per_batch / (time.perf_counter() - begin) / 1e12)
    result: dict[str, Any] = {
        "n": n,
        "device": device,
        "warm_s": warm_elapsed,
        "warm_products": warm_products,
        "batches": batches,
        "per_batch": per_batch,
        "rates_tflops": rates,
        "median_tflops": statistics.median(rates),
        "min_tflops": min(rates),
        "max_tflops": max(rates),
    }
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        result["device_name"] = properties.name
        result["device_total_bytes"] = int(properties.total_memory)
    else:
        model = next(
            (line.split(":", 1)[1].strip() for line in cpu_info_lines() if line.startswith("model name")), "CPU"
        )
        result["device_name"] = model  # the CPU count is on the device line already
    return result


def cpu_info_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


# ----------------------------------------------------------------------------- one preset (a worker)
def planned_ds_config(preset: str, micro: int, steps: int, hidden_size: int, device: str) -> dict[str, Any]:
    """The DeepSpeed dict `python train.py deepspeed=PRESET precision=bf16 ...` would hand to DeepSpeed."""
    from launcher.config.compose import compose
    from launcher.config.precision import Device
    from launcher.config.schema import typed
    from launcher.job.planning import plan_job
    from launcher.job.spec import HydraJob

    overrides = [
        f"deepspeed={preset}",
        "precision=bf16",
        f"train.micro_batch_size={micro}",
        "train.grad_accum=1",
        f"train.max_steps={steps}",
        f"model.hidden_size={hidden_size}",  # the composition derives bucket sizes from it
        "logger=none",
    ]
    # The device is given, not detected: a dry run on a machine without the GPU plans for the GPU.
    target = Device(kind=device, bf16=True, fp16=device != "cpu")
    spec = plan_job(typed(compose(overrides)), HydraJob(run_dir=ROOT, overrides=tuple(overrides)), device=target)
    return spec.ds_config


def synthetic_batch(size: dict[str, Any], config: Any, micro: int, device: Any) -> dict[str, Any]:
    import torch

    tokens = sequence_lengths(size)
    vocab, image_token = size["language"]["vocab"], config.image_token_id
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab - 1, (micro, tokens["text"]), generator=generator)
    input_ids[:, 1 : 1 + tokens["image"]] = image_token
    labels = input_ids.clone()
    labels[:, : 1 + tokens["image"]] = -100  # loss on text tokens only, as on real data
    pixels = torch.randn(micro, 3, size["vision"]["image"], size["vision"]["image"], generator=generator)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "pixel_values": pixels.to(torch.bfloat16),
    }
    return {key: value.to(device) for key, value in batch.items()}


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this worker when the sweep's process ends, however it ends: a check that
    kills the script (SIGKILL included) must not leave a worker holding the GPU. The worker runs in a
    process group of its own (so the sweep can stop it with its children), which a signal sent to the
    check's group does not reach."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the sweep ended before the request took effect
        os._exit(1)


def gib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def worker(args: argparse.Namespace) -> None:
    """Train one preset for warm-up + measured steps; write figures to args.out as JSON."""
    die_with_parent(args.parent_pid)
    from launcher.launch.ranks import free_port

    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(free_port())
    import logging

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as deepspeed_logger
    from transformers import LlavaForConditionalGeneration
    from transformers.integrations import HfDeepSpeedConfig

    from launcher.train.memory_meter import HOST_PEAK, PEAK, MemoryMeter
    from launcher.train.ops import prepare_ops

    deepspeed_logger.setLevel(logging.WARNING)
    size = TINY if args.tiny else FULL
    cuda = args.device == "cuda"
    prepare_ops()  # as a rank does: on a CPU, no 50 s build of the shared-memory comm op training never uses
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    steps = args.warmup + args.steps
    ds_config = planned_ds_config(args.worker, args.micro_batch, steps, size["language"]["hidden"], args.device)
    zero = ds_config["zero_optimization"]
    print(f"optimizer block: {json.dumps(ds_config['optimizer'])}", flush=True)
    config = llava_config(size)
    torch.manual_seed(0)
    setup_start = time.perf_counter()
    if zero["stage"] == 3:
        keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 (from_config partitions at construction)
        model = LlavaForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    else:
        with device:
            model = LlavaForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    build_s = time.perf_counter() - setup_start
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    setup_s = time.perf_counter() - setup_start
    # What DeepSpeed built from the block (a ZeRO wrapper holds it as basic_optimizer): torch's AdamW or
    # DeepSpeedCPUAdam, so a row says which update it timed.
    built = getattr(engine, "basic_optimizer", None) or engine.optimizer
    optimizer = type(built).__name__
    meter = MemoryMeter(device)
    reading = meter.read()
    print(
        f"setup {setup_s:.1f} s (model {build_s:.1f} s, deepspeed.initialize {setup_s - build_s:.1f} s); "
        f"optimizer {optimizer}; peak {gib(reading[PEAK])} GiB, host {gib(reading[HOST_PEAK])} GiB",
        flush=True,
    )
    batch = synthetic_batch(size, config, args.micro_batch, device)
    accelerator = get_accelerator()
    engine.train()
    losses = []
    for step in range(steps):
        if step == args.warmup:
            accelerator.synchronize()
            start = time.perf_counter()
        step_start = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if step == args.warmup - 1 or step == steps - 1:
            losses.append(loss.detach().item())  # a sync point; also a check that training is finite
        reading = meter.read()  # host-side counters and cudaMemGetInfo: no stream sync
        # Host time of the step (the device may still be working): a stopped worker's log shows how far it got.
        print(
            f"step {step + 1}/{steps} ({'warm-up' if step < args.warmup else 'measured'}): host "
            f"{time.perf_counter() - step_start:.2f} s, peak {gib(reading[PEAK])} GiB",
            flush=True,
        )
    accelerator.synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "preset": args.worker,
        "device": args.device,
        "zero_stage": zero["stage"],
        "offload_optimizer": zero.get("offload_optimizer", {}).get("device", "none"),
        "offload_param": zero.get("offload_param", {}).get("device", "none"),
        "micro_batch": args.micro_batch,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "step_s": elapsed / args.steps,
        "samples_per_sec": args.micro_batch * args.steps / elapsed,
        "tokens_per_sec": args.micro_batch * sequence_lengths(size)["text"] * args.steps / elapsed,
        "setup_s": setup_s,
        "model_build_s": build_s,
        "losses": losses,
        "optimizer": optimizer,
        **reading,  # MemoryMeter's keys (mem/...), the last reading: peaks over the whole process
    }
    args.out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def matmul_worker(args: argparse.Namespace) -> None:
    die_with_parent(args.parent_pid)
    args.out.write_text(json.dumps(matmul_rates(args.device, args.matmul_n)))


# ----------------------------------------------------------------------------- the sweep
class Stop(Exception):
    """A signal to the sweep: stop the running worker, record what is left, end."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Stopped(Stop):
    """A Stop that arrived while a preset ran, with that preset's row."""

    def __init__(self, signum: int, row: dict[str, Any]) -> None:
        super().__init__(signum)
        self.row = row


def raise_stop(signum: int, _frame: Any) -> None:
    raise Stop(signum)


class Clock:
    """The sweep's end: the earlier of the budget (from the script's start) and the absolute deadline."""

    def __init__(self, budget_s: float, deadline_unix: float | None) -> None:
        self.end, self.reason = STARTED + budget_s, "budget"
        if deadline_unix is not None:
            deadline = time.monotonic() + (deadline_unix - time.time())  # monotonic from here on
            if deadline < self.end:
                self.end, self.reason = deadline, "deadline"

    def left(self) -> float:
        return self.end - time.monotonic()

    @staticmethod
    def elapsed() -> float:
        return time.monotonic() - STARTED


class Report:
    """presets.md (rewritten whole, atomically) and presets.jsonl (appended), kept current as rows arrive."""

    def __init__(self, out_dir: Path, flops: float) -> None:
        self.out_dir, self.flops = out_dir, flops
        self.header: dict[str, str] = {}  # ordered: model, flops, matmul, device, settings
        self.rows: list[dict[str, Any]] = []
        self.median_tflops: float | None = None
        self.footer = ""

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with open(self.out_dir / "presets.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        self.write()

    def table(self) -> list[str]:
        lines = [
            "| preset | ZeRO | offload opt/param | samples/s | tokens/s | step s | MFU | peak reserved GiB | "
            "peak allocated GiB | device used GiB | pinned host GiB | host RSS GiB | optimizer | setup s | "
            "wall s | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in self.rows:
            wall = f"{row['wall_s']:.0f}" if row.get("wall_s") is not None else ""
            if row["status"] != "ok":
                lines.append(f"| {row['preset']} | | | | | | | | | | | | | | {wall} | {cell(row['status'])} |")
                continue
            mfu = (
                f"{row['samples_per_sec'] * self.flops / (self.median_tflops * 1e12):.1%}"
                if self.median_tflops
                else "n/a"
            )
            # mem/peak_bytes is the allocator's reserved peak on a GPU, but the RSS on a CPU (its own column)
            reserved = row.get("mem/peak_bytes") if row.get("device") == "cuda" else None
            lines.append(
                f"| {row['preset']} | {row['zero_stage']} | {row['offload_optimizer']}/{row['offload_param']} | "
                f"{row['samples_per_sec']:.2f} | {row['tokens_per_sec']:.0f} | {row['step_s']:.3f} | {mfu} | "
                f"{gib(reserved)} | {gib(row.get('mem/peak_allocated_bytes'))} | "
                f"{gib(row.get('mem/device_used_bytes'))} | {gib(row.get('mem/pinned_host_bytes'))} | "
                f"{gib(row.get('mem/host_peak_bytes'))} | {row['optimizer']} | {row['setup_s']:.1f} | {wall} | "
                f"{cell(row['status'])} |"
            )
        return lines

    def text(self) -> str:
        body = [*self.header.values(), "", *self.table()]
        return "\n".join(body + ([f"\n{self.footer}"] if self.footer else [])) + "\n"

    def write(self) -> None:
        # Replaced in one rename: a sweep killed while writing leaves the previous complete file.
        temporary = self.out_dir / ".presets.md.tmp"
        temporary.write_text(self.text())
        os.replace(temporary, self.out_dir / "presets.md")


def cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    kept = [line.rstrip()[:400] for line in text.splitlines() if line.strip()]  # a progress bar is one long line
    return kept[-lines:]


def stop_group(process: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group, then SIGKILL to whatever is left after a grace: the worker if
    it ignored SIGTERM (stuck in a CUDA call), or a compiler of an op build that outlived it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)  # a process in the driver's teardown can take a moment to go


def run_process(command: list[str], log: Path, env: dict[str, str], clock: Clock) -> int | None:
    """Run a worker until it ends (its exit code) or the sweep's end (None: stopped). A Stop passes on."""
    with open(log, "w") as handle:
        # A group of its own: stopping it reaches whatever it started (ninja and the compilers of an op build).
        process = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=max(clock.left(), 0.0))
        except subprocess.TimeoutExpired:
            stop_group(process)
            return None
        except BaseException:
            stop_group(process)
            raise


def worker_command(args: argparse.Namespace, mode: list[str], out: Path) -> list[str]:
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        *mode,
        "--out",
        str(out),
        "--parent-pid",
        str(os.getpid()),
        "--device",
        args.device,
        "--micro-batch",
        str(args.micro_batch),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--matmul-n",
        str(args.matmul_n),
        *(["--tiny"] if args.tiny else []),
    ]


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":  # as bench/_common.py: DeepSpeed's CPU ops in a directory of our own
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "outputs" / "bench" / "torch_extensions"))
    # On a GPU an inherited TORCH_EXTENSIONS_DIR (a check that built cpu_adam beforehand) is kept as it is.
    return env


def failure_reason(log: Path, returncode: int) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    if "out of memory" in text.lower():
        return f"failed (exit {returncode}): CUDA out of memory"
    lines = [line for line in text.splitlines() if line.strip()]
    reason = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "")
    return f"failed (exit {returncode}): {reason.strip()[:160]}"


def run_preset(preset: str, args: argparse.Namespace, work: Path, clock: Clock) -> dict[str, Any]:
    out, log = work / f"{preset}.json", work / f"{preset}.log"
    out.unlink(missing_ok=True)  # an --out-dir used before: only this run's figures count as a result
    began = time.monotonic()
    row: dict[str, Any] = {"preset": preset, "started_s": round(Clock.elapsed(), 1)}
    try:
        returncode = run_process(worker_command(args, ["--worker", preset], out), log, worker_env(args), clock)
    except Stop as stop:
        row.update(status=f"stopped: {stop}", wall_s=time.monotonic() - began, log_tail=log_tail(log))
        raise Stopped(stop.signum, row) from None
    row["wall_s"] = time.monotonic() - began
    if returncode is None:
        return {**row, "status": f"stopped: {clock.reason}", "log_tail": log_tail(log)}
    if out.is_file():  # figures written; a non-zero exit after that (tearing down) is noted, not fatal
        row.update(json.loads(out.read_text()), status="ok", **({"exit_code": returncode} if returncode else {}))
        return row
    return {**row, "status": failure_reason(log, returncode), "log_tail": log_tail(log)}


def estimate(rows: list[dict[str, Any]]) -> tuple[float, str] | None:
    """What the next preset is assumed to need, and why; None before any preset has run to its end."""
    finished = [row for row in rows if row.get("wall_s") is not None and not row["status"].startswith("stopped")]
    if not finished:
        return None
    slowest = max(finished, key=lambda row: row["wall_s"])
    return ESTIMATE_FACTOR * slowest["wall_s"], f"{ESTIMATE_FACTOR:g} x {slowest['preset']}'s {slowest['wall_s']:.0f} s"


def measure_matmul(args: argparse.Namespace, work: Path, clock: Clock) -> tuple[dict[str, Any] | None, str]:
    """The matmul step in a process of its own: its figures (None on failure) and why not."""
    out, log = work / "matmul.json", work / "matmul.log"
    out.unlink(missing_ok=True)
    if clock.left() <= 0:
        return None, f"not measured: the {clock.reason} had run out"
    returncode = run_process(worker_command(args, ["--matmul-worker"], out), log, worker_env(args), clock)
    if returncode is None:
        return None, f"stopped: {clock.reason}"
    if returncode != 0 or not out.is_file():
        return None, failure_reason(log, returncode)
    return json.loads(out.read_text()), ""


def device_line(args: argparse.Namespace, matmul: dict[str, Any] | None) -> str:
    from importlib.metadata import version

    import torch

    if matmul is None:
        name = f"{args.device} (not identified: the matmul step did not finish)"
    else:
        name = matmul["device_name"]
        if matmul.get("device_total_bytes"):
            name += f", {matmul['device_total_bytes'] / 2**30:.0f} GiB"
    cuda = f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"device: {name}; torch {torch.__version__}{cuda}, deepspeed {version('deepspeed')}, transformers "
        f"{version('transformers')}; host {os.cpu_count()} CPUs, {ram:.0f} GiB RAM"
    )


def matmul_line(matmul: dict[str, Any] | None, why: str) -> str:
    if matmul is None:
        return f"matmul rate: {why}; MFU n/a"
    return (
        f"matmul rate (bf16 {matmul['n']} x {matmul['n']}, {matmul['device']}): median "
        f"{matmul['median_tflops']:.4g} TFLOP/s (min {matmul['min_tflops']:.4g}, max {matmul['max_tflops']:.4g}) "
        f"over {matmul['batches']} batches of {matmul['per_batch']} products, after {matmul['warm_s']:.1f} s of "
        f"warm-up ({matmul['warm_products']} products); MFU uses the median"
    )


def settings_line(args: argparse.Namespace, clock: Clock, out_dir: Path) -> str:
    end = f"budget {args.budget_s:g} s from the start"
    if args.deadline_unix is not None:
        deadline = datetime.fromtimestamp(args.deadline_unix).isoformat(timespec="seconds")
        end += f", deadline {deadline}"
    extensions = worker_env(args).get("TORCH_EXTENSIONS_DIR", "torch's default (~/.cache/torch_extensions)")
    return (
        f"settings: micro batch {args.micro_batch}, {args.warmup} warm-up + {args.steps} measured steps, bf16; "
        f"presets {' '.join(args.presets)}; {end}: ends at {clock.end - STARTED:.0f} s ({clock.reason}); "
        f"TORCH_EXTENSIONS_DIR {extensions}; files in {out_dir}"
    )


def sweep(args: argparse.Namespace, report: Report, work: Path, clock: Clock) -> None:
    matmul, why = measure_matmul(args, work, clock)
    report.median_tflops = matmul["median_tflops"] if matmul else None
    report.header["matmul"] = matmul_line(matmul, why)
    report.header["device"] = device_line(args, matmul)
    report.write()
    print(f"{report.header['matmul']}\n{report.header['device']}\n", flush=True)
    for preset in args.presets:
        left, guess = clock.left(), estimate(report.rows)
        if left <= 0:
            row = {"preset": preset, "status": f"skipped: the {clock.reason} had run out"}
        elif guess is not None and guess[0] > left:
            need, basis = guess
            row = {"preset": preset, "status": f"skipped: needs ~{need:.0f} s ({basis}), {left:.0f} s left"}
        else:
            row = run_preset(preset, args, work, clock)
        report.add(row)
        print(f"  {preset}: {row['status']} at {Clock.elapsed():.0f} s", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", choices=PRESETS, default=PRESETS)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the code path on a CPU)")
    parser.add_argument("--micro-batch", type=int, help="samples per step (default: 16, or 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the clock starts")
    parser.add_argument("--steps", type=int, help="measured steps per preset (default: 5, or 2 with --tiny)")
    parser.add_argument("--matmul-n", type=int, help="matrix side for the matmul rate (default: 8192, 256 on a CPU)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall time for the whole sweep, from the start")
    parser.add_argument(
        "--deadline-unix", type=float, help="absolute time (time.time()) after which nothing starts and work is stopped"
    )
    parser.add_argument("--out-dir", type=Path, help="default: outputs/bench/gpu_presets/<YYYYmmdd-HHMMSS>")
    parser.add_argument("--dry-run", action="store_true", help="print sizes, FLOPs and the DeepSpeed dicts only")
    parser.add_argument("--worker", choices=PRESETS, help=argparse.SUPPRESS)
    parser.add_argument("--matmul-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.micro_batch = args.micro_batch or (2 if args.tiny else 16)
    args.steps = args.steps or (2 if args.tiny else 5)
    args.matmul_n = args.matmul_n or (8192 if args.device == "cuda" else 256)
    if args.warmup < 0 or args.steps < 1 or args.micro_batch < 1 or args.matmul_n < 1:
        parser.error("--warmup must be >= 0; --steps, --micro-batch and --matmul-n >= 1")
    if args.worker:
        worker(args)
        return
    if args.matmul_worker:
        matmul_worker(args)
        return
    if args.device == "cuda" and not args.dry_run:
        import torch

        if not torch.cuda.is_available():  # asks the driver; creates no CUDA context in this process
            print(
                "error: no CUDA device (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}): this benchmark needs a GPU. Check the code path on a CPU with "
                "`python bench/gpu_presets.py --device cpu --tiny`, or print the plan with --dry-run",
                file=sys.stderr,
            )
            sys.exit(2)

    size = TINY if args.tiny else FULL
    counts = parameter_counts(size)
    flops = flops_per_sample(size)
    tokens = sequence_lengths(size)
    model_line = (
        f"model: LLaVA, vision {counts['vision']:,} + projector {counts['projector']:,} + language "
        f"{counts['language']:,} = {counts['total']:,} parameters ({counts['total'] / 1e9:.3g} B); sequence "
        f"{tokens['text']} tokens ({tokens['image']} image), micro batch {args.micro_batch}, bf16"
    )
    flops_line = (
        f"model FLOPs per training sample: {flops:.4g} ({flops / tokens['text']:.4g} per token; 6 x all "
        f"parameters would give {6 * counts['total']:.4g})"
    )
    print(f"{model_line}\n{flops_line}", flush=True)
    if args.dry_run:
        for preset in args.presets:
            ds = planned_ds_config(
                preset, args.micro_batch, args.warmup + args.steps, size["language"]["hidden"], args.device
            )
            print(f"\n{preset}: {json.dumps(ds['zero_optimization'])}\n  optimizer: {json.dumps(ds['optimizer'])}")
        return

    clock = Clock(args.budget_s, args.deadline_unix)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = (args.out_dir or ROOT / "outputs" / "bench" / "gpu_presets" / stamp).resolve()
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    (out_dir / "presets.jsonl").write_text("")  # this sweep's rows only, also in a directory used before
    report = Report(out_dir, flops)
    report.header = {
        "model": model_line,
        "flops": flops_line,
        "matmul": "matmul rate: not measured yet",
        "device": f"device: {args.device} (identified by the matmul step)",
        "settings": settings_line(args, clock, out_dir),
    }
    report.write()
    print(f"{report.header['settings']}", flush=True)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, raise_stop)
    exit_code = 0
    try:
        sweep(args, report, work, clock)
    except Stop as stop:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # the rows below are written whatever comes next
        name, exit_code = str(stop), 128 + stop.signum  # as a shell reports a death by signal
        if isinstance(stop, Stopped):
            report.add(stop.row)
        if report.header["matmul"].endswith("not measured yet"):
            report.header["matmul"] = f"matmul rate: stopped by {name}; MFU n/a"
        for preset in args.presets[len(report.rows) :]:
            report.add({"preset": preset, "status": f"not run: the sweep got {name}"})
        print(f"sweep stopped by {name}", file=sys.stderr, flush=True)
    median = f"{report.median_tflops:.4g} TFLOP/s" if report.median_tflops else "n/a"
    report.footer = f"wall {Clock.elapsed():.0f} s; MFU against the measured median matmul rate ({median})"
    report.write()
    print(f"\n{report.text()}", end="", flush=True)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
