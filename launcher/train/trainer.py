"""The trainer of one rank, top to bottom: setup, the loop (step, evaluate, record, save), finish.

Every rank runs `train(job, run_dir)` with the job the launcher planned (launcher.job.spec.Job, read
from run_dir/job.json by launcher.launch.worker). Rank 0 alone writes metrics, the summary, the final
model and W&B records.

    train ─ init_distributed ─ setup (records, engine, loaders, resume, outputs)
          └ for each step: train_step → evaluate (when due) → record → stop? → save (when due)
          └ finish (final checkpoint, model/, summary)

The pieces live beside it: the engine (launcher.train.engine), the data (loaders), one step (step),
evaluation (evaluate), outputs (record), checkpoints (checkpoint). A test calls `train` in its own
process on gloo with the rank environment set (tests/unit/train/test_trainer.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from launcher.config.schema import OBJECTIVES, plain
from launcher.config.stages import Stage, stage_at
from launcher.core import credentials, logs
from launcher.core.checkpoints import CheckpointMarker, lr_schedule_of, read_marker
from launcher.core.errors import Interrupted, LauncherError, TrainingFailed, one_line
from launcher.core.rank_errors import record_rank_error, step_failure
from launcher.core.rundir import RunDir
from launcher.core.signals import pause_for_test
from launcher.core.summary import Summary
from launcher.job.reshard import resumed_batches
from launcher.job.spec import Job
from launcher.model.components import base_model, model_components
from launcher.model.flops import FlopModel
from launcher.model.kernels import fused_loss_installed
from launcher.model.packing import use_packed_attention
from launcher.plan.data import cache_shapes
from launcher.plan.report import planned_from_cache
from launcher.tracking.wandb_run import read_run_id, start_for_job
from launcher.train import checkpoint
from launcher.train.distributed import Rank, barrier, destroy, init_distributed
from launcher.train.engine import Engine, build_engine, release
from launcher.train.evaluate import evaluate, evaluation_due
from launcher.train.faults import Fault
from launcher.train.loaders import Data, build_data, check_mixture_position, check_same_dataset, read_records
from launcher.train.losses import AnswerCrossEntropy, Loss, logps_installed
from launcher.train.memory_meter import PEAK, MemoryMeter
from launcher.train.peak import device_peak
from launcher.train.preference import LiveReference, PrecomputedReference, PreferenceLoss, build_reference
from launcher.train.profile import StepProfiler
from launcher.train.record import Recorder, final_table
from launcher.train.step import CpuClock, StepState, Throughput, Work, to_device, train_step
from launcher.train.watchdog import StepWatchdog

log = logging.getLogger("launcher")


@dataclass
class Run:
    """What the loop works with: the job, this rank, and what setup built for it."""

    job: Job
    run_dir: RunDir
    rank: Rank
    summary: Summary
    engine: Engine
    data: Data
    stop: checkpoint.StopRequest
    recorder: Recorder
    state: StepState
    watchdog: StepWatchdog
    marker: CheckpointMarker  # what each checkpoint of this run records (its step, tag and files set at save)
    started: float  # time.time() when this rank started
    start_step: int = 0
    eval_metrics: dict[str, float] = field(default_factory=dict)
    stage: Stage | None = None  # the stage of train.stages training now
    profiler: StepProfiler | None = None  # train.profile_steps


@dataclass
class _Track:
    """What a failure's record needs to know, however far the run got."""

    started: float = field(default_factory=time.time)
    rank: int = 0
    in_step: int | None = None  # the training step running now (named in a failure's line)
    run: Run | None = None


def train(job: Job, run_dir: Path) -> Summary:
    """Train one rank of `job` in `run_dir`; returns the summary (rank 0's is written)."""
    directory = RunDir(Path(run_dir))
    summary = job.summary()
    if job.resume is not None:  # its time counts the earlier segments' too (what summary.json said then)
        earlier = directory.read_summary()
        summary.earlier_wall_s = earlier.wall_s if earlier is not None else None
    track = _Track(rank=int(os.environ.get("RANK", "0")))
    with contextlib.ExitStack() as cleanup:
        try:
            # Before deepspeed is imported (it logs from its import on); RANK is set by every launcher.
            logs.setup_rank_log(directory.train_log, track.rank)
            rank, created = init_distributed(job)
            if created:
                cleanup.callback(destroy)  # first on the stack, so last: the group outlives what uses it
            track.rank = rank.rank
            if rank.world_size != job.world_size:
                raise LauncherError(
                    f"{rank.world_size} ranks started, but the job was planned for world size {job.world_size} "
                    f"(dist.nnodes={job.config.dist.nnodes} x dist.nproc_per_node={job.config.dist.nproc_per_node}):"
                    " make them agree"
                )
            if rank.is_main and job.resume is None:  # a resume writes its summary once its checkpoint loaded
                directory.write_summary(summary)
            run = track.run = setup(job, directory, rank, summary, cleanup, started=track.started)
            if rank.is_main:  # and again with what setup learned (the data cache, the kernels, the records' plan):
                directory.write_summary(summary)  # a run killed before its end keeps it
            return loop(run, track)
        except BaseException as err:
            raise _failed(err, job, directory, summary, track) from err


