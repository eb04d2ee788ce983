"""Run one job: plan it, check it, decide its resume, write its run directory, start its ranks.

    outcome = run_job(cfg, HydraJob.from_hydra())     # what train.py does inside Hydra's job

Order of work: the config's ranges; the training length; the job (world size, device, model facts, the
validated DeepSpeed dict, the model path: once, launcher.job.planning); the checks of inputs and
memory; the resume decision (launcher.job.resume); then the run directory's files and the ranks.
`run_job` returns an `Outcome` and never exits, prints an error or leaves a signal handler behind:
train.py turns the outcome into lines and an exit code, the tuner reads it as a value. Every problem a
user can fix ends as `Outcome.error`, one line, with exit code 2; under SLURM only global rank 0 plans,
and the other tasks wait for its plan (launcher.launch.slurm).
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher.config.compose import check_keys
from launcher.config.ranges import check_config
from launcher.config.schema import Config, typed
from launcher.core import credentials, logs
from launcher.core.checkpoints import read_marker
from launcher.core.disk import free_space
from launcher.core.errors import DeviceLacks, Interrupted, LauncherError, TrainingFailed, one_line
from launcher.core.json_files import write_json_atomic
from launcher.core.rank_errors import record_rank_error
from launcher.core.rundir import RunDir
from launcher.core.signals import STOP_SIGNALS, handling, name, pause_for_test, received, remember
from launcher.core.summary import Summary
from launcher.job import resume
from launcher.job.checks import check_inputs
from launcher.job.planning import job_credentials, plan_job, training_length
from launcher.job.spec import HydraJob, Job, read_job
from launcher.launch import slurm
from launcher.launch.base import pretrained_base
from launcher.launch.ranks import start_ranks
from launcher.model.method import adapters_on_random_base
from launcher.model.stats import model_dir
from launcher.plan.report import preflight_plan
from launcher.train import universal

# Exit status of a job stopped by SIGTERM/SIGUSR1 after saving its checkpoint: 128 + SIGTERM, as a
# process killed by SIGTERM would report, so schedulers and `&&` chains see "not finished".
PREEMPTED_EXIT_CODE = 143


@dataclass(frozen=True)
class Outcome:
    """How a job ended: what train.py prints and exits with, and what a sweep or the tuner reads."""

    run_dir: Path
    # completed | preempted | failed | interrupted | planned (a dry run) | finished (nothing left) | skipped (a
    # sweep's point this device cannot run)
    status: str
    exit_code: int = 0
    error: str | None = None  # the one line of a job that failed
    summary: Summary | None = None
    ds_config: dict[str, Any] | None = None  # a dry run's dict, credentials left out

    @property
    def objective(self) -> float | None:
        """What a sweep optimises: the summary's objective; NaN for a job that did not complete (so that
        optimising sweepers such as Optuna mark the trial failed); None for a dry run."""
        if self.status == "planned":
            return None
        if self.status not in ("completed", "finished") or self.summary is None or self.summary.objective is None:
            return math.nan
        return float(self.summary.objective)

    def lines(self) -> list[tuple[str, bool]]:
        """(line, to stderr) to show once the job is over: its error, a preemption, a dry run's dict."""
        if self.error is not None:
            return [(f"{'skipped' if self.status == 'skipped' else 'error'}: {self.error}", True)]
        if self.status == "preempted" and self.summary is not None:
            return [(f"preempted after step {self.summary.steps}: resume with resume={self.run_dir}", True)]
        if self.status == "planned" and self.ds_config is not None:
            return [
                (json.dumps(self.ds_config, indent=2), False),
                (f"dry run: wrote {RunDir(self.run_dir).ds_config}; nothing trained", True),
            ]
        return []


