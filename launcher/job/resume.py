"""`resume=DIR|auto`: continue a run in its own directory, with its own command line. Decided here, once.

    python train.py resume=outputs/runs/2026-12-01/10-00-00                 # the same job, continued
    python train.py resume=outputs/runs/2026-12-01/10-00-00 train.max_steps=2000   # new overrides win
    python train.py ... hydra.run.dir=/shared/runs/exp1 resume=auto          # SLURM requeue: same command

A resume starts like any job (Hydra runs it in the old run's directory: conf/config.yaml's
`hydra.run.dir` resolves `resume=DIR` there), and the launcher asks this module two questions:

1. `continued(cfg, hydra)`: what job is continued? The old run's `.hydra/overrides.yaml` and the new
   command line compose (Hydra's compose API) into the continued job's config; on another world size the
   checkpoint's global batch is kept (the batch overrides join the command line).
2. `decide(config, job)`, once that job is planned: from which checkpoint (the newest intact one), on
   which shape (`launcher.job.reshard`: another world size or ZeRO stage goes through a universal
   checkpoint), or nothing at all (the run finished at train.max_steps already); and what to tell the
   user (damaged checkpoints passed over, a learning-rate schedule that changes).

Nothing in the old run is touched until the launcher accepts the resume: only then are its `.hydra/`
files written, so a refused `resume=DIR deepspeed=z2` leaves the run as it was.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from launcher.config.compose import compose, without_hydra
from launcher.config.schema import Config, plain
from launcher.config.stages import check_schedule_kept, stage_at, stage_ds_config
from launcher.core import credentials
from launcher.core.checkpoints import (
    CheckpointMarker,
    complete_tags,
    find_resume_tag,
    incompatibilities,
    lr_schedule_of,
    read_marker,
)
from launcher.core.errors import LauncherError
from launcher.core.overrides import argument, override_key, override_value, replaced
from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.job.reshard import batch_overrides, reshard_for
from launcher.job.spec import HydraJob, Job, Resume, choices_of, run_group


@dataclass(frozen=True)
class Continued:
    """The job a resume continues: its composed config, in the old run's directory."""

    cfg: DictConfig  # old overrides + new ones (which win)
    hydra: HydraJob
    hydra_node: DictConfig  # Hydra's node of that composition (written to .hydra/hydra.yaml once accepted)
    notes: tuple[str, ...] = ()  # the batch kept on another world size, Hydra settings not replayed
    # The first run's `hydra.job.env_set` entries this command line does not give again: the ranks'
    # environment, as Hydra gave it to the first run's (credentials read from this job's environment).
    environment: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ResumePlan:
    """What a resume does, decided before any rank starts."""

    resume: Resume | None  # the checkpoint the ranks load (None: the run starts over)
    finished: Summary | None = None  # it ended at train.max_steps already: nothing to train
    starts_over: bool = False  # resume=auto found no checkpoint: the job starts fresh in that directory
    notes: tuple[str, ...] = ()  # damaged checkpoints passed over, a changed schedule


def continued(cfg: DictConfig, hydra: HydraJob) -> Continued | None:
    """The continued job of `resume=DIR` (or `resume=auto` where a job was started in hydra.run.dir); None
    for a job that starts fresh. Sweeps (-m) never resume: each of their jobs has a directory of its own."""
    value = cfg.get("resume")
    if not value or hydra.multirun:
        return None
    run_dir = RunDir(hydra.run_dir)
    if value != "auto":
        wanted = Path(str(value)).expanduser().absolute()
        if RunDir(wanted).is_run() and wanted.resolve() != run_dir.path.resolve():
            raise LauncherError(
                f"resume={value} continues in its own directory, but hydra.run.dir={run_dir.path} was given: "
                "leave hydra.run.dir out"
            )
    if not run_dir.is_run():
        return None
    new = [arg for arg in hydra.overrides if override_key(arg) != "hydra.run.dir"]
    task = replaced(run_dir.read_overrides(), new)
    missing = credentials.missing_secret_overrides(task)
    if missing:
        key, variable = missing[0]
        raise LauncherError(
            f"resume={value}: the run was started with a credential in {key}, which no file of the run holds: "
            f"set {variable} to it (or give {key}=... again) and resume"
        )
    environment, settings = _replayed_hydra_settings(run_dir, hydra, str(value))
    composed = _compose_in(run_dir, task, environment)
    notes = []
    if (kept := _kept_global_batch(run_dir, composed.cfg, new)) is not None:
        line, batch = kept
        composed = _compose_in(run_dir, [*task, *batch], environment)
        notes.append(line)
    if settings:
        notes.append(
            f"resume: the first run's {' '.join(settings)} shaped Hydra's own start and is not replayed: "
            "give it again to keep it"
        )
    return dataclasses.replace(composed, notes=tuple(notes), environment=environment)


