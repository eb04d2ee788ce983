"""The training path of one rank, top to bottom: set up, train, evaluate, save, clean up.

Every rank runs `train(cfg, run_dir)`. The DeepSpeed dict is read from `run_dir/ds_config.json`, the
exact dict the launcher composed and validated. Rank 0 alone writes metrics, the summary, the
final model and W&B records.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import resource
import shutil
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from launcher import checkpoint
from launcher.errors import ERRORS_DIR, LauncherError, TrainingFailed, one_line, record_rank_error
from launcher.rundir import (
    DS_CONFIG_FILE,
    JOB_FILE,
    SUMMARY_FILE,
    append_metrics,
    read_json,
    summary_skeleton,
    write_json_atomic,
)

log = logging.getLogger("launcher")

# Test hook: "RANK:STEP" makes that rank raise at that step (to test how a crashed rank is reported).
FAULT_ENV = "LAUNCHER_TEST_FAULT"

# Where a sweep's objective comes from in summary.json.
OBJECTIVES = {
    "eval/loss": "eval_loss",
    "eval/accuracy": "eval_accuracy",
    "train/loss": "final_loss",
    "perf/samples_per_sec": "samples_per_sec",
    "perf/tokens_per_sec": "tokens_per_sec",
}


# ----------------------------------------------------------------------------- distributed helpers
def _quiet_libraries() -> None:
    """DeepSpeed logs every config key at INFO and torch warns about its own deprecations per call."""
    import warnings

    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*")


def _init_distributed(cfg: DictConfig) -> tuple[int, int, int, torch.device]:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _quiet_libraries()
    accelerator = get_accelerator()
    backend = cfg.dist.backend
    if backend == "auto":
        backend = "nccl" if accelerator.device_name() == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=int(cfg.dist.timeout_s)))
    rank = torch.distributed.get_rank()
    world_size = torch.distributed.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    return rank, world_size, local_rank, device


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def _barrier() -> None:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on a GPU; the process's peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# ----------------------------------------------------------------------------- data and model
def prepare_data(cfg: DictConfig, cache: Path) -> tuple[Path, Path | None, Path | None]:
    """The train file, eval file and image root; the built-in data set is generated first."""
    from launcher.data import generate_shapes

    data = cfg.data
    if data.synthetic:
        out = cache / "data" / f"{data.name}_seed{data.seed}_n{data.n_train}_{data.n_eval}_px{data.image_size}"
        train_file, eval_file, image_root = generate_shapes(
            out, seed=data.seed, n_train=data.n_train, n_eval=data.n_eval, image_size=data.image_size
        )
        return Path(train_file), Path(eval_file), Path(image_root)
    if not data.path:
        raise LauncherError(f"data.path is not set for data={data.name}: give the training JSON file")
    train_file = Path(data.path).expanduser()
    if not train_file.is_file():
        raise LauncherError(f"data.path={data.path}: no such file")
    eval_file = Path(data.eval_path).expanduser() if data.eval_path else None
    if eval_file is not None and not eval_file.is_file():
        raise LauncherError(f"data.eval_path={data.eval_path}: no such file")
    image_root = Path(data.image_root).expanduser() if data.image_root else train_file.parent
    if not image_root.is_dir():
        raise LauncherError(f"data.image_root={image_root}: no such directory")
    return train_file, eval_file, image_root


def resolve_model_path(cfg: DictConfig, cache: Path, records: list[dict[str, Any]]) -> str:
    """A hub id or directory to load; a tiny model is built (once, then cached) from the data's words."""
    from launcher.models import build_tiny_model_dir

    model = cfg.model
    if model.source == "pretrained":
        return str(model.path)
    texts = sorted({turn["value"] for record in records for turn in record["conversations"]})
    dims = {
        "hidden_size": model.hidden_size,
        "num_layers": model.num_layers,
        "vision_hidden_size": model.vision_hidden_size,
        "vision_layers": model.vision_layers,
        "image_size": model.image_size,
        "patch_size": model.patch_size,
    }
    key = hashlib.sha256(json.dumps([model.arch, cfg.train.seed, dims, texts]).encode()).hexdigest()[:12]
    out = cache / "models" / f"{model.arch}-{key}"
    return str(build_tiny_model_dir(model.arch, out, texts, seed=cfg.train.seed, **dims))


