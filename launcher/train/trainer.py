"""The training recipe of one rank, top to bottom: setup, train_step, evaluate, save, finish.

Every rank runs `train(cfg, run_dir)`. The job spec is read from `run_dir/job.json` and the DeepSpeed
dict from `run_dir/ds_config.json`, the exact dict the launcher composed and validated. Rank 0 alone
writes metrics, the summary, the final model and W&B records.

    train ─ init_distributed ─ setup (data, model, engine, resume, logger)
          └ for each step: train_step → evaluate (when due) → record → stop? → save (when due)
          └ finish (final checkpoint, model/, summary)

A new way to train (LoRA, gradient checkpointing) changes `setup_model` and nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from launcher.config.schema import OBJECTIVES
from launcher.core import credentials, logs
from launcher.core.errors import LauncherError, TrainingFailed, one_line, record_rank_error, step_failure
from launcher.core.rundir import MetricsWriter, RunDir, Summary, read_json
from launcher.job.reshard import Reshard, resumed_batches
from launcher.job.spec import CUDA_MEMORY_CAP_ENV, plain
from launcher.tracking.wandb_run import HistoryWindow
from launcher.train import checkpoint, ops
from launcher.train import memory_meter as device_memory
from launcher.train.memory_meter import MemoryMeter
from launcher.train.watchdog import StepWatchdog

log = logging.getLogger("launcher")

# Test hook: "RANK:STEP" makes that rank raise at that step (to test how a crashed rank is reported);
# "RANK:STEP:hang" makes it stop answering the others there (to test the step watchdog);
# "RANK:STEP:abort" makes it die by SIGABRT there, recording nothing (as gloo and NCCL end a process);
# "RANK:STEP:alloc=MIB" makes it hold MIB MiB more from there on (to test a memory budget).
FAULT_ENV = "LAUNCHER_TEST_FAULT"


# ----------------------------------------------------------------------------- the rank
@dataclass
class Rank:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: DictConfig) -> Rank:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from launcher.train.ops import prepare_ops

    _quiet_libraries()
    prepare_ops()
    accelerator = get_accelerator()
    backend = str(cfg.dist.backend)
    if backend == "auto":
        backend = "nccl" if accelerator.device_name() == "cuda" else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=int(cfg.dist.timeout_s)))
    device = torch.device("cpu")
    if accelerator.device_name() == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        cap_gb = os.environ.get(CUDA_MEMORY_CAP_ENV)
        if cap_gb:  # the autotuner's budget on a GPU: the allocator refuses past it (a real CUDA OOM)
            total = torch.cuda.get_device_properties(local_rank).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap_gb) * 2**30 / total), local_rank)
    return Rank(torch.distributed.get_rank(), torch.distributed.get_world_size(), device)


def _quiet_libraries() -> None:
    """DeepSpeed logs every config key at INFO and torch warns about its own deprecations per call."""
    import warnings

    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*")


def _all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if torch.distributed.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor)
    return tensor.tolist()


def _barrier() -> None:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


# ----------------------------------------------------------------------------- what setup builds
@dataclass
class Data:
    """The data streams of one rank."""

    batches: Iterator[dict[str, Any]]  # training micro-batches, forever, from the resume position on
    position: checkpoint.DataPosition  # what `batches` has handed out (saved in checkpoints)
    eval_loader: Any | None
    accuracy_set: Any | None  # this rank's share of the exact-match samples
    records_skipped: int
    sampler: Any = None
    source_names: list[str] = field(default_factory=list)  # of a mixture (data.sources); empty otherwise
    cache: dict[str, Any] = field(default_factory=dict)  # what the data cache did (summary.extra["data_cache"])
    records_truncated: int = 0  # cut to data.max_length
    records_too_long: int = 0  # over data.max_length, skipped

    def source_counts(self, global_draws: int) -> dict[str, int]:
        """Training samples drawn from each source of a mixture so far (all ranks)."""
        if not self.source_names:
            return {}
        return dict(zip(self.source_names, self.sampler.source_counts(global_draws), strict=True))

    def mixture_position(self, global_draws: int) -> dict[str, dict[str, int]]:
        """What a checkpoint records of a mixture: samples drawn from, and records in, each source."""
        sizes = dict(zip(self.source_names, (int(n) for n in self.sampler.sizes), strict=True))
        return {"drawn": self.source_counts(global_draws), "records": sizes}


@dataclass
class Throughput:
    """Samples and tokens per second over the measured steps (the first few warm up allocators and JIT)."""

    skip_steps: int
    seconds: float = 0.0
    samples: float = 0.0
    tokens: float = 0.0

    def add(self, step: int, seconds: float, samples: float, tokens: float) -> None:
        if step > self.skip_steps:
            self.seconds += seconds
            self.samples += samples
            self.tokens += tokens

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
class Session:
    """Everything `setup` builds and the steps use."""

    cfg: DictConfig
    run_dir: RunDir
    job: dict[str, Any]
    rank: Rank
    summary: Summary
    engine: Any = None
    scheduler: Any = None
    dtype: torch.dtype = torch.float32
    processor: Any = None
    data: Data | None = None
    logger: Any = None  # the W&B run of rank 0
    stop: checkpoint.StopRequest | None = None
    progress: Any = None
    start_step: int = 0
    checkpoint_meta: dict[str, Any] = field(default_factory=dict)
    throughput: Throughput = field(default_factory=lambda: Throughput(0))
    last_loss: float = math.nan
    metrics_file: MetricsWriter | None = None  # rank 0's metrics.jsonl, open for the run
    history: HistoryWindow | None = None  # which steps W&B's history gets (rank 0, when logging)
    grad_norm: GradNormSource | None = None
    memory: MemoryMeter | None = None
    stop_agreed: bool = False  # some rank was asked to stop: all stop after this step
    in_step: int | None = None  # the training step running now (named in a failure's line)
    reshard: Reshard | None = None  # a resume on another world size or ZeRO stage (job.json's "reshard")
    nonfinite_in_a_row: int = 0
    eval_metrics: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    @property
    def micro(self) -> int:
        return int(self.engine.train_micro_batch_size_per_gpu())

    @property
    def accum(self) -> int:
        return int(self.engine.gradient_accumulation_steps())


# ----------------------------------------------------------------------------- the run
def train(cfg: DictConfig, run_dir: Path) -> Summary:
    """Train one rank of the job planned in `run_dir`; returns the summary (rank 0's is written)."""
    directory = RunDir(Path(run_dir))
    if cfg_secrets := credentials.from_environment():  # the files hold "<redacted>" for credentials
        cfg = OmegaConf.create(credentials.restore(OmegaConf.to_container(cfg, resolve=True), cfg_secrets))
    session: Session | None = None
    watchdog: StepWatchdog | None = None
    job = read_json(directory.job)
    if cfg.train.max_steps is None:  # given in epochs: the launcher counted the data (job.json)
        cfg.train.max_steps = int(job["max_steps"])
    summary = Summary.for_job(job)
    rank = 0
    try:
        # Before deepspeed is imported (it logs from its import on); RANK is set by every launcher.
        logs.setup_rank_log(directory.train_log, int(os.environ.get("RANK", "0")))
        place = init_distributed(cfg)
        rank = place.rank
        if place.world_size != job["world_size"]:
            raise LauncherError(
                f"{place.world_size} ranks started, but the job was planned for world size {job['world_size']} "
                f"(dist.nnodes={cfg.dist.nnodes} x dist.nproc_per_node={cfg.dist.nproc_per_node}): make them agree"
            )
        if place.is_main and not job.get("resume_tag"):  # a resume writes its summary once its checkpoint loaded
            directory.write_summary(summary)
        session = Session(cfg=cfg, run_dir=directory, job=job, rank=place, summary=summary)
        setup(session)
        if place.is_main and job.get("resume_tag"):
            directory.write_summary(summary)
        stopped_at = None
        watchdog = StepWatchdog(
            directory.path,
            rank,
            cfg.dist.get("step_timeout_s"),
            launch=job.get("launch_id"),
            announce=cfg.dist.launcher == "slurm",
        )
        cpu = CpuClock()
        for step in range(session.start_step + 1, int(cfg.train.max_steps) + 1):
            session.in_step = step
            with watchdog.step(step):
                metrics = train_step(session, step)
            session.in_step = None
            if evaluation_due(cfg, step):
                metrics.update(evaluate(session))
            metrics.update(cpu.lap())
            record(session, step, metrics)
            if session.stop_agreed and step < int(cfg.train.max_steps):
                stopped_at = step
                break
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < int(cfg.train.max_steps):
                save(session, step)
        return finish(session, stopped_at)
    except BaseException as err:
        raise _failed(err, directory, rank, summary, session, resuming=bool(job.get("resume_tag"))) from err
    finally:
        if watchdog is not None:
            watchdog.close()
        if session is not None and session.metrics_file is not None:
            session.metrics_file.close()
        # Without this, rank 0 aborts at exit ("terminate called without an active exception").
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _failed(
    err: BaseException, run_dir: RunDir, rank: int, summary: Summary, session: Session | None, *, resuming: bool
) -> BaseException:
    """Record how this rank failed (errors/, rank 0's summary and W&B run); the exception to raise."""
    status = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    message = one_line(err)
    if not isinstance(err, LauncherError):
        message = f"{type(err).__name__}: {message}"
    if session is not None and session.in_step is not None:
        message = step_failure(message, session.in_step, session.summary.world_size, session.summary.zero_stage)
    started = session.started if session else time.time()
    summary.status, summary.error, summary.wall_s = status, message, round(time.time() - started, 3)
    exit_code = err.exit_code if isinstance(err, LauncherError) else 1
    trace_file = run_dir.errors / f"rank{rank}.txt"
    # Best effort: on a full disk these writes fail too, and must not hide the error itself.
    with contextlib.suppress(OSError):
        trace_file = record_rank_error(run_dir.path, rank, message, exit_code, traceback.format_exc())
    # A resume that failed before its checkpoint loaded has earned no summary: the run's stays as it was.
    if rank == 0 and (not resuming or (session is not None and session.start_step > 0)):
        with contextlib.suppress(OSError):
            run_dir.write_summary(summary)
        if session is not None and session.logger is not None:
            with contextlib.suppress(Exception):
                _flush_history(session)
            session.logger.finish(summary.to_json(), exit_code=1)
    if isinstance(err, LauncherError | KeyboardInterrupt):
        return err
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        log.exception("training failed on rank %d", rank)
    return TrainingFailed(f"rank {rank}: {message} (traceback: {trace_file})")


# ----------------------------------------------------------------------------- setup
def setup(s: Session) -> None:
    """Data, model, engine, resume, logger: everything the first step needs."""
    cfg, rank = s.cfg, s.rank
    # ds_config.json holds "<redacted>" for credentials: DeepSpeed gets the real values.
    ds_config = credentials.restore(read_json(s.run_dir.ds_config), credentials.of_deepspeed_dict(plain(cfg)))
    s.reshard = reshard = Reshard.from_json(s.job["reshard"]) if s.job.get("reshard") else None
    if reshard is not None and reshard.converts and reshard.zero_stage > 0:
        # A load-time switch only (DeepSpeed reads the checkpoint's universal copy); ds_config.json stays the job's.
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    _seed_everything(int(cfg.train.seed))
    cache = Path(cfg.cache_dir).expanduser().absolute()
    loaded = load_data(cfg, cache, rank, micro=int(ds_config["train_micro_batch_size_per_gpu"]))
    model, s.processor = setup_model(s, ds_config, cache, loaded.train + loaded.eval)
    trainable = [p for p in model.parameters() if p.requires_grad]
    import deepspeed

    fallback = ops.optimizer_fallback(ds_config)  # on every rank: each loads (or builds) the op itself
    if fallback and rank.is_main:
        log.warning(fallback)
    s.engine, _, _, s.scheduler = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
    s.summary.extra["optimizer"] = type(getattr(s.engine, "basic_optimizer", None) or s.engine.optimizer).__name__
    s.memory = MemoryMeter(rank.device)
    s.dtype = _engine_dtype(s.engine)
    s.grad_norm = GradNormSource(s.engine)
    s.summary.zero_stage = s.engine.zero_optimization_stage()
    s.summary.world_size = rank.world_size
    s.summary.precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(s.dtype, "fp32")
    s.summary.extra["params_held_per_rank"] = _params_held_per_rank(s.engine, rank.device)
    s.data = setup_data(s, loaded, cache)
    s.checkpoint_meta = {
        "world_size": rank.world_size,
        "zero_stage": s.summary.zero_stage,
        "precision": s.summary.precision,
        "model": s.job.get("model"),
        "method": s.job.get("method"),
        "base_model": s.summary.extra["base_model"],  # what an export from this checkpoint rebuilds
        # What a resume on another world size keeps (launcher.reshard), and what a ZeRO-0 optimizer
        # state is indexed by (launcher.universal converts it by these names).
        "global_batch": int(ds_config["train_batch_size"]),
        "offload_optimizer": (ds_config["zero_optimization"].get("offload_optimizer") or {}).get("device", "none"),
        "micro_batch": s.micro,
        "lr_schedule": checkpoint.lr_schedule_of(ds_config),  # a resume says when it changes the schedule
        "param_names": [name for name, param in s.engine.module.named_parameters() if param.requires_grad],
    }
    resumed_rng = resume(s)
    s.stop = checkpoint.StopRequest(s.run_dir.path)
    s.logger = _start_logger(s, ds_config) if rank.is_main else None
    if rank.is_main:
        s.metrics_file = s.run_dir.metrics_writer()  # after resume(), which drops the lines of later steps
        s.history = HistoryWindow(int(cfg.logger.log_every)) if s.logger is not None else None
    s.progress = _Progress(rank.is_main, int(cfg.train.max_steps), int(cfg.train.log_every))
    s.throughput = Throughput(skip_steps=min(5, int(cfg.train.max_steps) // 5))
    if resumed_rng is not None:  # last: nothing in setup may draw from the restored generators
        checkpoint.set_rng_state(resumed_rng)
    s.engine.train()


def load_data(cfg: DictConfig, cache: Path, rank: Rank, *, micro: int) -> Any:
    """The train and eval records (LoadedData); rank 0 generates the built-in set first while the others wait."""
    from launcher.data.records import prepare_data, read_data

    if rank.is_main and cfg.data.synthetic:
        prepare_data(cfg.data, cache)
    _barrier()
    # Under on_bad_record=skip an image that does not decode must be found before training: the cache
    # build decodes every image anyway; without the cache the records are decoded here once.
    decode = str(cfg.data.on_bad_record) == "skip" and not cfg.data.cache
    loaded = read_data(cfg.data, cache, decode=decode)
    if rank.is_main:
        log.info(
            "data: %d train, %d eval records (%d bad records skipped); format %s",
            len(loaded.train),
            len(loaded.eval),
            loaded.skipped,
            ", ".join(f"{source.name}={fmt}" for source, fmt in zip(loaded.sources, loaded.formats, strict=True)),
        )
    if len(loaded.train) < micro * rank.world_size:
        raise LauncherError(
            f"data: {len(loaded.train)} usable training records, fewer than one global micro-batch "
            f"({micro} x {rank.world_size} ranks)"
        )
    return loaded


def setup_model(s: Session, ds_config: dict[str, Any], cache: Path, records: list[dict]) -> tuple[Any, Any]:
    """The model as it trains (frozen parts frozen, adapters added, checkpointing on) and its processor.

    A tiny model is built first, by rank 0; the others wait and load the same build."""
    from launcher.model.method import apply_method, parameter_counts, quantization_config
    from launcher.model.models import (
        apply_freeze,
        enable_gradient_checkpointing,
        load_model_and_processor,
        resolve_attn_implementation,
        resolve_model_path,
    )

    cfg = s.cfg
    if s.rank.is_main:
        resolve_model_path(cfg.model, int(cfg.train.seed), cache, records)
    _barrier()
    model_path = resolve_model_path(cfg.model, int(cfg.train.seed), cache, records)
    if Path(model_path).expanduser().is_dir():  # absolute: the adapter and checkpoints name it as the base
        model_path = str(Path(model_path).expanduser().resolve())
    # At ZeRO-3 transformers must know the DeepSpeed config before the model is built, so that
    # from_pretrained partitions the weights at construction instead of materialising them per rank.
    hf_ds_config = None
    if ds_config["zero_optimization"]["stage"] == 3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # kept alive on purpose: transformers reads it at load
    precision = s.job["precision"]
    attention = resolve_attn_implementation(
        str(cfg.model.attn_implementation), device_kind=s.rank.device.type, precision=precision
    )
    extra: dict[str, Any] = {}
    if str(cfg.method.name) == "qlora":
        extra["quantization_config"] = quantization_config(cfg.method, precision)
        if hf_ds_config is None:  # bitsandbytes quantises as the weights reach the GPU; ZeRO-3 places them itself
            extra["device_map"] = {"": s.rank.device}
    logs.quiet_transformers()
    model, processor = load_model_and_processor(
        model_path,
        attn_implementation=attention,
        min_pixels=cfg.model.min_pixels,
        max_pixels=cfg.model.max_pixels,
        **extra,
    )
    # True when ZeRO-3 partitioned the weights while loading (zero.Init tags each parameter).
    s.summary.extra["partitioned_at_load"] = any(hasattr(p, "ds_id") for p in model.parameters())
    model.config.use_cache = False
    apply_freeze(
        model,
        vision=cfg.model.freeze_vision,
        projector=cfg.model.freeze_projector,
        language=cfg.model.freeze_language,
    )
    enable_gradient_checkpointing(
        model, language=cfg.model.gradient_checkpointing, vision=cfg.model.vision_gradient_checkpointing
    )
    # The adapters' initial weights from train.seed alone: loading the base draws from the generator
    # differently per ZeRO stage (zero.Init), and the same job must start from the same adapters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg.train.seed))
        model = apply_method(model, cfg.method, cfg.model)
    counts = parameter_counts(model)
    s.summary.extra.update(
        {
            "params_total": counts["total"],
            "params_trainable": counts["trainable"],
            "trainable_fraction": counts["trainable"] / max(counts["total"], 1),
            "method": str(cfg.method.name),
            "attn_implementation": attention,
            "base_model": model_path,
        }
    )
    if s.rank.is_main:
        log.info(
            "model %s (%s, attention %s): %d of %d parameters train (%.2f%%); %s",
            model_path,
            cfg.method.name,
            attention,
            counts["trainable"],
            counts["total"],
            100 * counts["trainable"] / max(counts["total"], 1),
            counts,
        )
    return model, processor


def setup_data(s: Session, loaded: Any, cache: Path) -> Data:
    """Loaders for training (resumable, sharded by rank), held-out loss and exact-match accuracy.

    With data.cache the records are decoded and tokenized once, by rank 0 while the others wait, and
    training reads tensors. At ZeRO-3 with several ranks every batch runs the vision tower (a dummy
    image where a batch has none): otherwise ranks whose batches differ in modality hang. Records over
    data.max_length are cut or skipped alike with the cache or without it; rank 0 lists those skipped in
    RUN/skipped_records.jsonl."""
    from torch.utils.data import DataLoader, DistributedSampler

    from launcher.data.records import ConversationDataset
    from launcher.data.sampling import LengthGroupedSampler, MixtureSampler

    cfg, rank, micro = s.cfg, s.rank, s.micro
    guard = cfg.data.get("modality_guard")
    if guard is None:
        guard = s.engine.zero_optimization_stage() == 3 and rank.world_size > 1
    tally = SkipTally(bad=loaded.skipped, entries=list(loaded.skip_log))
    cache_info: dict[str, Any] = {}
    train_set, collate, train_records, train_cache = _split_dataset(s, loaded.train, cache, "train", guard, tally)
    if train_cache is not None:
        cache_info = {"path": str(train_cache.path), "built": train_cache.built, "build_s": train_cache.build_seconds}
        sources = train_set.sources
    else:
        sources = [record["source"] for record in train_records]
    if len(train_set) < micro * rank.world_size:  # records whose images failed to decode were skipped
        raise LauncherError(
            f"data: {len(train_set)} usable training records, fewer than one global micro-batch "
            f"({micro} x {rank.world_size} ranks)"
        )
    seed = int(cfg.train.seed)
    placement = {"num_replicas": rank.world_size, "rank": rank.rank, "seed": seed}
    if loaded.mixture:
        sizes = [sources.count(index) for index in range(len(loaded.sources))]
        sampler: Any = MixtureSampler(sizes, [source.weight for source in loaded.sources], **placement)
    elif cfg.data.group_by_length:
        sampler = LengthGroupedSampler(train_set.lengths(), micro=micro, **placement)
    else:
        sampler = checkpoint.ResumableSampler(train_set, shuffle=True, **placement)
    workers = int(cfg.data.num_workers)
    loader_args = {
        "num_workers": workers,
        "persistent_workers": workers > 0,
        "worker_init_fn": _die_with_rank,  # no DataLoader worker outlives a rank killed by a signal
        # Page-locked batches copy to a GPU asynchronously (`_to_device` uses non_blocking=True).
        "pin_memory": rank.device.type == "cuda",
    }
    # Each loader draws its workers' seed from a generator of its own, not from the global one (whose
    # restored state a resumed run's extra draws would shift): see checkpoint.batches.
    train_loader = DataLoader(
        train_set,
        batch_size=micro,
        sampler=sampler,
        drop_last=True,
        generator=torch.Generator(),
        collate_fn=collate,
        **loader_args,
    )
    eval_loader = accuracy_set = None
    if loaded.eval:
        eval_set, eval_collate, eval_records, _ = _split_dataset(s, loaded.eval, cache, "eval", guard, tally)
        eval_sampler = DistributedSampler(eval_set, num_replicas=rank.world_size, rank=rank.rank, shuffle=False)
        eval_generator = torch.Generator().manual_seed(seed)
        eval_loader = DataLoader(
            eval_set,
            batch_size=micro,
            sampler=eval_sampler,
            generator=eval_generator,
            collate_fn=eval_collate,
            **loader_args,
        )
        if cfg.data.eval_accuracy:
            # The same number of samples per rank: under ZeRO-3 the ranks' generate calls run in lock-step.
            usable = min(int(cfg.data.eval_samples), len(eval_records)) // rank.world_size * rank.world_size
            accuracy_set = ConversationDataset(eval_records[:usable][rank.rank :: rank.world_size])
    position = checkpoint.DataPosition()
    batches = checkpoint.batches(train_loader, sampler, position, micro)
    names = [source.name for source in loaded.sources] if loaded.mixture else []
    if rank.is_main:
        _report_skipped(s, tally)
    return Data(
        batches,
        position,
        eval_loader,
        accuracy_set,
        tally.bad,
        sampler,
        names,
        cache_info,
        records_truncated=tally.truncated,
        records_too_long=tally.too_long,
    )


@dataclass
class SkipTally:
    """Records left out (bad, or over data.max_length) and cut, over the splits: the summary's counts and
    the lines of RUN/skipped_records.jsonl."""

    bad: int = 0
    too_long: int = 0
    truncated: int = 0
    entries: list[dict[str, Any]] = field(default_factory=list)


def _split_dataset(
    s: Session, records: list[dict], cache: Path, split: str, guard: bool, tally: SkipTally
) -> tuple[Any, Any, list[dict], Any]:
    """(dataset, collate function, the records that train, the cache's CacheInfo or None) of one split,
    through the data cache or not, under data.max_length: both ways cut and skip the same records."""
    from launcher.data.cache import CachedCollator
    from launcher.data.formats import skipped_entry
    from launcher.data.records import Collator, ConversationDataset, LengthLimit, fit_records

    limit = LengthLimit.of(s.cfg.data)
    if s.cfg.data.cache:
        dataset, info = _cached_dataset(s, records, cache, limit)
        tally.bad += info.skipped
        tally.too_long += info.too_long
        tally.truncated += info.truncated
        tally.entries += [{"split": split, **entry} for entry in info.skip_log]
        kept = [records[index] for index in dataset.indices]  # those that decoded and fit
        return dataset, CachedCollator(s.processor, image_every_batch=guard), kept, info
    report = fit_records(records, s.processor, limit, num_workers=int(s.cfg.data.num_workers))
    tally.too_long += len(report.skipped)
    tally.truncated += report.cut
    for index, reason in report.skipped:
        record = records[index]
        entry = skipped_entry(record.get("file", ""), record.get("index", index), reason)
        tally.entries.append({"split": split, **entry})
    kept = [records[index] for index in report.kept]
    return ConversationDataset(kept), Collator(s.processor, image_every_batch=guard, limit=limit), kept, None


def _report_skipped(s: Session, tally: SkipTally) -> None:
    """Rank 0: RUN/skipped_records.jsonl (rewritten at every start, so a resume repeats no line) and one
    log line with the counts, naming the file."""
    s.run_dir.write_skipped_records(tally.entries)
    longest = s.cfg.data.get("max_length")
    parts = [
        f"{tally.bad} bad record(s) skipped" if tally.bad else "",
        f"{tally.too_long} record(s) over data.max_length={longest} skipped" if tally.too_long else "",
        f"{tally.truncated} record(s) truncated to data.max_length={longest}" if tally.truncated else "",
    ]
    parts = [part for part in parts if part]
    if parts:
        where = f": see {s.run_dir.skipped_records}" if tally.entries else ""
        log.info("data: %s%s", ", ".join(parts), where)


def _cached_dataset(s: Session, records: list[dict], cache: Path, limit: Any) -> tuple[Any, Any]:
    """The records as a CachedDataset; rank 0 builds the cache when missing while the others wait."""
    from launcher.data.cache import CachedDataset, RecordEncoder, ensure_cache
    from launcher.data.records import ConversationDataset

    def build() -> Any:
        return ensure_cache(
            cache / "data_cache",
            records,
            s.processor,
            s.summary.extra["base_model"],
            RecordEncoder(s.processor, limit),
            ConversationDataset(records).__getitem__,
            on_bad_record=str(s.cfg.data.on_bad_record),
            num_workers=int(s.cfg.data.num_workers),
        )

    if s.rank.is_main:
        info = build()
        log.info(
            "data cache %s: %s (%d records, %d skipped)",
            info.path,
            f"built in {info.build_seconds:.1f} s" if info.built else "reused",
            info.records,
            info.skipped,
            extra={} if info.built else logs.FILE_ONLY,  # a build took a while: the terminal says so
        )
    _barrier()
    info = build() if not s.rank.is_main else info
    return CachedDataset(info.path), info


def resume(s: Session) -> dict[str, Any] | None:
    """Continue from the checkpoint job.json names: weights, optimizer, scheduler and loss scaler from
    DeepSpeed's files; data position and random-number state from this rank's own file. metrics.jsonl
    forgets the steps after the checkpoint (they are trained again). Returns the saved random state.

    On another world size or ZeRO stage (job.json's "reshard"): the universal copy, and each rank's data
    position recomputed from the samples all ranks had drawn (launcher.reshard)."""
    tag = s.job.get("resume_tag")
    if not tag:
        return None
    reshard = s.reshard
    s.start_step, position, rng = checkpoint.load(s.engine, s.run_dir.path, tag, reshard)
    s.data.position.epoch, s.data.position.batches = position.epoch, position.batches
    if reshard is not None:
        s.data.position.batches = resumed_batches(
            position.batches, reshard.saved_micro_batch, reshard.saved_world_size, s.micro, s.rank.world_size
        )
        s.summary.extra["resharded_from"] = reshard.to_json()
        if s.rank.is_main:
            log.info("resumed on another shape: %s (global batch %d kept)", reshard.describe(), reshard.global_batch)
    if position.sources is not None:  # a mixture: the same data must resume at the same place in each source
        _check_mixture_position(s, position)
    s.summary.extra["resumed_from_step"] = s.start_step
    if s.rank.is_main:
        checkpoint.truncate_metrics(s.run_dir.path, s.start_step)
        log.info("resumed from %s at step %d", s.run_dir.checkpoints / tag, s.start_step)
    return rng


def _check_mixture_position(s: Session, saved: checkpoint.DataPosition) -> None:
    """The mixture must be the one saved: the same sources, records per source and draws per source."""
    now = s.data.mixture_position(_global_draws(s, saved.batches))
    if saved.sources != now:
        raise LauncherError(
            f"the checkpoint's mixture {saved.sources} differs from the data's now {now} at the same step: "
            "data.sources (files, their records, weights or names) changed since it was saved; resume with the "
            "same mixture"
        )


def _global_draws(s: Session, batches: int) -> int:
    """Training samples all ranks drew from the stream after `batches` micro-batches each."""
    return batches * s.micro * s.rank.world_size


# ----------------------------------------------------------------------------- one step
def train_step(s: Session, step: int) -> dict[str, float]:
    """One optimizer step over `accum` micro-batches; returns its metrics (the loss averaged over ranks)."""
    engine, device = s.engine, s.rank.device
    step_start = time.perf_counter()
    wait = loss_sum = tokens = 0.0
    grad_norm = math.nan
    for _ in range(s.accum):
        fetch_start = time.perf_counter()
        batch = next(s.data.batches)
        wait += time.perf_counter() - fetch_start
        tokens += float(batch["attention_mask"].sum())
        loss = engine(**_to_device(batch, device, s.dtype)).loss
        engine.backward(loss)
        if s.grad_norm.computed_here and engine.is_gradient_accumulation_boundary():
            grad_norm = _unpartitioned_grad_norm(engine)
        engine.step()
        loss_sum += float(loss.detach())
    _inject_fault(s.rank.rank, step)
    # One collective per step: the loss and tokens summed over ranks, and whether any rank was asked to stop.
    loss_sum, tokens, stop_votes = _all_reduce_sum([loss_sum, tokens, float(s.stop.wanted())], device)
    s.stop_agreed = stop_votes > 0
    step_loss = loss_sum / (s.accum * s.rank.world_size)
    _check_finite(s, step, step_loss)
    step_time = time.perf_counter() - step_start
    samples = s.micro * s.accum * s.rank.world_size
    s.throughput.add(step, step_time, samples, tokens)
    s.last_loss = step_loss
    metrics = {
        "train/loss": step_loss,
        "train/lr": float(s.scheduler.get_last_lr()[0]) if s.scheduler else float(engine.get_lr()[0]),
        "train/grad_norm": _grad_norm(engine, s.grad_norm.take(grad_norm)),
        "perf/samples_per_sec": samples / step_time,
        "perf/tokens_per_sec": tokens / step_time,
        "perf/step_time_s": step_time,
        "perf/data_wait_frac": wait / step_time,
        **s.memory.read(),
    }
    for name, count in s.data.source_counts(_global_draws(s, s.data.position.batches)).items():
        metrics[f"data/samples_{name}"] = count  # cumulative: the mixture's realised shares
    if s.dtype == torch.float16:
        metrics["train/loss_scale"] = _loss_scale(engine.optimizer)
    return metrics


def _check_finite(s: Session, step: int, loss: float) -> None:
    """Stop on a non-finite loss, unless fp16's loss scaler skipped that update (within the budget)."""
    s.nonfinite_in_a_row = 0 if math.isfinite(loss) else s.nonfinite_in_a_row + 1
    allowed = int(s.cfg.train.max_nonfinite_steps)
    if nonfinite_action(loss, s.dtype == torch.float16, s.nonfinite_in_a_row, allowed) != "stop":
        return
    saved = checkpoint.find_resume_tag(s.run_dir.checkpoints)
    fixes = "lower train.lr, use precision=bf16 instead of fp16," if s.dtype == torch.float16 else "lower train.lr"
    raise TrainingFailed(
        f"loss is {loss} at step {step}: {fixes} or check the data"
        + (f"; checkpoint {saved}, saved before it, resumes with resume={s.run_dir.path}" if saved else "")
    )


def nonfinite_action(loss: float, fp16: bool, in_a_row: int, allowed: int) -> str:
    """What a step's loss means for the run: "ok", "skip" (fp16, whose loss scaler skipped the update), "stop".

    fp32 and bf16 have no loss scaler: a non-finite loss means the update was applied and the weights
    are spoiled, so the run stops at once (naming the step) and the last checkpoint stays the good one."""
    if math.isfinite(loss):
        return "ok"
    return "skip" if fp16 and in_a_row <= allowed else "stop"


_BALLAST: list[torch.Tensor] = []  # memory held by the "alloc" fault, for the rest of the run


def _inject_fault(rank: int, step: int) -> None:
    rank_text, step_text, *how = os.environ.get(FAULT_ENV, "-1:-1").split(":")
    if (int(rank_text), int(step_text)) != (rank, step):
        return
    if how == ["hang"]:
        time.sleep(10**6)  # the other ranks wait in this step's all-reduce
    if how == ["abort"]:
        os.abort()
    if how and how[0].startswith("alloc="):  # hold that many MiB, touched (resident), and go on
        _BALLAST.append(torch.ones(int(how[0].split("=", 1)[1]) * 2**20, dtype=torch.uint8))
        return
    raise RuntimeError(f"fault injected by {FAULT_ENV} on rank {rank} at step {step}")


def record(s: Session, step: int, metrics: dict[str, float]) -> None:
    """Metrics to metrics.jsonl (every step) and W&B (a row per logger.log_every steps) on rank 0; progress."""
    if s.rank.is_main:
        s.metrics_file.write({"step": step, **metrics})
        if s.history is not None and (row := s.history.add(step, metrics)) is not None:
            s.logger.log(row, step=step)
    s.progress.update(step, metrics)


def _flush_history(s: Session) -> None:
    """W&B's row of the steps since its last one (a run that ends between rows)."""
    if s.history is not None and (row := s.history.flush()) is not None:
        s.logger.log(row, step=s.history.step)


# ----------------------------------------------------------------------------- evaluation
def evaluation_due(cfg: DictConfig, step: int) -> bool:
    every = int(cfg.train.eval_every)
    return bool(every and step % every == 0) or step == int(cfg.train.max_steps)


@torch.no_grad()
def evaluate(s: Session) -> dict[str, float]:
    """Held-out loss (and exact-match accuracy when data.eval_accuracy), averaged over ranks."""
    from launcher.data.records import exact_match_accuracy

    if s.data.eval_loader is None:  # no held-out data given
        return {}
    engine, device = s.engine, s.rank.device
    engine.eval()
    loss_sum, count = 0.0, 0.0
    for batch in s.data.eval_loader:
        outputs = engine(**_to_device(batch, device, s.dtype))
        loss_sum += float(outputs.loss) * batch["input_ids"].shape[0]
        count += batch["input_ids"].shape[0]
    total_loss, total_count = _all_reduce_sum([loss_sum, count], device)
    metrics = {"eval/loss": total_loss / max(total_count, 1.0)}
    if s.data.accuracy_set is not None:
        stage3 = engine.zero_optimization_stage() == 3
        correct, total = exact_match_accuracy(
            engine.module,
            s.processor,
            s.data.accuracy_set,
            max_new_tokens=int(s.cfg.data.max_new_tokens),
            synced_gpus=stage3 and s.rank.world_size > 1,
        )
        correct, total = _all_reduce_sum([correct, total], device)
        metrics["eval/accuracy"] = correct / max(total, 1.0)
    engine.train()
    s.eval_metrics = metrics
    if s.rank.is_main and metrics:
        log.info("eval: %s", {k: round(v, 4) for k, v in metrics.items()})
    return metrics


# ----------------------------------------------------------------------------- saving and finishing
def save(s: Session, step: int) -> None:
    """A resumable checkpoint of this step (collective: every rank calls it).

    DeepSpeed stores its config dict in the checkpoint: it stores the one without credentials."""
    keep = int(s.cfg.train.keep_checkpoints)
    if s.data.source_names:
        s.data.position.sources = s.data.mixture_position(_global_draws(s, s.data.position.batches))
    real = s.engine.config
    s.engine.config = credentials.split(real)[0]
    try:
        checkpoint.save(s.engine, s.run_dir.path, step, s.data.position, s.checkpoint_meta, keep=keep)
    finally:
        s.engine.config = real


def finish(s: Session, stopped_at: int | None) -> Summary:
    """The last checkpoint, the final model (unless stopped early), and the summary."""
    s.progress.close()
    steps_done = stopped_at or int(s.cfg.train.max_steps)
    if steps_done > s.start_step:  # a resume of a finished run has nothing new to save
        save(s, steps_done)
    if stopped_at is None:
        _save_model(s.engine, s.processor, s.run_dir.model, s.rank.is_main)
    elif s.rank.is_main:
        log.info("stopped after step %d on %s; resume with resume=%s", steps_done, s.stop.reason(), s.run_dir.path)
    summary, throughput = s.summary, s.throughput
    summary.status = "completed" if stopped_at is None else "preempted"
    summary.steps = steps_done
    summary.wall_s = round(time.time() - s.started, 3)
    summary.final_loss = s.last_loss
    summary.eval_loss = s.eval_metrics.get("eval/loss")
    summary.eval_accuracy = s.eval_metrics.get("eval/accuracy")
    summary.samples_per_sec = throughput.per_second(throughput.samples)
    summary.tokens_per_sec = throughput.per_second(throughput.tokens)
    memory = s.memory.read()
    summary.peak_memory_bytes = memory.pop(device_memory.PEAK)
    summary.extra["memory"] = {key.removeprefix("mem/"): value for key, value in memory.items()}
    summary.extra["records_skipped"] = s.data.records_skipped
    summary.extra["records_too_long"] = s.data.records_too_long  # over data.max_length, skipped
    summary.extra["records_truncated"] = s.data.records_truncated  # cut to data.max_length
    if s.data.cache:
        summary.extra["data_cache"] = s.data.cache
    if s.data.source_names:
        summary.extra["samples_per_source"] = s.data.source_counts(_global_draws(s, s.data.position.batches))
    summary.objective = getattr(summary, OBJECTIVES[str(s.cfg.objective)])
    if s.rank.is_main:
        s.run_dir.write_summary(summary)
        wandb_line = None
        if s.logger is not None:
            _flush_history(s)
            s.logger.finish(summary.to_json(), exit_code=0, hint=False)  # the table names the run
            wandb_line = s.logger.describe()
        _print_final_table(summary, s.run_dir, wandb_line)
    return summary


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


# ----------------------------------------------------------------------------- helpers
def _die_with_rank(_worker_id: int) -> None:
    from launcher.core.children import die_with_parent

    die_with_parent()


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _loss_scale(optimizer: Any) -> float:
    """fp16's current loss scale. Every DeepSpeed fp16 optimizer has `loss_scale` (ZeRO-0's FP16_Optimizer
    has no `cur_scale`, which only ZeRO 1-3 add)."""
    scale = getattr(optimizer, "loss_scale", None)
    return float(scale) if scale is not None else math.nan


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


def _engine_dtype(engine: Any) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def _unpartitioned_grad_norm(engine: Any) -> float:
    """Gradient norm at ZeRO stage 0 in fp32 without clipping (GradNormSource.computed_here decides).

    Gradients are already all-reduced at the accumulation boundary, so the local norm is global.
    One fused per-tensor norm call: a Python loop over the parameters cost ~1% of a tiny model's step."""
    grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return math.nan
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64))


class GradNormSource:
    """Where train/grad_norm comes from at ZeRO stage 0 in fp32, the one case DeepSpeed keeps no norm
    (engine.get_global_grad_norm() serves the others).

    With clipping on, DeepSpeed computes the norm to clip by (engine.clip_fp32_gradients calls
    deepspeed.runtime.utils.clip_grad_norm_, which returns it) and drops it: this engine's
    clip_fp32_gradients makes the same call and keeps the result, so the metric costs nothing (a second
    pass over the gradients cost ~1% of a small model's step). Without clipping the launcher computes
    the norm before the optimizer step (`computed_here`)."""

    def __init__(self, engine: Any) -> None:
        self.computed_here = False
        self._kept: Any = None
        if engine.zero_optimization_stage() != 0 or _engine_dtype(engine) != torch.float32:
            return
        if engine.gradient_clipping() > 0 and hasattr(engine, "clip_fp32_gradients"):
            from deepspeed.runtime.utils import clip_grad_norm_

            def clip_and_keep_norm() -> None:
                self._kept = clip_grad_norm_(
                    parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
                )

            engine.clip_fp32_gradients = clip_and_keep_norm
        else:
            self.computed_here = True

    def take(self, computed: float) -> float:
        """This step's norm: the one DeepSpeed's clipping kept, else `computed` (NaN when there is none)."""
        kept, self._kept = self._kept, None
        return computed if kept is None else float(kept)


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
            self.bar.set_postfix_str(text, refresh=False)  # update() redraws, at most every 0.1 s
            self.bar.update(1)
        elif step % self.log_every == 0 or step in (1, self.total):
            log.info("step %d/%d | %s | lr %.2e", step, self.total, text, metrics["train/lr"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _print_final_table(summary: Summary, run_dir: RunDir, wandb_line: str | None) -> None:
    """The run's one summary on the terminal: how it ended, its figures, where its files are."""

    def figure(value: float | None, digits: int = 4) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    loss = figure(summary.final_loss)
    if summary.eval_loss is not None:
        held_out = f"held-out {figure(summary.eval_loss)}"
        if summary.eval_accuracy is not None:
            held_out += f", exact match {figure(summary.eval_accuracy, 3)}"
        loss += f" ({held_out})"
    rows = [
        ("loss", loss),
        ("speed", f"{figure(summary.samples_per_sec, 1)} samples/s, peak memory {_mib(summary.peak_memory_bytes)}"),
        ("run dir", f"{run_dir.path} (train.log, summary.json, metrics.jsonl)"),
    ]
    if summary.status == "completed":
        rows.append(("model", str(run_dir.model)))
    if wandb_line:
        rows.append(("W&B", wandb_line))
    width = max(len(name) for name, _ in rows)
    title = f"run summary: {summary.status}, {summary.steps} steps in {summary.wall_s:.1f} s"
    print("\n".join(["", title, *(f"  {name:<{width}}  {value}" for name, value in rows)]), flush=True)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _start_logger(s: Session, ds_config: dict[str, Any]) -> Any:
    """The W&B run of rank 0 (None when logger=none or W&B is disabled)."""
    if not s.cfg.logger.enabled:
        return None
    from launcher.tracking import wandb_run as wandb_logger

    return wandb_logger.start_for_job(
        cfg=plain(s.cfg),
        run_dir=s.run_dir.path,
        job=s.job,
        ds_config=ds_config,
        summary=s.summary.to_json(),
        # A resume continues the W&B run whose id the first start stored in the run directory.
        resume_id=wandb_logger.read_run_id(s.run_dir.path) if s.job.get("resume_tag") else None,
    )