_ENV_SET = "hydra.job.env_set."
# Hydra overrides that say where and how this job runs, not what it is: never replayed, never mentioned.
_PLACEMENT = ("hydra.run.dir", "hydra.mode", "hydra.sweep.")


def replayed_environment(cfg: DictConfig, hydra: HydraJob) -> dict[str, str]:
    """What a SLURM task that does not plan (launcher.launch.run) gives its rank of a resume: the first run's
    `hydra.job.env_set` entries, as the planning task replays them ({} for a job that starts fresh)."""
    value = cfg.get("resume")
    if not value or hydra.multirun or not RunDir(hydra.run_dir).is_run():
        return {}
    return _replayed_hydra_settings(RunDir(hydra.run_dir), hydra, str(value))[0]


def _replayed_hydra_settings(run_dir: RunDir, hydra: HydraJob, value: str) -> tuple[dict[str, str], list[str]]:
    """({variable: value} of `hydra.job.env_set`, the first run's entries and this command line's, the
    first run's other Hydra settings not given again). A credential's entry is recorded redacted: its value comes
    from this job's environment, or the resume stops in one line naming the variable."""
    given = {override_key(arg) for arg in (hydra.node.overrides.hydra if hydra.node is not None else ())}
    # Given again: Hydra has set it in this process already; kept here so that hydra.yaml records it.
    environment = {str(k): str(v) for k, v in (hydra.node.job.env_set.items() if hydra.node is not None else ())}
    settings: list[str] = []
    for override in run_dir.read_hydra_overrides():
        key = override_key(override)
        if key in given:
            continue
        if not key.startswith(_ENV_SET):
            if not key.startswith(_PLACEMENT):
                settings.append(override)
            continue
        variable, setting = key[len(_ENV_SET) :], str(override_value(override))
        if setting == credentials.REDACTED:
            if variable not in os.environ:
                raise LauncherError(
                    f"resume={value}: the run was started with {_ENV_SET}{variable}, a credential no file of "
                    f"the run holds: export {variable} (or give +{_ENV_SET}{variable}=... again) and resume"
                )
            setting = os.environ[variable]
        environment[variable] = setting
    return environment, settings


def _compose_in(run_dir: RunDir, task: Sequence[str], environment: Mapping[str, str]) -> Continued:
    """The continued job's config (Hydra's compose API), placed in the old run's directory, its Hydra node
    recording the replayed environment (so that the next resume replays it too)."""
    cfg, hydra_node = without_hydra(compose(task, with_hydra=True))
    with open_dict(hydra_node):
        hydra_node.run.dir = str(run_dir.path)
        hydra_node.runtime.output_dir = str(run_dir.path)
        hydra_node.overrides.task = list(task)
        for variable, setting in environment.items():
            hydra_node.job.env_set[variable] = setting
            hydra_node.overrides.hydra.append(f"+{_ENV_SET}{variable}={setting}")
    job = HydraJob(
        run_dir=run_dir.path,
        overrides=tuple(task),
        choices=choices_of(hydra_node.runtime.choices),
        multirun=False,
        group=run_group(run_dir.path),
    )
    return Continued(cfg=cfg, hydra=job, hydra_node=hydra_node)


