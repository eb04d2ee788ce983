"""What `train.py` runs once the config is composed: plan the job, then train or stop.

Order of work: the job spec (world size, device, model facts, the validated DeepSpeed dict: once, in
`launcher.job`), the checks of inputs and memory, the resume decision, then the run directory's files
and the ranks. Every problem a user can fix ends here as one line on stderr and exit code 2 (or,
inside a sweep, as a failed job the sweep records and passes). Planning is once-per-job work: under
SLURM only global rank 0 does it, and the other tasks wait for its plan.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from launcher.core import credentials, logs
from launcher.core.errors import Interrupted, LauncherError, one_line, record_rank_error
from launcher.core.rundir import RunDir, Summary, directory_problem, read_json, write_json_atomic
from launcher.job.length import resolve_training_length
from launcher.job.reshard import Reshard
from launcher.job.resume import argument, is_multirun, runs_a_job
from launcher.job.spec import HydraJob, JobSpec, plain, plan_job, world_size_of

# Exit status of a job stopped by SIGTERM/SIGUSR1 after saving its checkpoint: 128 + SIGTERM, as a
# process killed by SIGTERM would report, so schedulers and `&&` chains see "not finished".
PREEMPTED_EXIT_CODE = 143


def strip_local_rank_argument(argv: list[str] | None = None) -> None:
    """Move DeepSpeed's `--local_rank=N` (which Hydra's parser rejects) into LOCAL_RANK."""
    argv = sys.argv if argv is None else argv
    kept: list[str] = []
    skip_next = False
    for index, arg in enumerate(argv):
        if skip_next:
            skip_next = False
            continue
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and index + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[index + 1])
            skip_next = True
        else:
            kept.append(arg)
    argv[:] = kept


def check_output_dir_argument(argv: list[str] | None = None) -> None:
    """Refuse, in one line and before Hydra tries, a hydra.run.dir (hydra.sweep.dir) that cannot be made.

    Hydra would fail creating it with a traceback and exit code 1. Only a directory given on the
    command line is checked; an interpolation (`${now:...}`) is checked up to where it starts."""
    argv = sys.argv if argv is None else argv
    if not runs_a_job(argv):
        return  # prints a config or help; creates no directory
    key = "hydra.sweep.dir" if is_multirun(argv) else "hydra.run.dir"
    value = argument(argv, key)
    fixed = (value or "").split("${", 1)[0]
    if fixed != value:  # an interpolation: check the folder its fixed part names, if any
        fixed = fixed.rsplit("/", 1)[0] if "/" in fixed else ""
    problem = directory_problem(Path(fixed)) if fixed else None
    if problem:
        print(f"error: {key}={value}: cannot create it ({problem}); choose a directory you can write", file=sys.stderr)
        sys.exit(LauncherError.exit_code)
    if key == "hydra.run.dir" and value and value == fixed and _owns_run_dir(argv):
        # Before Hydra writes its .hydra/ files there: a second job must not replace the first one's.
        claim_or_exit(RunDir(Path(value).expanduser()), key, multirun=False)
    resume = argument(argv, "resume")
    if key == "hydra.run.dir" and value == fixed and value and resume in (None, "null", ""):
        # A new job in a finished (or crashed) run's directory would append to its metrics and leave
        # its checkpoints and model/ looking like this job's; Hydra has not touched it yet.
        run_dir = RunDir(Path(value).expanduser())
        held = [path.name for path in (run_dir.metrics, run_dir.checkpoints) if path.exists()]
        if held:
            print(
                f"error: hydra.run.dir={value} already holds a run ({', '.join(held)}): continue it with "
                f"resume={value} (or resume=auto), or choose a new directory",
                file=sys.stderr,
            )
            sys.exit(LauncherError.exit_code)


def _owns_run_dir(argv: list[str]) -> bool:
    """Whether this process is the one that owns the run directory: not another node's launcher
    (dist.node_rank > 0) nor a SLURM task other than the first; they share rank 0's directory."""
    node_rank = argument(argv, "dist.node_rank")
    return node_rank in (None, "0") and os.environ.get("SLURM_PROCID", "0") == "0"


def claim_or_exit(run_dir: RunDir, key: str, *, multirun: bool) -> bool:
    """Own the run directory, or say in one line that another job does (and leave its files alone)."""
    problem = run_dir.claim()
    if problem is None:
        return True
    print(
        f"error: {key}={run_dir.path}: {problem}; wait for it to end, or choose another directory",
        file=sys.stderr,
    )
    if multirun:
        return False
    sys.exit(LauncherError.exit_code)