def to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_job(
    cfg: DictConfig,
    hydra: HydraJob,
    *,
    say: Callable[[str], None] = to_stderr,
    rank_env: Mapping[str, str] | None = None,
    output: Path | None = None,
    start: Callable[..., Summary] = start_ranks,
) -> Outcome:
    """Plan, then train (or only plan, with dry_run=true). `say` gets the launcher's own lines (what it
    decided, warnings); `rank_env` joins the ranks' environment; `output` is a file for the ranks' output
    (the terminal otherwise). `start` starts the ranks and returns rank 0's summary: child processes
    (launcher.launch.ranks.start_ranks); a test may train its one rank in its own process instead."""
    logs.route_library_logs()  # before deepspeed is imported (planning imports it)
    logs.quiet_transformers()  # building a tiny model saves it here
    if hydra.multirun and hydra.node is not None:  # Hydra wrote the sweep's command line, secrets included
        credentials.scrub_file(Path(hydra.node.sweep.dir) / "multirun.yaml")
    run_dir = RunDir(hydra.run_dir)
    config_dist = cfg.dist
    if slurm.global_rank(config_dist) not in (None, 0):
        return _follow_rank_zero(cfg, hydra, run_dir, rank_env or {}, output)
    if int(config_dist.node_rank) == 0 and (problem := run_dir.claim()) is not None:
        return Outcome(run_dir.path, "failed", 2, f"hydra.run.dir={run_dir.path}: {problem}")
    attempt = _Attempt(cfg, hydra, run_dir, say)
    try:
        with handling(STOP_SIGNALS, _interrupt):
            job, plan_env = attempt.plan()
    except LauncherError as err:
        return attempt.failed(err)
    except (HydraException, OmegaConfBaseException) as err:  # a resume's old command line no longer composes
        return Outcome(run_dir.path, "failed", 1, one_line(err))
    except OSError as err:
        if (cannot := _cannot_write(err, run_dir.path)) is None:
            raise
        return attempt.failed(cannot)
    except Exception as err:
        # A stop signal inside an import (transformers' lazy modules re-raise it as a RuntimeError) is still
        # the stop, not a failure of the import.
        if (stop := _interruption_behind(err)) is None:
            raise
        return attempt.failed(stop)
    if attempt.done is not None:
        return attempt.done
    say(job.describe())
    try:
        summary = start(job, run_dir, env={**plan_env, **(rank_env or {})}, output=output)
    except LauncherError as err:
        return attempt.failed(err)
    except OSError as err:
        if (cannot := _cannot_write(err, run_dir.path)) is None:
            raise
        return attempt.failed(cannot)
    return _ended(run_dir, summary)


# What a write that fails for want of room or permission raises: the disk's problem, not the program's.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def _cannot_write(err: OSError, run_dir: Path) -> TrainingFailed | None:
    """A full, over-quota or read-only disk met while the launcher writes the run dir, as one line."""
    if err.errno not in _DISK_ERRNOS:
        return None
    where = Path(str(err.filename)) if err.filename else run_dir
    facts = [err.strerror or str(err)]
    free = free_space(where.parent)
    if free is not None:
        facts.append(f"{free} there")
    return TrainingFailed(
        f"cannot write {where} ({'; '.join(facts)}): free disk space, or put hydra.run.dir on a writable disk with "
        "room; nothing incomplete is resumed from"
    )