def _to_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Move tensors to the device; floating inputs (pixels) take the engine's training dtype."""
    moved = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device, non_blocking=True)
            if value.is_floating_point():
                value = value.to(dtype)
        moved[key] = value
    return moved


# ----------------------------------------------------------------------------- evaluation
@torch.no_grad()
def _evaluate(
    engine: Any, cfg: DictConfig, eval_loader: Any, eval_set: Any, processor: Any, device: torch.device
) -> dict[str, float]:
    from launcher.data import exact_match_accuracy

    if eval_loader is None:  # no held-out data given
        return {}
    engine.eval()
    dtype = _engine_dtype(engine)
    loss_sum, count = 0.0, 0.0
    for batch in eval_loader:
        outputs = engine(**_to_device(batch, device, dtype))
        loss_sum += float(outputs.loss) * batch["input_ids"].shape[0]
        count += batch["input_ids"].shape[0]
    total_loss, total_count = _all_reduce_sum([loss_sum, count], device)
    metrics = {"eval/loss": total_loss / max(total_count, 1.0)}
    if cfg.data.eval_accuracy and eval_set is not None:
        stage3 = engine.zero_optimization_stage() == 3
        correct, total = exact_match_accuracy(
            engine.module,
            processor,
            eval_set,
            max_new_tokens=cfg.data.max_new_tokens,
            synced_gpus=stage3 and torch.distributed.get_world_size() > 1,
        )
        correct, total = _all_reduce_sum([correct, total], device)
        metrics["eval/accuracy"] = correct / max(total, 1.0)
    engine.train()
    return metrics


def _engine_dtype(engine: Any) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