def resume_tag(cfg: DictConfig, spec: JobSpec) -> str | None:
    """The checkpoint tag this job resumes from (None: a fresh start); refuses an incompatible one."""
    from launcher.train.checkpoint import complete_tags, find_resume_tag

    if not cfg.resume:
        return None
    run_dir = RunDir(spec.hydra.run_dir)
    wanted = run_dir.path if cfg.resume == "auto" else Path(cfg.resume).expanduser()
    if not wanted.is_dir():
        raise LauncherError(f"resume={cfg.resume}: no such directory; give the run directory of the run to continue")
    if wanted.resolve() != run_dir.path.resolve():
        raise LauncherError(
            f"resume={cfg.resume}: {wanted} is not a run directory (no .hydra/overrides.yaml); give the run "
            "directory of the run to continue"
        )
    tag = find_resume_tag(run_dir.checkpoints, warn=lambda line: print(f"warning: {line}", file=sys.stderr))
    if tag is None and complete_tags(run_dir.checkpoints):  # never start afresh over damaged checkpoints
        raise LauncherError(
            f"resume={cfg.resume}: every checkpoint in {run_dir.checkpoints} is damaged (a file differs from "
            "its size at save, named above); start a new run instead"
        )
    if tag is None and cfg.resume != "auto":
        raise LauncherError(
            f"resume={cfg.resume}: no complete checkpoint in {run_dir.checkpoints} (the run saved none, "
            "or was killed before its first save finished); start a new run instead"
        )
    if tag is None:
        print(f"resume=auto: no checkpoint in {run_dir.checkpoints}, starting fresh", file=sys.stderr)
        if not cfg.dry_run and cfg.dist.node_rank == 0:
            run_dir.metrics.unlink(missing_ok=True)  # steps of a segment killed before its first save
        return None
    return tag


def check_resumable(cfg: DictConfig, run_dir: RunDir, tag: str, spec: JobSpec) -> Reshard | None:
    """Refuse, in one line, to resume a checkpoint written by a different model, method or precision, or
    on a shape it cannot continue on; the reshard when the world size or ZeRO stage differs."""
    from launcher.job.reshard import reshard_for
    from launcher.train.checkpoint import incompatibilities, read_marker

    marker = read_marker(run_dir.checkpoints, tag)
    current = {
        "world_size": spec.world_size,
        "zero_stage": spec.zero_stage,
        "precision": spec.precision,
        "model": spec.model,
        "method": spec.method,
    }
    differences = incompatibilities(marker, current)
    if differences:
        raise LauncherError(
            f"cannot resume {run_dir.checkpoints / tag}: the job differs from the one that saved it "
            f"({'; '.join(differences)}); resume with the same settings, or start a new run"
        )
    offload = (spec.ds_config["zero_optimization"].get("offload_optimizer") or {}).get("device")
    return reshard_for(
        marker,
        {
            **current,
            "global_batch": int(spec.ds_config["train_batch_size"]),
            "offload_optimizer": None if offload in (None, "none") else str(offload),
            "data": plain(cfg.data),
        },
    )


def convert_for_reshard(run_dir: RunDir, spec: JobSpec, *, node_rank: int = 0, wait_s: float = 1800) -> None:
    """Make the universal copy of the checkpoint a reshard resumes from (once; launcher.universal).
    Node 0's launcher converts; the other nodes' wait for its copy (a run directory all nodes share)."""
    from launcher.train import universal
    from launcher.train.checkpoint import read_marker

    reshard = Reshard.from_json(spec.reshard or {})
    tag = str(spec.resume_tag)
    if not reshard.converts:
        print(f"resume: {reshard.describe()}: the ZeRO-0 checkpoint loads as it is", file=sys.stderr)
        return
    out = universal.universal_path(run_dir.checkpoints, tag)
    deadline = time.time() + wait_s
    while node_rank > 0 and not universal.is_universal(out):
        if time.time() > deadline:
            raise LauncherError(
                f"node {node_rank}: node 0 did not convert {run_dir.checkpoints / tag} to {out} within "
                f"dist.timeout_s={wait_s:g} s; the run directory must be on a disk every node shares"
            )
        time.sleep(1)
    if universal.is_universal(out):
        print(f"resume: {reshard.describe()} from its universal copy {out}", file=sys.stderr)
        return
    started = time.time()
    marker = read_marker(run_dir.checkpoints, tag)
    try:
        universal.ensure_universal(run_dir.checkpoints, tag, reshard.saved_zero_stage, marker.get("param_names"))
    except (OSError, ValueError, KeyError, RuntimeError, AssertionError) as err:
        raise LauncherError(
            f"cannot convert {run_dir.checkpoints / tag} for {reshard.describe()} ({type(err).__name__}: "
            f"{one_line(err)}); the checkpoint itself is unchanged: resume with its world size and ZeRO stage"
        ) from err
    print(
        f"resume: {reshard.describe()}: converted {run_dir.checkpoints / tag} to {out} "
        f"in {time.time() - started:.1f} s",
        file=sys.stderr,
    )