def _interruption_behind(err: BaseException) -> Interrupted | None:
    """The stop signal's Interrupted among the causes of `err`, if one is."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, Interrupted):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _ended(run_dir: RunDir, summary: Summary) -> Outcome:
    """The outcome of ranks that ran to their end: completed, or preempted (saved, exit code 143)."""
    if summary.status == "preempted":
        return Outcome(run_dir.path, "preempted", PREEMPTED_EXIT_CODE, summary=summary)
    return Outcome(run_dir.path, "completed", summary=summary)


class _Attempt:
    """One start of a job, from its config to its accepted plan (the steps `run_job` takes before its ranks
    start), and how it failed when it did."""

    def __init__(self, cfg: DictConfig, hydra: HydraJob, run_dir: RunDir, say: Callable[[str], None]) -> None:
        self.cfg, self.hydra, self.run_dir, self.say = cfg, hydra, run_dir, say
        self.started = time.time()
        self.continued: resume.Continued | None = None
        self.accepted = False  # a resume is accepted once nothing can refuse it any more
        self.config: Config | None = None
        self.done: Outcome | None = None  # the job ended before its ranks: a dry run, a finished run

    def plan(self) -> tuple[Job, dict[str, str]]:
        """The accepted job and what joins its ranks' environment: the entry that hands them its credentials,
        and on a resume the first run's `hydra.job.env_set`."""
        self.continued = resume.continued(self.cfg, self.hydra)
        cfg, hydra = (self.cfg, self.hydra) if self.continued is None else (self.continued.cfg, self.continued.hydra)
        for note in self.continued.notes if self.continued else ():
            self.say(note)
        check_keys(cfg)  # a key a `+` added that nothing reads: refused before anything is written
        if self.continued is None:
            self.accepted = True  # a new job: nothing of an earlier run to leave as it was
            _write_hydra_files(self.run_dir, cfg, hydra)
        if (signal_name := received()) is not None:  # it came before this launcher's handlers were in place
            raise _stopped_before_training(signal_name)
        self.config = config = typed(cfg)
        check_config(config)
        config, length = training_length(config)
        if length is not None:
            self.say(length)
        job = plan_job(config, hydra).replace(launch_id=slurm.launch_id(config.dist))
        check_inputs(config, job, launching=not config.dry_run)
        if (warning := adapters_on_random_base(config)) is not None:
            self.say(f"warning: {warning}")
        job = job.replace(model_path=model_dir(config))  # a tiny model is built here, once, for every rank
        pause_for_test("plan")  # the tests' stop signals land here (a no-op otherwise)
        job = job.replace(planned_memory_bytes=_check_memory(config, job, self.say))
        job = self._resume(config, job, cfg, hydra)
        if self.done is not None:  # a finished run: nothing to plan, and its files stay as they are
            return job, {}
        # A tiny model's pretrained base (model.tiny_base; its architecture is the tiny build's, which the memory
        # check read) is trained once the job is accepted: a refused resume spends nothing on it.
        job = job.replace(model_path=pretrained_base(config, job.model_path, self.say))
        replayed = dict(self.continued.environment) if self.continued is not None else {}
        return job, {**replayed, **self._write_plan(job)}

    def _resume(self, config: Config, job: Job, cfg: DictConfig, hydra: HydraJob) -> Job:
        """The job with what it continues from; a finished run ends the attempt here (`done`)."""
        plan = resume.decide(config, job, warn=lambda line: self.say(f"warning: {line}"))
        if plan is None:
            return job
        for note in plan.notes:
            self.say(note)
        if plan.starts_over and not config.dry_run and config.dist.node_rank == 0:
            self.run_dir.metrics.unlink(missing_ok=True)  # steps of a segment killed before its first save
        if plan.finished is not None:
            self.say(
                f"resume: {self.run_dir.path} already finished at step {plan.finished.steps} (train.max_steps="
                f"{job.max_steps}); nothing to train: raise train.max_steps to train further"
            )
            self.done = Outcome(self.run_dir.path, "finished", summary=plan.finished)
            return job
        job = job.replace(resume=plan.resume)
        if plan.resume is not None and plan.resume.reshard is not None and not config.dry_run:
            # Before the resume is accepted (a failed conversion leaves the run as it was), and before the
            # plan is written (other nodes' launchers and SLURM tasks start on the plan).
            _convert_for_reshard(self.run_dir, plan.resume, config, self.say)
        self.accepted = True
        if self.continued is not None and not config.dry_run:
            # A dry run of a resume only shows the plan: the run's own command line (.hydra/) stays, or
            # the next resume would compose dry_run=true back in.
            _write_hydra_files(self.run_dir, cfg, hydra, node=self.continued.hydra_node)
        return job

    def _write_plan(self, job: Job) -> dict[str, str]:
        """The accepted job's files (ds_config.json; job.json unless a dry run) without credentials; the
        environment entry that hands the ranks the real values."""
        public_ds = credentials.split(job.ds_config)[0]
        write_json_atomic(self.run_dir.ds_config, public_ds)
        if job.config.dry_run:
            self.done = Outcome(self.run_dir.path, "planned", ds_config=public_ds)
            return {}
        public_job, secrets = credentials.split(job.to_json())
        write_json_atomic(self.run_dir.job, public_job)
        return credentials.for_ranks(secrets)

    def failed(self, err: LauncherError) -> Outcome:
        """The outcome of a job refused or failed: its summary (unless a refused resume, which leaves the run
        as it was) and, under SLURM, the record the other tasks wait on instead of a plan."""
        if os.environ.get("HYDRA_FULL_ERROR") == "1":  # the traceback behind the one line, as docs/errors.md says
            self.say(traceback.format_exc().rstrip())
        message = one_line(err)
        status = "interrupted" if isinstance(err, Interrupted) else "failed"
        if isinstance(err, DeviceLacks) and self.hydra.multirun:  # one point of the sweep this device lacks
            status = "skipped"
        if self.accepted:
            labels, _ = credentials.split(
                {"overrides": list(self.hydra.overrides), "choices": dict(self.hydra.choices)}
            )
            summary = self.run_dir.read_summary() or Summary.planned(**labels)
            # A resume that failed before its ranks took the run over (they write "running" once its checkpoint
            # has loaded) earned no summary: the run's says how it last ended, and stays.
            if not (self.cfg.get("resume") and summary.status in ("completed", "preempted")):
                summary.failed(message, wall_s=time.time() - self.started, status=status)
                summary.steps = self.run_dir.last_recorded_step()  # a killed rank recorded none: its metrics say
                try:
                    self.run_dir.with_room(lambda: self.run_dir.write_summary(summary))
                except OSError as write_error:  # a full or read-only disk: the cause's line still reaches the user
                    message += f"; {self.run_dir.summary} could not be written ({write_error.strerror or write_error})"
        if str(self.cfg.dist.launcher) == "slurm":
            launch = slurm.launch_id(self.cfg.dist)
            record_rank_error(self.run_dir, 0, message, err.exit_code, traceback.format_exc(), launch=launch)
        return Outcome(self.run_dir.path, status, err.exit_code, message)