def _kept_global_batch(run_dir: RunDir, cfg: DictConfig, new: Sequence[str]) -> tuple[str, list[str]] | None:
    """On another world size than the checkpoint's: the line that says the checkpoint's global batch is kept
    and the batch overrides that keep it (accumulation adjusted), which join the resumed command line, so
    the run's overrides.yaml records them and a later resume keeps them too. None on the same world size."""
    tag = find_resume_tag(run_dir, warn=lambda line: None)  # `decide` warns, later
    if tag is None:
        return None
    marker = read_marker(run_dir, tag)
    world_size = int(cfg.dist.nproc_per_node) * int(cfg.dist.nnodes)
    if marker.world_size == world_size or marker.global_batch is None:
        return None
    keys = ("train.micro_batch_size", "train.grad_accum", "train.global_batch_size")
    argv = ["train.py", *new]
    given = {key: value for key in keys if (value := argument(argv, key)) not in (None, "null")}
    kept = batch_overrides(int(marker.global_batch), int(marker.micro_batch or 0), world_size, given)
    if kept == [
        f"train.micro_batch_size={cfg.train.micro_batch_size}",
        "train.grad_accum=null",
        f"train.global_batch_size={cfg.train.global_batch_size}",
    ]:
        return None
    line = (
        f"resume: on {world_size} rank(s) (saved on {marker.world_size}), the checkpoint's global batch "
        f"{marker.global_batch} is kept: {' '.join(kept)}"
    )
    return line, kept


def decide(config: Config, job: Job, *, warn: Callable[[str], None]) -> ResumePlan | None:
    """What the resume of this planned job continues from, or why it cannot (one line); None without resume=.

    Damaged checkpoints passed over are reported to `warn` as they are found."""
    if not config.resume:
        return None
    run_dir = RunDir(job.run_dir)
    tag = _checkpoint_to_resume(str(config.resume), run_dir, warn)
    if tag is None:
        return ResumePlan(
            resume=None,
            starts_over=True,
            notes=(f"resume=auto: no checkpoint in {run_dir.checkpoints}, starting fresh",),
        )
    marker = read_marker(run_dir, tag)
    differences = incompatibilities(
        marker, precision=job.precision, model=plain(config.model), method=plain(config.method)
    )
    if differences:
        raise LauncherError(
            f"cannot resume {run_dir.checkpoint(tag)}: the job differs from the one that saved it "
            f"({'; '.join(differences)}); resume with the same settings, or start a new run"
        )
    reshard = reshard_for(
        marker,
        {
            "world_size": job.world_size,
            "zero_stage": job.zero_stage,
            "precision": job.precision,
            "global_batch": job.global_batch,
            "offload_optimizer": job.offload_optimizer,
            "data": plain(config.data),
        },
    )
    stages = job.stages
    problem = check_schedule_kept(marker.stages, stages, marker.step)
    if problem is not None:
        raise LauncherError(f"cannot resume {run_dir.checkpoint(tag)}: {problem}")
    resume = Resume(tag, reshard)
    finished = _finished(run_dir, marker, job.max_steps, tag)
    ds = job.ds_config  # the schedule the checkpoint's steps continue on: with stages, its stage's own
    if stages:
        ds = stage_ds_config(ds, plain(config.train), stage_at(stages, marker.step))
    change = schedule_change(marker, ds)
    return ResumePlan(resume=resume, finished=finished, notes=() if change is None else (change,))


def _checkpoint_to_resume(value: str, run_dir: RunDir, warn: Callable[[str], None]) -> str | None:
    """The tag to continue from; None when resume=auto finds none (the job starts fresh there)."""
    wanted = run_dir.path if value == "auto" else Path(value).expanduser()
    if not wanted.is_dir():
        raise LauncherError(f"resume={value}: no such directory; give the run directory of the run to continue")
    if wanted.resolve() != run_dir.path.resolve():
        raise LauncherError(
            f"resume={value}: {wanted} is not a run directory (no .hydra/overrides.yaml); give the run "
            "directory of the run to continue"
        )
    tag = find_resume_tag(run_dir, warn=warn)
    if tag is None and complete_tags(run_dir):  # never start afresh over damaged checkpoints
        raise LauncherError(
            f"resume={value}: every checkpoint in {run_dir.checkpoints} is damaged (a file differs from "
            "its size at save, named above); start a new run instead"
        )
    if tag is None and value != "auto":
        raise LauncherError(
            f"resume={value}: no complete checkpoint in {run_dir.checkpoints} (the run saved none, "
            "or was killed before its first save finished); start a new run instead"
        )
    return tag