def already_finished(cfg: DictConfig, spec: JobSpec) -> Summary | None:
    """The summary of a completed run that a resume would continue with nothing left to train.

    A checkpoint past train.max_steps is refused: training would not run, and the summary would claim
    fewer steps than the weights have seen."""
    if spec.resume_tag is None:
        return None
    from launcher.train.checkpoint import read_marker

    run_dir = RunDir(spec.hydra.run_dir)
    step = int(read_marker(run_dir.checkpoints, spec.resume_tag)["step"])
    if step > int(cfg.train.max_steps):
        raise LauncherError(
            f"train.max_steps={cfg.train.max_steps} is below step {step} of the checkpoint {spec.resume_tag} this "
            f"resume continues: give train.max_steps={step} or more (or start a new run)"
        )
    summary = run_dir.read_summary()
    if step == int(cfg.train.max_steps) and summary is not None and summary.status == "completed":
        return summary
    return None


def announce_schedule_change(run_dir: RunDir, spec: JobSpec) -> None:
    """One line when the resumed job's learning-rate schedule is not the checkpoint's (another
    train.max_steps re-stretches it: DeepSpeed restores only the scheduler's step count)."""
    from launcher.train.checkpoint import read_marker, schedule_change

    line = schedule_change(read_marker(run_dir.checkpoints, str(spec.resume_tag)), spec.ds_config)
    if line is not None:
        print(line, file=sys.stderr)


def check_inputs(cfg: DictConfig, spec: JobSpec, *, launching: bool) -> None:
    """What the ranks would stop on, checked here so that it stops the job before any rank starts.

    Data files and loader settings, the cache directory, a local model directory's weights, a tiny
    model's records (read anyway for its vocabulary), the method (adapter targets, 4-bit loading), the
    attention kernel and image resolution, and whether this machine has a device for every
    rank it would start (not for a dry run, which may plan a job for a bigger machine)."""
    from launcher.job.checks import (
        check_cache_dir,
        check_data,
        check_local_ranks,
        check_model_choices,
        check_model_files,
        check_tiny_model_records,
    )
    from launcher.model.method import check_adapter_targets, check_method, uses_adapters
    from launcher.model.stats import frozen_meta_model

    check_data(cfg.data)
    check_cache_dir(cfg)
    check_model_files(cfg.model)
    check_tiny_model_records(
        cfg, micro_batch=spec.ds_config["train_micro_batch_size_per_gpu"], world_size=spec.world_size
    )
    check_method(cfg, spec.device.kind, launching=launching)
    if uses_adapters(cfg.method):
        check_adapter_targets(frozen_meta_model(cfg), cfg)
    check_model_choices(cfg, spec.device.kind, spec.precision, launching=launching)
    if launching:
        check_local_ranks(cfg.dist, spec.device.kind)


def check_memory(cfg: DictConfig, spec: JobSpec) -> None:
    """The planner's estimate for this job, before any process starts (`preflight=warn|error|off`)."""
    if cfg.preflight == "off":
        return
    from launcher.plan.report import preflight

    try:
        problem = preflight(cfg, spec)
    except LauncherError as err:
        if cfg.preflight == "error":
            raise
        print(f"warning: memory plan skipped ({one_line(err)})", file=sys.stderr)
        return
    if problem and cfg.preflight == "error":
        raise LauncherError(f"{problem} (preflight=error; preflight=warn only warns)")
    if problem:
        print(f"warning: {problem}", file=sys.stderr)