# ----------------------------------------------------------------------------- reporting
class _Progress:
    """A progress bar on a terminal; plain periodic log lines otherwise (CI, SLURM logs)."""

    def __init__(self, enabled: bool, total: int, log_every: int) -> None:
        self.log_every = log_every
        self.total = total
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        text = f"loss {metrics['train/loss']:.4f} | {metrics['perf/samples_per_sec']:.1f} samples/s"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(text)
        elif step % self.log_every == 0 or step == 1:
            log.info("step %d/%d | %s | lr %.2e", step, self.total, text, metrics["train/lr"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _setup_rank0_log(run_dir: Path) -> None:
    """train.log and the console for rank 0 (Hydra sets this up in-process; torchrun ranks do not)."""
    root = logging.getLogger()
    if not any(isinstance(h, logging.FileHandler) for h in root.handlers):
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
        console = logging.StreamHandler()
        console.setFormatter(logging.Formatter("[%(asctime)s][%(levelname)s] %(message)s"))
        root.addHandler(console)
    root.setLevel(logging.INFO)


def _print_final_table(summary: dict[str, Any], run_dir: Path) -> None:
    rows = [
        ("status", summary["status"]),
        ("steps", summary["steps"]),
        ("final loss", summary["final_loss"]),
        ("eval loss", summary["eval_loss"]),
        ("eval accuracy", summary["eval_accuracy"]),
        ("samples/s", summary["samples_per_sec"]),
        ("peak memory", f"{(summary['peak_memory_bytes'] or 0) / 2**20:.0f} MiB"),
        ("wall time", f"{summary['wall_s']:.1f} s"),
        ("run dir", str(run_dir)),
        ("model", str(run_dir / "model")),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {round(v, 4) if isinstance(v, float) else v}" for name, v in rows]
    print("\n".join(["", "run summary", *lines]), flush=True)


# ----------------------------------------------------------------------------- the run
def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train one rank of the job planned in `run_dir`; returns the summary (rank 0's is written)."""
    started = time.time()
    job = read_json(run_dir / JOB_FILE)
    summary = summary_skeleton(job)
    rank = 0
    state: dict[str, Any] = {"logger": None}  # what the except branch must close if _train fails
    try:
        rank, world_size, _, device = _init_distributed(cfg)
        if world_size != job["world_size"]:
            raise LauncherError(
                f"{world_size} ranks started, but the job was planned for world size {job['world_size']} "
                f"(dist.nnodes={cfg.dist.nnodes} x dist.nproc_per_node={cfg.dist.nproc_per_node}): make them agree"
            )
        is_main = rank == 0
        if is_main:
            _setup_rank0_log(run_dir)
            write_json_atomic(run_dir / SUMMARY_FILE, summary)
        return _train(cfg, run_dir, job, summary, state, rank, world_size, device, started)
    except BaseException as err:
        status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
        message = one_line(err)
        if not isinstance(err, LauncherError):
            message = f"{type(err).__name__}: {message}"
        summary.update({"status": status, "error": message, "wall_s": round(time.time() - started, 3)})
        exit_code = err.exit_code if isinstance(err, LauncherError) else 1
        trace_file = run_dir / ERRORS_DIR / f"rank{rank}.txt"
        # Best effort: on a full disk these writes fail too, and must not hide the error itself.
        with contextlib.suppress(OSError):
            trace_file = record_rank_error(run_dir, rank, message, exit_code, traceback.format_exc())
        if rank == 0:
            with contextlib.suppress(OSError):
                write_json_atomic(run_dir / SUMMARY_FILE, summary)
            if state["logger"] is not None:
                state["logger"].finish(summary, exit_code=1)
        if isinstance(err, LauncherError | KeyboardInterrupt):
            raise
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            log.exception("training failed on rank %d", rank)
        raise TrainingFailed(f"rank {rank}: {message} (traceback: {trace_file})") from err
    finally:
        # Without this, rank 0 aborts at exit ("terminate called without an active exception").
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _train(
    cfg: DictConfig,
    run_dir: Path,
    job: dict[str, Any],
    summary: dict[str, Any],
    state: dict[str, Any],
    rank: int,
    world_size: int,
    device: torch.device,
    started: float,
) -> dict[str, Any]:
    import deepspeed
    from torch.utils.data import DataLoader, DistributedSampler

    from launcher.data import Collator, ConversationDataset, load_records
    from launcher.models import apply_freeze, load_model_and_processor

    is_main = rank == 0
    ds_config = read_json(run_dir / DS_CONFIG_FILE)
    _seed_everything(cfg.train.seed)
    cache = Path(cfg.cache_dir).expanduser().absolute()

    # Data and model files: rank 0 generates/builds what is missing, the others wait and then read.
    if is_main:
        train_file, eval_file, image_root = prepare_data(cfg, cache)
    _barrier()
    train_file, eval_file, image_root = prepare_data(cfg, cache)
    records, skipped = load_records(train_file, image_root, on_bad_record=cfg.data.on_bad_record)
    eval_records: list[dict[str, Any]] = []
    if eval_file is not None:
        eval_records, eval_skipped = load_records(eval_file, image_root, on_bad_record=cfg.data.on_bad_record)
        skipped += eval_skipped
    if is_main:
        log.info("data: %d train, %d eval records (%d bad records skipped)", len(records), len(eval_records), skipped)
        model_path = resolve_model_path(cfg, cache, records + eval_records)
    _barrier()
    model_path = resolve_model_path(cfg, cache, records + eval_records)

    # At ZeRO-3 transformers must know the DeepSpeed config before the model is built, so that
    # from_pretrained partitions the weights at construction instead of materialising them per rank.
    hf_ds_config = None
    if ds_config["zero_optimization"]["stage"] == 3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 (kept alive on purpose)
    model, processor = load_model_and_processor(model_path)
    # True when ZeRO-3 partitioned the weights while loading (zero.Init tags each parameter).
    summary["partitioned_at_load"] = any(hasattr(p, "ds_id") for p in model.parameters())
    model.config.use_cache = False
    counts = apply_freeze(
        model,
        vision=cfg.model.freeze_vision,
        projector=cfg.model.freeze_projector,
        language=cfg.model.freeze_language,
    )
    if is_main:
        log.info("model %s: %s", model_path, counts)

    micro = ds_config["train_micro_batch_size_per_gpu"]
    accum = ds_config["gradient_accumulation_steps"]
    collator = Collator(processor)
    train_set = ConversationDataset(records)
    sampler = checkpoint.ResumableSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.train.seed
    )
    if len(train_set) < micro * world_size:
        raise LauncherError(
            f"data.path={train_file}: {len(train_set)} records, fewer than one global micro-batch "
            f"({micro} x {world_size} ranks)"
        )
    workers = int(cfg.data.num_workers)
    loader_args = {"num_workers": workers, "persistent_workers": workers > 0, "collate_fn": collator}
    train_loader = DataLoader(train_set, batch_size=micro, sampler=sampler, drop_last=True, **loader_args)
    eval_set = ConversationDataset(eval_records) if eval_records else None
    eval_loader = None
    if eval_set is not None:
        eval_sampler = DistributedSampler(eval_set, num_replicas=world_size, rank=rank, shuffle=False)
        eval_loader = DataLoader(eval_set, batch_size=micro, sampler=eval_sampler, **loader_args)
    accuracy_set = None
    if eval_set is not None and cfg.data.eval_accuracy:
        # The same number of samples per rank: under ZeRO-3 the ranks' generate calls run in lock-step.
        usable = min(int(cfg.data.eval_samples), len(eval_records)) // world_size * world_size
        accuracy_set = ConversationDataset(eval_records[:usable][rank::world_size])

    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
    dtype = _engine_dtype(engine)
    summary.update(
        {
            "zero_stage": engine.zero_optimization_stage(),
            "world_size": world_size,
            "params_total": counts["total"],
            "params_trainable": counts["trainable"],
            "params_held_per_rank": _params_held_per_rank(engine, device),
        }
    )
    summary["precision"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")

    # Resume: weights, optimizer, scheduler and loss scaler from DeepSpeed's files; data position and
    # random-number state from this rank's own file. metrics.jsonl forgets the steps after the checkpoint.
    start_step, position, resumed_rng = 0, checkpoint.DataPosition(), None
    if job.get("resume_tag"):
        start_step, position, resumed_rng = checkpoint.load(engine, run_dir, job["resume_tag"])
        summary["resumed_from_step"] = start_step
        if is_main:
            checkpoint.truncate_metrics(run_dir, start_step)
            log.info("resumed from %s at step %d", run_dir / checkpoint.CHECKPOINT_DIR / job["resume_tag"], start_step)
    checkpoint_meta = {
        "world_size": world_size,
        "zero_stage": summary["zero_stage"],
        "precision": summary["precision"],
        "model": job.get("model"),
    }
    keep = int(cfg.train.keep_checkpoints)
    stop = checkpoint.StopRequest(run_dir)
    logger_run = state["logger"] = _start_logger(cfg, run_dir, job, ds_config, summary) if is_main else None

    max_steps = int(cfg.train.max_steps)
    eval_every = int(cfg.train.eval_every)
    warmup_skip = min(5, max_steps // 5)  # steps left out of throughput: allocator and JIT warm-up
    progress = _Progress(is_main, max_steps, int(cfg.train.log_every))
    batches = checkpoint.batches(train_loader, sampler, position, micro)
    if resumed_rng is not None:
        checkpoint.set_rng_state(resumed_rng)
    fault = tuple(int(part) for part in os.environ[FAULT_ENV].split(":")) if os.environ.get(FAULT_ENV) else None
    max_nonfinite, nonfinite_in_a_row = int(cfg.train.max_nonfinite_steps), 0
    stopped_at = None
    measured_time = measured_samples = measured_tokens = 0.0
    last_loss = math.nan
    eval_metrics: dict[str, float] = {}
    engine.train()
    for step in range(start_step + 1, max_steps + 1):
        step_start = time.perf_counter()
        wait = 0.0
        loss_sum = tokens = 0.0
        grad_norm = math.nan
        for _ in range(accum):
            fetch_start = time.perf_counter()
            batch = next(batches)
            wait += time.perf_counter() - fetch_start
            tokens += float(batch["attention_mask"].sum())
            loss = engine(**_to_device(batch, device, dtype)).loss
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                grad_norm = _unpartitioned_grad_norm(engine)
            engine.step()
            loss_sum += float(loss.detach())
        if fault == (rank, step):
            raise RuntimeError(f"fault injected by {FAULT_ENV} on rank {rank} at step {step}")
        loss_sum, tokens = _all_reduce_sum([loss_sum, tokens], device)
        step_loss = loss_sum / (accum * world_size)
        nonfinite_in_a_row = 0 if math.isfinite(step_loss) else nonfinite_in_a_row + 1
        if nonfinite_action(step_loss, dtype == torch.float16, nonfinite_in_a_row, max_nonfinite) == "stop":
            saved = checkpoint.find_resume_tag(run_dir / checkpoint.CHECKPOINT_DIR)
            raise TrainingFailed(
                f"loss is {step_loss} at step {step}: lower train.lr, use precision=bf16 instead of fp16, "
                "or check the data"
                + (f"; checkpoint {saved}, saved before it, resumes with resume={run_dir}" if saved else "")
            )
        step_time = time.perf_counter() - step_start
        samples = micro * accum * world_size
        if step > warmup_skip:
            measured_time += step_time
            measured_samples += samples
            measured_tokens += tokens
        last_loss = step_loss
        metrics = {
            "train/loss": step_loss,
            "train/lr": float(scheduler.get_last_lr()[0]) if scheduler else float(engine.get_lr()[0]),
            "train/grad_norm": _grad_norm(engine, grad_norm),
            "perf/samples_per_sec": samples / step_time,
            "perf/tokens_per_sec": tokens / step_time,
            "perf/step_time_s": step_time,
            "perf/data_wait_frac": wait / step_time,
            "mem/peak_bytes": _peak_memory_bytes(device),
        }
        if dtype == torch.float16:
            metrics["train/loss_scale"] = float(getattr(engine.optimizer, "cur_scale", math.nan))
        if (eval_every and step % eval_every == 0) or step == max_steps:
            eval_metrics = _evaluate(engine, cfg, eval_loader, accuracy_set, processor, device)
            metrics.update(eval_metrics)
            if is_main and eval_metrics:
                log.info("step %d eval: %s", step, {k: round(v, 4) for k, v in eval_metrics.items()})
        if is_main:
            append_metrics(run_dir, {"step": step, **metrics})
            if logger_run is not None:
                logger_run.log(metrics, step=step)
        progress.update(step, metrics)
        if stop.agreed(device) and step < max_steps:
            stopped_at = step
            break
        if cfg.train.save_every and step % cfg.train.save_every == 0 and step < max_steps:
            checkpoint.save(engine, run_dir, step, position, checkpoint_meta, keep=keep)
    progress.close()

    steps_done = stopped_at or max_steps
    if steps_done > start_step:  # a resume of a finished run has nothing new to save
        checkpoint.save(engine, run_dir, steps_done, position, checkpoint_meta, keep=keep)
    if stopped_at is None:
        _save_model(engine, processor, run_dir / "model", is_main)
    elif is_main:
        log.info("stopped after step %d on %s; resume with resume=%s", steps_done, stop.reason(), run_dir)
    summary.update(
        {
            "status": "completed" if stopped_at is None else "preempted",
            "steps": steps_done,
            "wall_s": round(time.time() - started, 3),
            "final_loss": last_loss,
            "eval_loss": eval_metrics.get("eval/loss"),
            "eval_accuracy": eval_metrics.get("eval/accuracy"),
            "samples_per_sec": measured_samples / measured_time if measured_time else None,
            "tokens_per_sec": measured_tokens / measured_time if measured_time else None,
            "peak_memory_bytes": _peak_memory_bytes(device),
            "records_skipped": skipped,
        }
    )
    summary["objective"] = summary.get(OBJECTIVES.get(cfg.objective, ""))
    if is_main:
        write_json_atomic(run_dir / SUMMARY_FILE, summary)
        if logger_run is not None:
            logger_run.finish(summary, exit_code=0)
        _print_final_table(summary, run_dir)
    return summary


def nonfinite_action(loss: float, fp16: bool, in_a_row: int, allowed: int) -> str:
    """What a step's loss means for the run: "ok", "skip" (fp16, whose loss scaler skipped the update), "stop".

    fp32 and bf16 have no loss scaler: a non-finite loss means the update was applied and the weights
    are spoiled, so the run stops at once (naming the step) and the last checkpoint stays the good one."""
    if math.isfinite(loss):
        return "ok"
    return "skip" if fp16 and in_a_row <= allowed else "stop"


def _unpartitioned_grad_norm(engine: Any) -> float:
    """Gradient norm at ZeRO stage 0 in fp32, where DeepSpeed clips but does not keep the norm.

    Gradients are already all-reduced at the accumulation boundary, so the local norm is global.
    One fused per-tensor norm call: a Python loop over the parameters cost ~1% of a tiny model's step."""
    if engine.zero_optimization_stage() != 0 or _engine_dtype(engine) != torch.float32:
        return math.nan
    grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return math.nan
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64))


def _grad_norm(engine: Any, fallback: float) -> float:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return fallback
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)


def _params_held_per_rank(engine: Any, device: torch.device) -> list[int]:
    """Parameter elements each rank holds: its ZeRO-3 partition, or everything below stage 3."""
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
    counts = torch.zeros(torch.distributed.get_world_size(), dtype=torch.int64, device=device)
    counts[torch.distributed.get_rank()] = held
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(counts)
    return [int(c) for c in counts.tolist()]


def _save_model(engine: Any, processor: Any, out: Path, is_main: bool) -> None:
    """The final model and processor in Hugging Face format, loadable by plain transformers.

    At ZeRO-3 the partitioned weights are gathered first (every rank takes part)."""
    state_dict = None
    if engine.zero_optimization_stage() == 3:
        state_dict = engine._zero3_consolidated_16bit_state_dict()
    if is_main:
        # Written next to it and renamed: a failed export (disk full) leaves no model/ that looks complete.
        partial = out.with_name(f".{out.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            with checkpoint.write_failures_reported(out, what="the final model"):
                engine.module.save_pretrained(partial, state_dict=state_dict)
                processor.save_pretrained(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(out, ignore_errors=True)  # a resumed run that had finished before
        os.replace(partial, out)
    _barrier()


def _start_logger(
    cfg: DictConfig, run_dir: Path, job: dict[str, Any], ds_config: dict[str, Any], summary: dict[str, Any]
) -> Any:
    """The W&B run of rank 0 (None when logger=none or W&B is disabled)."""
    if not cfg.logger.enabled:
        return None
    from launcher import wandb_logger

    return wandb_logger.start_for_job(
        cfg=OmegaConf.to_container(cfg, resolve=True),
        run_dir=run_dir,
        job=job,
        ds_config=ds_config,
        summary=summary,
        # A resume continues the W&B run whose id the first start stored in the run directory.
        resume_id=wandb_logger.read_run_id(run_dir) if job.get("resume_tag") else None,
    )
