"""What train.py checks on its command line before Hydra runs: the run directory it names.

Hydra would fail creating an unwritable hydra.run.dir with a traceback and exit code 1, and writes its
log into the directory before the job runs: a directory that cannot be made, one another job owns, or a
finished run's (which a new job would append to) is refused here, in one line. Only a directory given on
the command line is checked; an interpolation (`${now:...}`) is checked up to where it starts.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from launcher.core.overrides import argument, is_multirun, runs_a_job
from launcher.core.rundir import RunDir, directory_problem


def refused_run_dir(argv: Sequence[str]) -> str | None:
    """Why the run directory this command names cannot be used (the error line), or None.

    Claims it (launcher.core.rundir.RunDir.claim) before Hydra writes there: a second job must not
    append to the first one's files."""
    if not runs_a_job(argv):
        return None  # prints a config or help; creates no directory
    multirun = is_multirun(argv)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = argument(argv, key)
    fixed = (value or "").split("${", 1)[0]
    if fixed != value:  # an interpolation: check the folder its fixed part names, if any
        fixed = fixed.rsplit("/", 1)[0] if "/" in fixed else ""
    if fixed and (problem := directory_problem(Path(fixed))):
        return f"{key}={value}: cannot create it ({problem}); choose a directory you can write"
    resume = argument(argv, "resume")
    if not multirun and resume not in (None, "null", "", "auto") and RunDir(Path(resume).expanduser()).is_run():
        return _claimed(RunDir(Path(resume).expanduser().absolute()), "resume")  # it runs there (conf/config.yaml)
    if multirun or not value or value != fixed:
        return None
    run_dir = RunDir(Path(value).expanduser())
    if resume in (None, "null", "") and _owns_run_dir(argv) and (foreign := run_dir.foreign_entries()):
        # A new job writes model/, summary.json, ... there: what it did not write would be replaced or mixed in.
        return (
            f"hydra.run.dir={value} holds what no run of this launcher wrote ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}): a new run would write model/ and summary.json beside or over "
            "it; choose a new or empty directory"
        )
    if _owns_run_dir(argv) and (refused := _claimed(run_dir, key)):
        return refused
    if resume in (None, "null", ""):
        # A new job in a finished (or crashed) run's directory would append to its metrics and leave
        # its checkpoints and model/ looking like this job's; Hydra has not touched it yet.
        held = [path.name for path in (run_dir.metrics, run_dir.checkpoints) if path.exists()]
        if held:
            return (
                f"hydra.run.dir={value} already holds a run ({', '.join(held)}): continue it with "
                f"resume={value} (or resume=auto), or choose a new directory"
            )
    return None


def composition_refused(argv: Sequence[str]) -> str | None:
    """The one line of a command line that does not compose (a misspelt key, a mixture source with an unknown
    key or a value of the wrong type), or None; Hydra itself would print a multi-line dump ("full_key: ...,
    object_type=SourceConfig"). Only a single job's command line is composed here (a sweep's jobs differ),
    and not under HYDRA_FULL_ERROR=1, where Hydra's own report with its traceback is what was asked for."""
    if not runs_a_job(argv) or is_multirun(argv) or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return None
    from launcher.config.compose import ConfigNotComposed, compose_typed

    overrides = [arg for arg in argv[1:] if not arg.startswith("-")]
    try:
        compose_typed(overrides)
    except ConfigNotComposed as err:
        return str(err)
    return None


def slurm_missing(argv: Sequence[str]) -> str | None:
    """The line for a sweep submitted through SLURM (`-m dist=slurm`) from a machine without SLURM's `srun`,
    or None; submitit raises there, and Hydra prints its 25-line traceback."""
    if not runs_a_job(argv) or not is_multirun(argv) or argument(argv, "dist") != "slurm":
        return None
    if argument(argv, "hydra/launcher") not in (None, "submitit_slurm"):  # submitit_local: tasks on this machine
        return None
    if shutil.which("srun") is not None:
        return None
    return (
        "dist=slurm submits each job to SLURM, and this machine has no SLURM (no srun on PATH): run the command "
        "on a SLURM login node, or here with dist=local (one process per rank on this machine) or dist=torchrun"
    )


def _claimed(run_dir: RunDir, key: str) -> str | None:
    problem = run_dir.claim()
    return None if problem is None else f"{key}={run_dir.path}: {problem}"


def _owns_run_dir(argv: Sequence[str]) -> bool:
    """Whether this process is the one that owns the run directory: not another node's launcher
    (dist.node_rank > 0) nor a SLURM task other than the first; they share rank 0's directory."""
    return argument(argv, "dist.node_rank") in (None, "0") and os.environ.get("SLURM_PROCID", "0") == "0"


def local_rank_dropped(argv: list[str]) -> str | None:
    """DeepSpeed's launcher appends `--local_rank=N` to the script's arguments, which Hydra's parser rejects:
    take it out of `argv` (in place); the value, for LOCAL_RANK, or None."""
    value, kept, skip_next = None, [], False
    for index, arg in enumerate(argv):
        if skip_next:
            skip_next = False
        elif arg.startswith(("--local_rank=", "--local-rank=")):
            value = arg.split("=", 1)[1]
        elif arg in ("--local_rank", "--local-rank") and index + 1 < len(argv):
            value, skip_next = argv[index + 1], True
        else:
            kept.append(arg)
    argv[:] = kept
    return value