def run_job(
    cfg: DictConfig, hydra: HydraJob | None = None, *, on_accept: Callable[[], None] | None = None
) -> float | None:
    """Plan, then train (or only print the plan with dry_run=true). Returns the sweep objective.

    `hydra` describes the job (default: the one Hydra runs now). `on_accept` runs once the job is
    accepted, before anything is written into the run directory (a resume writes its .hydra files)."""
    stop_during_start_up()
    logs.route_library_logs()  # before deepspeed is imported (planning imports it)
    logs.quiet_transformers()  # building a tiny model saves it here
    from launcher.launch.ranks import slurm_global_rank

    hydra = hydra or HydraJob.from_hydra()
    run_dir = RunDir(hydra.run_dir)
    if slurm_global_rank(cfg) not in (None, 0):
        return None if cfg.dry_run else _follow_rank_zero(cfg, run_dir)
    if cfg.dist.node_rank == 0 and not claim_or_exit(run_dir, "hydra.run.dir", multirun=hydra.multirun):
        return math.nan
    started = time.time()
    accepted = False
    try:
        if (length := resolve_training_length(cfg, world_size_of(cfg))) is not None:
            print(length, file=sys.stderr)
        spec = plan_job(cfg, hydra)
        check_inputs(cfg, spec, launching=not cfg.dry_run)
        check_memory(cfg, spec)
        if (tag := resume_tag(cfg, spec)) is not None:
            reshard = check_resumable(cfg, run_dir, tag, spec)
            spec = spec.with_resume(tag, None if reshard is None else reshard.to_json())
        if (finished := already_finished(cfg, spec)) is not None:
            print(
                f"resume: {run_dir.path} already finished at step {finished.steps} (train.max_steps="
                f"{cfg.train.max_steps}); nothing to train: raise train.max_steps to train further",
                file=sys.stderr,
            )
            return math.nan if finished.objective is None else float(finished.objective)
        if spec.resume_tag is not None:
            announce_schedule_change(run_dir, spec)
        if spec.reshard is not None and not cfg.dry_run:
            # Before the resume is accepted (a failed conversion leaves the run as it was), and before the
            # plan is written (other nodes' launchers and SLURM tasks start on the plan).
            convert_for_reshard(run_dir, spec, node_rank=int(cfg.dist.node_rank), wait_s=float(cfg.dist.timeout_s))
        accepted = True
        if on_accept is not None and not cfg.dry_run:
            # A dry run of a resume only shows the plan: the run's own command line (.hydra/) stays, or
            # the next resume would compose dry_run=true back in.
            on_accept()
        secret_env = write_plan(cfg, spec, run_dir)
        if cfg.dry_run:
            return None
        print(spec.describe(), file=sys.stderr, flush=True)
        from launcher.launch.ranks import launch

        summary = launch(cfg, spec, secret_env)
    except LauncherError as err:
        message = one_line(err)
        if accepted or on_accept is None:  # a refused resume leaves the run it would have continued as it was
            _record_failure(cfg, run_dir, hydra, err, started)
        print(f"error: {message}", file=sys.stderr)
        if hydra.multirun:
            # The sweep records the failure and goes on (it exits non-zero at the end); NaN marks
            # the trial as failed for optimising sweepers such as Optuna.
            return math.nan
        sys.exit(err.exit_code)
    if summary.status == "preempted":
        print(f"preempted after step {summary.steps}: resume with resume={run_dir.path}", file=sys.stderr)
        if not hydra.multirun:
            sys.exit(PREEMPTED_EXIT_CODE)
        return math.nan
    return math.nan if summary.objective is None else float(summary.objective)


def write_plan(cfg: DictConfig, spec: JobSpec, run_dir: RunDir) -> dict[str, str]:
    """The accepted job's files (ds_config.json; job.json unless a dry run, which prints the dict).

    Credentials stay out of every file, Hydra's included; the returned environment entry hands the
    config's real values to the ranks."""
    from launcher.launch.ranks import launch_id

    public_cfg, cfg_secrets = credentials.split(plain(cfg))
    credentials.redact_hydra_files(run_dir.hydra, public_cfg if cfg_secrets else None)
    public_ds = credentials.split(spec.ds_config)[0]
    write_json_atomic(run_dir.ds_config, public_ds)
    if cfg.dry_run:
        print(json.dumps(public_ds, indent=2))
        print(f"dry run: wrote {run_dir.ds_config}; nothing trained", file=sys.stderr)
    else:
        # max_steps: the ranks read Hydra's config, where a length given in epochs is still null.
        job = {**spec.to_json(), "launch_id": launch_id(cfg), "max_steps": int(cfg.train.max_steps)}
        write_json_atomic(run_dir.job, credentials.split(job)[0])
    return credentials.for_ranks(cfg_secrets)