def setup(
    job: Job, run_dir: RunDir, rank: Rank, summary: Summary, cleanup: contextlib.ExitStack, *, started: float
) -> Run:
    """Records, engine, loaders, the checkpoint to continue from, outputs: everything the first step needs.
    What must be undone however the run ends goes onto `cleanup`."""
    # First: a stop signal from here on is this rank's to handle (a data cache build stops between its
    # shards; anything else at the first step, which saves).
    stop = checkpoint.StopRequest(run_dir)
    cleanup.callback(stop.close)
    loaded = read_records(job, rank)
    stage = starting_stage(job, run_dir)
    pause_for_test("load", until=stop.wanted)  # the tests' stop signals land here, the model about to load
    engine = build_engine(job, rank, summary, stage=stage, path=stage_start(job, run_dir, stage))
    engine_built(job, engine, stage, summary)
    data = build_data(job, rank, loaded, engine.processor, engine.zero_stage, run_dir, summary, stop=stop.wanted)
    cleanup.callback(data.shut_down_workers)
    if rank.is_main:
        plan_from_records(job, engine.processor, summary)
    marker = checkpoint_marker(job, engine, rank, summary, stage)
    start_step, rng = resume(job, run_dir, rank, engine, data, summary)
    # A preference loss's reference: computed now, before the first step, when precomputed and missing.
    loss = build_loss(job, rank, engine, data, summary, may_compute=start_step == 0, stop=stop.wanted)
    wandb = None
    if rank.is_main and job.config.logger.enabled:
        # A resume continues the W&B run whose id the first start stored in the run directory.
        wandb = start_for_job(job, resume_id=read_run_id(run_dir.path) if job.resume else None)
    recorder = Recorder(  # after resume(), which drops the metrics of later steps
        run_dir,
        main=rank.is_main,
        wandb=wandb,
        total=job.max_steps,
        log_every=int(job.config.train.log_every),
        wandb_every=int(job.config.logger.log_every),
    )
    cleanup.callback(recorder.close)
    peak = device_peak(rank.device, engine.dtype)  # before the restored random state: it draws nothing global
    summary.peak_flops_source = peak.source
    state = StepState(
        run_dir=run_dir,
        throughput=Throughput(skip_steps=min(5, job.max_steps // 5)),
        memory=MemoryMeter(rank.device),
        fault=Fault.for_rank(rank.rank),
        max_nonfinite=int(job.config.train.max_nonfinite_steps),
        flops=flop_model(engine),
        peak_flops=peak.flops,
        loss=loss,
    )
    dist = job.config.dist
    watchdog = StepWatchdog(
        run_dir.path, rank.rank, dist.step_timeout_s, launch=job.launch_id, announce=str(dist.launcher) == "slurm"
    )
    cleanup.callback(watchdog.close)
    if rng is not None:  # last: nothing in setup may draw from the restored generators
        checkpoint.set_rng_state(rng)
    engine.engine.train()
    profiler = StepProfiler(
        job.config.train.profile_steps, run_dir.path, is_main=rank.is_main, device=rank.device,
        vision=vision_modules(engine),
    )  # fmt: skip
    return Run(
        job, run_dir, rank, summary, engine, data, stop, recorder, state, watchdog, marker, started, start_step,
        stage=stage, profiler=profiler,
    )  # fmt: skip


def build_loss(
    job: Job, rank: Rank, engine: Engine, data: Data, summary: Summary, *, may_compute: bool, stop: Any
) -> Loss:
    """The objective (launcher.train.losses): the answers' cross-entropy, or a preference loss (loss=dpo|ipo)
    and its reference (launcher.train.preference)."""
    chunk = int(job.config.loss.chunk_tokens)
    if not logps_installed(engine.engine):  # a model layout without the row log-probs mode
        chunk = 0
    summary.loss_logits = f"chunks of {chunk} answer tokens" if chunk else "whole logits"
    if chunk and fused_loss_installed(base_model(engine.engine.module)):
        summary.loss_logits = "liger's fused linear cross-entropy (chunks of its own)"
    if not job.config.data.pairs:
        return AnswerCrossEntropy(chunk=chunk)
    reference = build_reference(
        job, rank, engine.engine, engine.dtype, engine.ds_config or job.ds_config, data.pair_sets,
        lambda inputs: to_device(inputs, rank.device, engine.dtype), may_compute=may_compute, stop=stop,
    )  # fmt: skip
    summary.reference = {"kind": reference.name}
    if isinstance(reference, LiveReference):
        summary.reference["params_held"] = reference.params_held
    if isinstance(reference, PrecomputedReference):
        summary.reference.update(path=str(reference.path), computed=reference.seconds is not None, s=reference.seconds)
    if rank.is_main:
        log.info("loss %s (beta %g), reference: %s", job.config.loss.name, job.config.loss.beta, reference.name)
    return PreferenceLoss(job.config.loss, reference, chunk=chunk)


def plan_from_records(job: Job, processor: Any, summary: Summary) -> None:
    """summary.json's planned figure from the records this run trains on, once its data cache is built: the
    launcher's preflight plans before the ranks build it (a first run's plan is at data.max_length) and does
    not load a processor from the hub (a hub id's job is never planned from its records there). The figure
    stands beside the measured peak; on a GPU a changed one is said in a line."""
    before = summary.planned_memory_bytes
    if before is None or summary.data_cache is None:  # preflight=off, or no data cache (streaming, cache=false)
        return
    try:
        shapes = cache_shapes(Path(summary.data_cache["path"]), processor)
        planned = planned_from_cache(job.config, job, shapes)
    except LauncherError as err:  # the preflight planned this job: a second look that fails changes nothing
        log.debug("memory plan from the records skipped: %s", one_line(err))
        return
    if planned is None or planned == before:
        return
    summary.planned_memory_bytes = planned
    # Said where the end line sets it beside the measured peak: on a GPU (a CPU's peak is the process's RSS).
    log.log(
        logging.INFO if job.device.kind == "cuda" else logging.DEBUG,
        "memory plan from the %s records of the data cache: %s MiB per rank (the preflight planned %s MiB)",
        f"{len(shapes.lengths):,}", f"{planned / 2**20:,.0f}", f"{before / 2**20:,.0f}",
    )  # fmt: skip


def engine_built(job: Job, engine: Engine, stage: Stage | None, summary: Summary) -> None:
    """What follows an engine's build: packed attention, and the summary's record of a stage's groups."""
    if job.config.data.packing:  # sdpa attends record by record in packed rows (launcher.model.packing)
        summary.attn_implementation = use_packed_attention(engine.engine.module)
    if stage is not None:
        if summary.stages is None:
            summary.stages = [planned.to_json() for planned in job.stages]
        summary.stages[stage.index]["param_groups"] = summary.param_groups


# ----------------------------------------------------------------------------- stages (train.stages)
def starting_stage(job: Job, run_dir: RunDir) -> Stage | None:
    """The stage the first step of this start trains in (a resume: the stage its checkpoint was saved
    in, which a checkpoint at a stage's last step still is); None without train.stages."""
    if not job.stages:
        return None
    return stage_at(job.stages, read_marker(run_dir, job.resume.tag).step if job.resume else 0)


def stage_start(job: Job, run_dir: RunDir, stage: Stage | None) -> str | None:
    """Where a stage's model comes from: the job's model for the first, else the model the stage before
    ended with (RUN/stages/NAME); None: the job's model."""
    if stage is None or stage.index == 0:
        return None
    before = job.stages[stage.index - 1]
    path = run_dir.stage_model(before.name)
    if not (path / "config.json").is_file():
        raise LauncherError(
            f"train.stages: {path}, the model stage {before.name} ended with and stage {stage.name} starts from, "
            "is missing: restore it, or start a new run"
        )
    return str(path)


def next_stage(run: Run, step: int) -> None:
    """Between two stages, before `step` (the next one's first): the model of the stage that ended is saved
    (RUN/stages/NAME, like a job's final model), its engine let go, and the next stage's engine built from
    it as a job of that stage alone would be: its parts train, with a fresh optimizer (Adam states only for
    what trains now) and its own warm-up and cosine; the data starts over. Collective: every rank calls it."""
    ended, stage, began = run.stage, stage_at(run.job.stages, step), time.time()
    path = run.run_dir.inside(run.run_dir.stage_model(ended.name))
    save_model(run.engine, path, run.rank.is_main)
    run.profiler.vision = []  # the ended stage's tower: held here it kept its trained weights alive
    release(run.engine)
    run.engine = build_engine(run.job, run.rank, run.summary, stage=stage, path=str(path))
    run.profiler.vision = vision_modules(run.engine)  # a profile in this stage scopes this tower
    engine_built(run.job, run.engine, stage, run.summary)
    run.marker = checkpoint_marker(run.job, run.engine, run.rank, run.summary, stage)
    run.state.flops = flop_model(run.engine)
    run.data.start_over()
    run.stage = stage
    run.engine.engine.train()
    if run.rank.is_main:
        log.info(
            "stage %s ended: its model saved to %s and the next stage's engine built in %.1f s; %s",
            ended.name, path, time.time() - began, stage.describe(float(run.job.config.train.lr)),
        )  # fmt: skip


def loop(run: Run, track: _Track) -> Summary:
    """Steps from the one after the checkpoint (or the first) to train.max_steps, or to an agreed stop."""
    job, cpu, stopped_at = run.job, CpuClock(), None
    run.data.start_eval_workers()
    for step in range(run.start_step + 1, job.max_steps + 1):
        if run.stage is not None and step > run.stage.last_step:
            next_stage(run, step)
        track.in_step = step
        profiling = run.profiler.around(step) if run.profiler is not None else contextlib.nullcontext()
        with run.watchdog.step(step), profiling:
            metrics = train_step(run.engine, run.data, run.rank, run.state, step, stop=run.stop.wanted())
        track.in_step = None
        if evaluation_due(job, step):
            run.eval_metrics, stop_voted = evaluate(
                job, run.engine, run.data, run.rank, run.state.loss, stop=run.stop.wanted
            )
            run.state.stop_agreed |= stop_voted
            metrics.update(run.eval_metrics)
        if run.stage is not None:
            metrics["train/stage"] = run.stage.index + 1
        metrics.update(cpu.lap())
        run.recorder.record(step, metrics)
        pause_for_test(f"step{step}", until=run.stop.wanted)  # the tests' stop signals land here (a no-op otherwise)
        if run.state.stop_agreed and step < job.max_steps:
            stopped_at = step
            break
        save_every = int(job.config.train.save_every)
        if save_every and step % save_every == 0 and step < job.max_steps:
            save(run, step)
    return finish(run, stopped_at)


def vision_modules(engine: Engine) -> list[nn.Module]:
    """The vision tower, which a profile's scope covers (none for a layout launcher.model.components does
    not know)."""
    try:
        return model_components(base_model(engine.engine.module))["vision"]
    except (LauncherError, AttributeError):
        return []


def flop_model(engine: Engine) -> FlopModel | None:
    """What counts a batch's model FLOPs (launcher.model.flops); None for a layout it does not know."""
    try:
        return FlopModel.of(engine.engine.module)
    except (LauncherError, AttributeError, StopIteration) as err:
        log.info("no model FLOPs counted (no MFU): %s", one_line(err))
        return None


# ----------------------------------------------------------------------------- resuming and saving
def checkpoint_marker(
    job: Job, engine: Engine, rank: Rank, summary: Summary, stage: Stage | None = None
) -> CheckpointMarker:
    """What every checkpoint of this run (or of its `stage`) records about the job (launcher.core.checkpoints)."""
    return CheckpointMarker(
        step=0,
        tag="",
        world_size=rank.world_size,
        zero_stage=engine.zero_stage,
        precision=summary.precision,
        model=plain(job.config.model),
        method=plain(job.config.method),
        base_model=engine.path or job.model_path,
        global_batch=job.global_batch,
        micro_batch=engine.micro,
        offload_optimizer=job.offload_optimizer or "none",
        lr_schedule=lr_schedule_of(engine.ds_config or job.ds_config),
        param_names=list(engine.param_names),
        param_groups=engine.group_layout(),
        stages=[planned.to_json() for planned in job.stages] or None,
        stage=None if stage is None else stage.name,
    )


def resume(
    job: Job, run_dir: RunDir, rank: Rank, engine: Engine, data: Data, summary: Summary
) -> tuple[int, dict[str, Any] | None]:
    """Continue from the checkpoint the job names: weights, optimizer, scheduler and loss scaler from
    DeepSpeed's files; data position and random-number state from this rank's own file. metrics.jsonl
    forgets the steps after the checkpoint (they are trained again). Returns (the checkpoint's step, the
    saved random state to restore last; None on another world size, where no rank's applies).

    On another world size or ZeRO stage: the universal copy, and each rank's data position recomputed
    from the samples all ranks had drawn (launcher.job.reshard)."""
    if job.resume is None:
        return 0, None
    tag, reshard = job.resume.tag, job.resume.reshard
    check_same_groups(read_marker(run_dir, tag), engine, run_dir)
    start_step, position, rng = checkpoint.load(engine.engine, run_dir, tag, reshard)
    for group, built in zip(engine.engine.optimizer.param_groups, engine.groups, strict=True):
        if built.weight_decay is not None:  # the checkpoint restored its own; this job's config decides
            group["weight_decay"] = built.weight_decay
    data.position.epoch, data.position.batches = position.epoch, position.batches
    data.position.records = position.records  # a stream's place (the same world size: job.reshard)
    if reshard is not None:
        data.position.batches = resumed_batches(
            position.batches, reshard.saved_micro_batch, reshard.saved_world_size, engine.micro, rank.world_size
        )
        summary.resharded_from = reshard.to_json()
        if rank.is_main:
            log.info("resumed on another shape: %s (global batch %d kept)", reshard.describe(), reshard.global_batch)
    check_same_dataset(data, position)
    if position.sources is not None:  # a mixture: the same data must resume at the same place in each source
        check_mixture_position(data, position)
    summary.resumed_from_step = start_step
    if rank.is_main:
        checkpoint.truncate_metrics(run_dir, start_step)
        log.info("resumed from %s at step %d", run_dir.checkpoint(tag), start_step)
    return start_step, rng


def check_same_groups(marker: CheckpointMarker, engine: Engine, run_dir: RunDir) -> None:
    """The optimizer's state is saved per group: a resume needs the groups it was saved with (their rates
    and weight decay may change; the schedule and this job's config set those)."""
    now = engine.group_layout()
    if marker.param_groups is not None and marker.param_groups != now:
        saved = ", ".join(str(name) for name, _ in marker.param_groups)
        raise LauncherError(
            f"cannot resume {run_dir.checkpoint(marker.tag)}: its optimizer groups ({saved}) differ from this "
            f"job's ({', '.join(name for name, _ in now)}): train.groups, train.decay_norms_and_biases or "
            "train.weight_decay (zero or not) changed; resume with the groups it was saved with, or start a new run"
        )


def save(run: Run, step: int) -> None:
    """A resumable checkpoint of this step (collective: every rank calls it).

    DeepSpeed stores its config dict in the checkpoint: it stores the one without credentials."""
    if run.data.source_names:
        run.data.position.sources = run.data.mixture_position()
    engine = run.engine.engine
    real = engine.config
    engine.config = credentials.split(real)[0]
    try:
        marker = dataclasses.replace(run.marker, step=step)
        keep = int(run.job.config.train.keep_checkpoints)
        checkpoint.save(engine, run.run_dir, marker, run.data.position, keep=keep, stop=run.stop.wanted)
    finally:
        engine.config = real


# ----------------------------------------------------------------------------- the end
def finish(run: Run, stopped_at: int | None) -> Summary:
    """The last checkpoint, the final model (unless stopped early), and the summary."""
    run.recorder.progress.close()
    steps_done = stopped_at or run.job.max_steps
    if run.profiler is not None:
        run.profiler.close(steps_done)  # a run stopped inside the profiled steps writes what it recorded
        if run.profiler.result is not None:
            run.summary.profile = run.profiler.result.shares()
    if steps_done > run.start_step:  # a resume of a finished run has nothing new to save
        save(run, steps_done)
    if stopped_at is None:
        save_model(run.engine, run.run_dir.inside(run.run_dir.model), run.rank.is_main)
    elif run.rank.is_main:
        log.info("stopped after step %d on %s; resume with resume=%s", steps_done, run.stop.reason(), run.run_dir.path)
    summary, throughput = run.summary, run.state.throughput
    summary.status = "completed" if stopped_at is None else "preempted"
    summary.steps = steps_done
    summary.wall_s = round((summary.earlier_wall_s or 0.0) + time.time() - run.started, 3)
    summary.final_loss = run.state.last_loss
    summary.eval_loss = run.eval_metrics.get("eval/loss")
    summary.eval_accuracy = run.eval_metrics.get("eval/accuracy")
    summary.eval_rewards_accuracy = run.eval_metrics.get("eval/rewards_accuracy")
    summary.eval_rewards_margin = run.eval_metrics.get("eval/rewards_margin")
    summary.samples_per_sec = throughput.per_second(throughput.samples)
    summary.tokens_per_sec = throughput.per_second(throughput.tokens)
    if throughput.seconds:
        measured = Work(throughput.tokens, throughput.padded, throughput.image_tokens, throughput.flops)
        figures = measured.metrics(throughput.seconds, run.state.peak_flops, run.rank.world_size)
        summary.padding_frac = figures["perf/padding_frac"]
        summary.image_token_frac = figures["perf/image_token_frac"]
        summary.model_tflops_per_sec = figures.get("perf/model_tflops_per_sec")
        summary.mfu = figures.get("perf/mfu")
    memory = run.state.memory.read()
    summary.peak_memory_bytes = memory.pop(PEAK)
    summary.memory = {key.removeprefix("mem/"): value for key, value in memory.items()}
    if run.data.source_names:
        summary.samples_per_source = run.data.source_counts()
    summary.objective = getattr(summary, OBJECTIVES[str(run.job.config.objective)])
    if run.rank.is_main:
        run.run_dir.write_summary(summary)
        wandb_line = run.recorder.finish(summary, exit_code=0)
        print(final_table(summary, run.run_dir, wandb_line), flush=True)
    return summary


def save_model(engine: Engine, out: Path, is_main: bool) -> None:
    """The final model and processor in Hugging Face format, loadable by plain transformers.

    At ZeRO-3 the partitioned weights are gathered first (every rank takes part)."""
    ds = engine.engine
    state_dict = ds._zero3_consolidated_16bit_state_dict() if engine.zero_stage == 3 else None
    if is_main:
        # Written next to it and renamed: a failed export (disk full) leaves no model/ that looks complete.
        partial = out.with_name(f".{out.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            with checkpoint.write_failures_reported(out, what="the final model"):
                ds.module.save_pretrained(partial, state_dict=state_dict)
                engine.processor.save_pretrained(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(out, ignore_errors=True)  # a resumed run that had finished before
        os.replace(partial, out)
    barrier()


def _failed(err: BaseException, job: Job, run_dir: RunDir, summary: Summary, track: _Track) -> BaseException:
    """Record how this rank failed (errors/, rank 0's summary and W&B run); the exception to raise."""
    # Stopped by a signal before the first step could (a data cache build stops between its shards).
    status = "interrupted" if isinstance(err, KeyboardInterrupt | Interrupted) else "failed"
    message = one_line(err)
    if not isinstance(err, LauncherError):
        message = f"{type(err).__name__}: {message}"
    if track.in_step is not None:
        message = step_failure(message, track.in_step, job.world_size, summary.zero_stage)
    summary.status, summary.error = status, message
    summary.steps = run_dir.last_recorded_step()  # the last step trained, in every ending
    summary.wall_s = round((summary.earlier_wall_s or 0.0) + time.time() - track.started, 3)
    exit_code = err.exit_code if isinstance(err, LauncherError) else 1
    trace_file = run_dir.rank_traceback(track.rank)
    # Best effort: on a full disk these writes fail too, and must not hide the error itself, which then goes
    # to the rank's output (the launcher's line can only say that the disk is full).
    trace = traceback.format_exc()
    try:
        trace_file = run_dir.with_room(lambda: record_rank_error(run_dir, track.rank, message, exit_code, trace))
    except OSError as write_error:
        print(f"error: rank {track.rank}: {message} ({run_dir.errors} not written: {write_error})", file=sys.stderr)
    run = track.run
    # A resume that failed before its checkpoint loaded has earned no summary: the run's stays as it was.
    if track.rank == 0 and (job.resume is None or (run is not None and run.start_step > 0)):
        with contextlib.suppress(OSError):
            run_dir.with_room(lambda: run_dir.write_summary(summary))
        if run is not None:
            run.recorder.finish(summary, exit_code=1, hint=True)
    if isinstance(err, LauncherError | KeyboardInterrupt):
        return err
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        log.exception("training failed on rank %d", track.rank)
    return TrainingFailed(f"rank {track.rank}: {message} (traceback: {trace_file})")