def _finished(run_dir: RunDir, marker: CheckpointMarker, max_steps: int, tag: str) -> Summary | None:
    """The summary of a completed run a resume would continue with nothing left to train.

    A checkpoint past train.max_steps is refused: training would not run, and the summary would claim
    fewer steps than the weights have seen."""
    if marker.step > max_steps:
        raise LauncherError(
            f"train.max_steps={max_steps} is below step {marker.step} of the checkpoint {tag} this "
            f"resume continues: give train.max_steps={marker.step} or more (or start a new run)"
        )
    summary = run_dir.read_summary()
    if marker.step == max_steps and summary is not None and summary.status == "completed":
        return summary
    return None


# ----------------------------------------------------------------------------- the learning-rate schedule
# The scheduler's parameters by the knob a user changes them with (others by their DeepSpeed name).
SCHEDULE_KNOBS = {
    "lr": "train.lr",
    "warmup_max_lr": "train.lr",
    "total_num_steps": "train.max_steps",
    "warmup_num_steps": "warm-up",
    "cos_min_ratio": "train.min_lr_ratio",
}


def scheduled_lr(schedule: dict[str, Any], step: int) -> float | None:
    """The learning rate step `step` (1-based) applies, as metrics.jsonl shows it, under a schedule, from
    DeepSpeed's own scheduler class; None where DeepSpeed has no such class. Step k applies the scheduler's
    iteration k for WarmupCosineLR (launcher.train.engine.start_warm_up_at_step_one), k - 2 for the others
    (DeepSpeed sets iteration -1's rate before the first step and steps after each)."""
    import torch
    from deepspeed.runtime import lr_schedules

    block, lr = schedule.get("scheduler") or {}, schedule.get("lr")
    cls = getattr(lr_schedules, str(block.get("type")), None)
    if cls is None or lr is None:
        return None
    iteration = step if cls is lr_schedules.WarmupCosineLR else step - 2
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(lr))
    try:
        # Built at its iteration (not at -1, where DeepSpeed warns that it has not started), then stepped there.
        cls(optimizer, **{**(block.get("params") or {}), "last_batch_iteration": iteration}).step(iteration)
    except (TypeError, ValueError):
        return None
    return float(optimizer.param_groups[0]["lr"])


def schedule_change(marker: CheckpointMarker, ds: dict[str, Any]) -> str | None:
    """One line when this job's learning-rate schedule differs from the checkpoint's, else None.

    DeepSpeed restores only the scheduler's step count: the schedule itself is rebuilt from this job's
    config, so a resume with another train.max_steps (or warm-up, lr) continues on the new schedule,
    re-stretched to the new length, and the learning rate jumps at the resume step. A checkpoint of an
    older launcher does not record its schedule: nothing is said."""
    saved, now = marker.lr_schedule, lr_schedule_of(ds)
    if not saved or saved == now:
        return None
    step = marker.step
    old = {"lr": saved.get("lr"), **((saved.get("scheduler") or {}).get("params") or {})}
    new = {"lr": now.get("lr"), **((now.get("scheduler") or {}).get("params") or {})}
    changes = {}
    for key in [*old, *(key for key in new if key not in old)]:
        if old.get(key) != new.get(key):
            changes.setdefault(SCHEDULE_KNOBS.get(key, f"scheduler.params.{key}"), f"{old.get(key)} -> {new.get(key)}")
    old_type, new_type = (str((s.get("scheduler") or {}).get("type")) for s in (saved, now))
    if old_type != new_type:
        changes = {"scheduler.type": f"{old_type} -> {new_type}", **changes}
    what = ", ".join(f"{knob} {change}" + (" steps" if knob == "warm-up" else "") for knob, change in changes.items())
    total = new.get("total_num_steps")
    how = f"re-stretched to {total} steps" if "train.max_steps" in changes and total else "changed to the new values"
    before, after = scheduled_lr(saved, step + 1), scheduled_lr(now, step + 1)
    lrs = f" (lr at step {step + 1}: {before:.1e} -> {after:.1e})" if before is not None and after is not None else ""
    return f"resume: {what}: the learning-rate schedule is {how} from step {step + 1} on{lrs}"