def _record_failure(cfg: DictConfig, run_dir: RunDir, hydra: HydraJob, err: LauncherError, started: float) -> None:
    """The failed summary, and (under SLURM) the record the other tasks wait on instead of a plan."""
    from launcher.launch.ranks import launch_id

    message = one_line(err)
    job = credentials.split({"overrides": list(hydra.overrides), "choices": dict(hydra.choices)})[0]
    summary = run_dir.read_summary() or Summary.for_job(job)
    # A resume that failed before its ranks took the run over (they write "running" once its checkpoint
    # has loaded) earned no summary: the run's says how it last ended, and stays.
    if not (cfg.resume and summary.status in ("completed", "preempted")):
        status = "interrupted" if isinstance(err, Interrupted) else "failed"
        summary.failed(message, wall_s=time.time() - started, status=status)
        run_dir.write_summary(summary)
    if cfg.dist.launcher == "slurm":
        record_rank_error(run_dir.path, 0, message, err.exit_code, traceback.format_exc(), launch=launch_id(cfg))


def stop_during_start_up() -> None:
    """SIGTERM or SIGINT while the job is planned: stop with status "interrupted", no traceback.

    Once the ranks run, the launcher passes these signals on to them as a stop request instead
    (launcher.processes), and they stop at the next step boundary with a checkpoint."""

    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(f"stopped by {signal.Signals(signum).name} before training started; start the job again")

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, interrupt)


def _follow_rank_zero(cfg: DictConfig, run_dir: RunDir) -> float | None:
    """A SLURM task other than global rank 0: wait for rank 0's plan of this launch, then train.

    Rank 0 writes job.json (carrying this launch's id) when its plan is accepted, or its error record
    when planning failed; both are on the shared file system every task sees."""
    from launcher.launch.ranks import launch_id, train_as_slurm_task

    wanted = launch_id(cfg)
    deadline = time.time() + float(cfg.dist.timeout_s)
    while time.time() < deadline:
        job = _read_optional_json(run_dir.job)
        if job is not None and job.get("launch_id") == wanted:
            summary = train_as_slurm_task(cfg, run_dir.path, int(job["world_size"]))
            return math.nan if summary.objective is None else float(summary.objective)
        failure = _read_optional_json(run_dir.errors / "rank0.json")
        if failure is not None and failure.get("launch") == wanted:
            print(f"error: {failure['error']}", file=sys.stderr)
            sys.exit(int(failure.get("exit_code", 1)))
        time.sleep(0.2)
    print(
        f"error: global rank 0 did not plan the job within dist.timeout_s={cfg.dist.timeout_s} s "
        f"(no {run_dir.job} for launch {wanted}); see rank 0's log",
        file=sys.stderr,
    )
    sys.exit(1)


def _read_optional_json(path: Path) -> dict | None:
    try:
        data = read_json(path)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def keep_global_batch(run_dir: RunDir, cfg: DictConfig, argv: list[str]) -> list[str]:
    """The batch overrides a resume on another world size needs to keep the checkpoint's global batch
    (accumulation adjusted; none when the world size is the checkpoint's). They join the resumed
    command line, so the run's overrides.yaml records them and a later resume keeps them too."""
    from launcher.job.reshard import batch_overrides
    from launcher.train.checkpoint import find_resume_tag, read_marker

    tag = find_resume_tag(run_dir.checkpoints, warn=lambda line: None)  # resume_tag() warns, later
    if tag is None:
        return []
    marker = read_marker(run_dir.checkpoints, tag)
    world_size = world_size_of(cfg)
    if marker.get("world_size") == world_size or marker.get("global_batch") is None:
        return []
    keys = ("train.micro_batch_size", "train.grad_accum", "train.global_batch_size")
    given = {key: value for key in keys if (value := argument(argv, key)) not in (None, "null")}
    kept = batch_overrides(int(marker["global_batch"]), int(marker["micro_batch"]), world_size, given)
    if kept == [
        f"train.micro_batch_size={cfg.train.micro_batch_size}",
        "train.grad_accum=null",
        f"train.global_batch_size={cfg.train.global_batch_size}",
    ]:
        return []
    print(
        f"resume: on {world_size} rank(s) (saved on {marker['world_size']}), the checkpoint's global batch "
        f"{marker['global_batch']} is kept: {' '.join(kept)}",
        file=sys.stderr,
    )
    return kept


def run_resumed(run_dir: Path, argv: list[str]) -> int:
    """`train.py resume=...`: compose the continued job (launcher.resume) and run it; the exit code."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from launcher.job.resume import compose_resumed

    claim_or_exit(RunDir(run_dir), "resume", multirun=False)
    try:
        resumed = compose_resumed(run_dir, argv)
        if kept := keep_global_batch(RunDir(run_dir), resumed.cfg, argv):
            resumed = compose_resumed(run_dir, [*argv, *kept])
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except LauncherError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    os.environ.update({str(k): str(v) for k, v in (resumed.hydra_cfg.job.env_set or {}).items()})
    run_job(resumed.cfg, resumed.job, on_accept=resumed.write_hydra_files)
    return 0