def _write_hydra_files(run_dir: RunDir, cfg: DictConfig, hydra: HydraJob, *, node: Any = None) -> None:
    """The job's `.hydra/` files (launcher.core.rundir.RunDir.write_hydra_files), credentials left out."""
    config = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    node = node if node is not None else hydra.node
    if node is not None:
        hydra_node = (
            OmegaConf.to_container(node, resolve=False, enum_to_str=True)
            if isinstance(node, DictConfig)
            else dict(node)
        )
    else:  # a job started outside Hydra's own run (the tuner, a test): what the comparison reads
        hydra_node = {"runtime": {"choices": dict(hydra.choices)}, "overrides": {"task": list(hydra.overrides)}}
    run_dir.write_hydra_files(
        credentials.redact(config),
        credentials.redact(hydra_node),
        [credentials.recorded_override(str(item)) for item in hydra.overrides],
    )


def _check_memory(config: Config, job: Job, say: Callable[[str], None]) -> int | None:
    """The planner's estimate for this job, before any process starts (`preflight=warn|error|off`): its
    bytes per rank (None when off or not estimated)."""
    if str(config.preflight) == "off":
        return None
    try:
        problem, planned = preflight_plan(config, job)
    except LauncherError as err:
        if str(config.preflight) == "error" or isinstance(err, Interrupted):  # a stop signal is no planner error
            raise
        say(f"warning: memory plan skipped ({one_line(err)})")
        return None
    if problem and str(config.preflight) == "error":
        raise LauncherError(f"{problem} (preflight=error; preflight=warn only warns)")
    if problem:
        say(f"warning: {problem}")
    return planned


def _convert_for_reshard(run_dir: RunDir, plan: Any, config: Config, say: Callable[[str], None]) -> None:
    """Make the universal copy of the checkpoint a reshard resumes from (once; launcher.train.universal).
    Node 0's launcher converts; the other nodes' wait for its copy (a run directory all nodes share)."""
    reshard, tag = plan.reshard, plan.tag
    node_rank, wait_s = int(config.dist.node_rank), float(config.dist.timeout_s)
    if not reshard.converts:
        say(f"resume: {reshard.describe()}: the ZeRO-0 checkpoint loads as it is")
        return
    out = run_dir.universal(tag)
    deadline = time.time() + wait_s
    while node_rank > 0 and not universal.is_universal(out):
        if time.time() > deadline:
            raise LauncherError(
                f"node {node_rank}: node 0 did not convert {run_dir.checkpoint(tag)} to {out} within "
                f"dist.timeout_s={wait_s:g} s; the run directory must be on a disk every node shares"
            )
        time.sleep(1)
    if universal.is_universal(out):
        say(f"resume: {reshard.describe()} from its universal copy {out}")
        return
    started = time.time()
    try:
        universal.ensure_universal(run_dir, tag, reshard.saved_zero_stage, read_marker(run_dir, tag).param_names)
    except (OSError, ValueError, KeyError, RuntimeError, AssertionError) as err:
        raise LauncherError(
            f"cannot convert {run_dir.checkpoint(tag)} for {reshard.describe()} ({type(err).__name__}: "
            f"{one_line(err)}); the checkpoint itself is unchanged: resume with its world size and ZeRO stage"
        ) from err
    say(f"resume: {reshard.describe()}: converted {run_dir.checkpoint(tag)} to {out} in {time.time() - started:.1f} s")


def _follow_rank_zero(
    cfg: DictConfig, hydra: HydraJob, run_dir: RunDir, rank_env: Mapping[str, str], output: Path | None
) -> Outcome:
    """A SLURM task other than global rank 0: wait for rank 0's plan of this launch, then start its rank.

    job.json holds no credentials: this task hands its rank its own (the same command line's), and on a resume
    the first run's `hydra.job.env_set` entries, as the planning task does."""
    config = typed(cfg)
    if config.dry_run:
        return Outcome(run_dir.path, "planned")
    try:
        slurm.wait_for_plan(run_dir, slurm.launch_id(config.dist), float(config.dist.timeout_s))
        job = read_job(run_dir.path)
        replayed = resume.replayed_environment(cfg, hydra)
        env = {**replayed, **credentials.for_ranks(job_credentials(config)), **rank_env}
        summary = start_ranks(job, run_dir, env=env, primary=False, output=output)
    except LauncherError as err:
        return Outcome(run_dir.path, "failed", err.exit_code, one_line(err))
    return _ended(run_dir, summary)


def _interrupt(signum: int, _frame: object) -> None:
    """SIGTERM or SIGINT while the job is planned: stop with status "interrupted", no traceback.

    Once the ranks run, the launcher passes these signals on to them as a stop request instead
    (launcher.launch.ranks), and they stop at the next step boundary with a checkpoint."""
    remember(signum)  # a sweep's next job does not start
    raise _stopped_before_training(name(signum))


def _stopped_before_training(signal_name: str) -> Interrupted:
    return Interrupted(f"stopped by {signal_name} before training started; start the job again")
