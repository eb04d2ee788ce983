"""What `train.py` runs once Hydra has composed the config: plan the job, then train or stop.

Order of work: compose the DeepSpeed dict (pure) and validate it (DeepSpeed's own models), write it
into the run directory, then hand over to the ranks. Every problem a user can fix ends here as one
line on stderr and exit code 2 (or, inside a sweep, as a failed job the sweep records and passes).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.errors import LauncherError, one_line
from launcher.rundir import (
    DS_CONFIG_FILE,
    JOB_FILE,
    METRICS_FILE,
    directory_problem,
    write_failed_summary,
    write_json_atomic,
)

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


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _argument(argv: list[str], key: str) -> str | None:
    """The last value given to KEY on the command line, without quotes (None when not given)."""
    values = [arg.split("=", 1)[1] for arg in argv[1:] if _override_key(arg) == key and "=" in arg]
    return values[-1].strip("'\"") if values else None


# Hydra flags that print something instead of running a job.
_NO_JOB_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--version", "--shell-completion"}


def check_output_dir_argument(argv: list[str] | None = None) -> None:
    """Refuse, in one line and before Hydra tries, a hydra.run.dir (hydra.sweep.dir) that cannot be made.

    Hydra would fail creating it with a traceback and exit code 1. Only a directory given on the
    command line is checked; an interpolation (`${now:...}`) is checked up to where it starts."""
    argv = sys.argv if argv is None else argv
    if any(arg.split("=", 1)[0] in _NO_JOB_FLAGS for arg in argv[1:]):
        return  # prints a config or help; creates no directory
    key = "hydra.sweep.dir" if "-m" in argv or "--multirun" in argv else "hydra.run.dir"
    value = _argument(argv, key)
    fixed = (value or "").split("${", 1)[0]
    if fixed != value:  # an interpolation: check the folder its fixed part names, if any
        fixed = fixed.rsplit("/", 1)[0] if "/" in fixed else ""
    problem = directory_problem(Path(fixed)) if fixed else None
    if problem:
        print(f"error: {key}={value}: cannot create it ({problem}); choose a directory you can write", file=sys.stderr)
        sys.exit(LauncherError.exit_code)
    resume = _argument(argv, "resume")
    if key == "hydra.run.dir" and value == fixed and value and resume in (None, "null", ""):
        # A new job in a finished (or crashed) run's directory would append to its metrics and leave
        # its checkpoints and model/ looking like this job's; Hydra has not touched it yet.
        held = [name for name in (METRICS_FILE, "checkpoints") if (Path(value).expanduser() / name).exists()]
        if held:
            print(
                f"error: hydra.run.dir={value} already holds a run ({', '.join(held)}): continue it with "
                f"resume={value} (or resume=auto), or choose a new directory",
                file=sys.stderr,
            )
            sys.exit(LauncherError.exit_code)


# The Hydra files (.hydra/*.yaml) of the run that `resume=` continues, as they were before Hydra rewrote
# them for this job: put back when the resume is refused, so that a refused `resume=DIR deepspeed=z2`
# does not change what a later `resume=DIR` runs.
_resumed_run_files: dict[Path, bytes] = {}


def _remember_run_files(run_dir: Path) -> None:
    _resumed_run_files.clear()
    hydra_dir = run_dir / ".hydra"
    if hydra_dir.is_dir():
        _resumed_run_files.update({path: path.read_bytes() for path in hydra_dir.iterdir() if path.is_file()})


def _restore_run_files() -> None:
    hydra_dir = next(iter(_resumed_run_files)).parent
    for path in hydra_dir.iterdir():
        if path.is_file() and path not in _resumed_run_files:
            path.unlink()  # written by Hydra for this job
    for path, content in _resumed_run_files.items():
        path.write_bytes(content)


def apply_resume_argument(argv: list[str] | None = None) -> None:
    """`resume=DIR`: rerun the old run's overrides (new ones win) with hydra.run.dir=DIR.

    The resumed job then runs in the old run directory for everything (Hydra's files, the DeepSpeed
    dict, metrics, W&B), and without repeating the old command line it trains the same job.
    A DIR without a Hydra run in it is left alone; `run_job` reports it."""
    argv = sys.argv if argv is None else argv
    value = _argument(argv, "resume")
    if not value or value == "null" or "-m" in argv or "--multirun" in argv:
        return
    if value == "auto":
        run_dir_value = _argument(argv, "hydra.run.dir")
        if run_dir_value and any(Path(run_dir_value).expanduser().glob("checkpoints/*/launcher_complete.json")):
            _remember_run_files(Path(run_dir_value).expanduser())
        return
    run_dir = Path(value).expanduser()
    old_overrides = run_dir / ".hydra" / "overrides.yaml"
    if not old_overrides.is_file():
        return
    _remember_run_files(run_dir)
    import yaml

    new = [arg for arg in argv[1:] if _override_key(arg) != "hydra.run.dir"]
    new_keys = {_override_key(arg) for arg in new}
    old = [arg for arg in yaml.safe_load(old_overrides.read_text()) or [] if _override_key(arg) not in new_keys]
    argv[1:] = [*old, *new, f"hydra.run.dir='{run_dir.absolute()}'"]


def _resume_tag(cfg: DictConfig, run_dir: Path) -> str | None:
    """The checkpoint tag this job resumes from (None: a fresh start)."""
    from launcher.checkpoint import CHECKPOINT_DIR, find_resume_tag

    if not cfg.resume:
        return None
    wanted = run_dir if cfg.resume == "auto" else Path(cfg.resume).expanduser()
    if not wanted.is_dir():
        raise LauncherError(f"resume={cfg.resume}: no such directory; give the run directory of the run to continue")
    if wanted.resolve() != run_dir.resolve():
        raise LauncherError(
            f"resume={cfg.resume}: {wanted} is not a run directory (no .hydra/overrides.yaml); give the run "
            "directory of the run to continue"
        )
    tag = find_resume_tag(run_dir / CHECKPOINT_DIR)
    if tag is None and cfg.resume != "auto":
        raise LauncherError(
            f"resume={cfg.resume}: no complete checkpoint in {run_dir / CHECKPOINT_DIR} (the run saved none, "
            "or was killed before its first save finished); start a new run instead"
        )
    if tag is None:
        print(f"resume=auto: no checkpoint in {run_dir / CHECKPOINT_DIR}, starting fresh", file=sys.stderr)
        if not cfg.dry_run and cfg.dist.node_rank == 0:
            (run_dir / METRICS_FILE).unlink(missing_ok=True)  # steps of a segment killed before its first save
    return tag


def check_resumable(run_dir: Path, tag: str, ds: dict[str, Any], world_size: int, model: dict[str, Any]) -> None:
    """Refuse, in one line, to resume a checkpoint written by a different world size, model or ZeRO stage."""
    from launcher.checkpoint import CHECKPOINT_DIR, incompatibilities, read_marker

    precision = "fp32"
    if ds.get("bf16", {}).get("enabled"):
        precision = "bf16"
    elif ds.get("fp16", {}).get("enabled"):
        precision = "fp16"
    current = {
        "world_size": world_size,
        "zero_stage": ds["zero_optimization"]["stage"],
        "precision": precision,
        "model": model,
    }
    marker = read_marker(run_dir / CHECKPOINT_DIR, tag)
    differences = incompatibilities(marker, current)
    if differences:
        raise LauncherError(
            f"cannot resume {run_dir / CHECKPOINT_DIR / tag}: the job differs from the one that saved it "
            f"({'; '.join(differences)}); resume with the same settings, or start a new run"
        )


def _hydra_context() -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    return {
        "run_dir": run_dir,
        "multirun": multirun,
        "overrides": list(hydra_cfg.overrides.task),
        "choices": {k: v for k, v in hydra_cfg.runtime.choices.items() if not k.startswith("hydra")},
        # All jobs of one sweep share a W&B group; a single run is its own group.
        "group": f"sweep-{Path(hydra_cfg.sweep.dir).parent.name}-{Path(hydra_cfg.sweep.dir).name}"
        if multirun
        else f"run-{run_dir.parent.name}-{run_dir.name}",
    }


def load_deepspeed_json(path: str) -> dict[str, Any]:
    """A user's existing DeepSpeed JSON, the base of the composition."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise LauncherError(f"deepspeed_json={path}: no such file")
    try:
        base = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise LauncherError(
            f"deepspeed_json={path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})"
        ) from None
    if not isinstance(base, dict):
        raise LauncherError(f"deepspeed_json={path}: expected a JSON object at the top level")
    return base


def plan_deepspeed(cfg: DictConfig, overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The final, validated DeepSpeed dict for this job, and facts about the job it depends on."""
    from launcher.ds_config import build_ds_config, explicit_groups_from_overrides
    from launcher.validate import check_paths, detect_device, model_hidden_size, validate_with_deepspeed

    container = OmegaConf.to_container(cfg, resolve=True)
    world_size = cfg.dist.nproc_per_node * cfg.dist.nnodes
    if world_size < 1:
        raise LauncherError(
            f"dist.nproc_per_node={cfg.dist.nproc_per_node} x dist.nnodes={cfg.dist.nnodes} must be positive"
        )
    device = detect_device()
    hidden_size = model_hidden_size(cfg.model)
    base = load_deepspeed_json(cfg.deepspeed_json) if cfg.deepspeed_json else None
    ds = build_ds_config(
        container,
        world_size=world_size,
        hidden_size=hidden_size,
        device=device,
        base=base,
        base_source=f"deepspeed_json={cfg.deepspeed_json}",
        explicit_groups=explicit_groups_from_overrides(overrides),
    )
    check_paths(ds)
    validate_with_deepspeed(ds)
    facts = {"world_size": world_size, "hidden_size": hidden_size, "device": device.kind}
    return ds, facts


def check_inputs(cfg: DictConfig, ds: dict[str, Any], facts: dict[str, Any], *, launching: bool) -> None:
    """What the ranks would stop on, checked here so that it stops the job before any rank starts.

    Data files and loader settings, the cache directory, a local model directory's weights, a tiny
    model's records (read anyway for its vocabulary), and whether this machine has a device for every
    rank it would start (not for a dry run, which may plan a job for a bigger machine)."""
    from launcher.validate import (
        check_cache_dir,
        check_data,
        check_local_ranks,
        check_model_files,
        check_tiny_model_records,
    )

    check_data(cfg.data)
    check_cache_dir(cfg)
    check_model_files(cfg.model)
    check_tiny_model_records(cfg, micro_batch=ds["train_micro_batch_size_per_gpu"], world_size=facts["world_size"])
    if launching:
        check_local_ranks(cfg.dist, facts["device"])


PREFLIGHT_MODES = ("warn", "error", "off")


def check_memory(cfg: DictConfig, ds: dict[str, Any], world_size: int) -> None:
    """The planner's estimate for this job, before any process starts (`preflight=warn|error|off`)."""
    if cfg.preflight not in PREFLIGHT_MODES:
        raise LauncherError(f"preflight={cfg.preflight} is unknown: use one of {', '.join(PREFLIGHT_MODES)}")
    if cfg.preflight == "off":
        return
    from launcher.plan import preflight

    try:
        problem = preflight(cfg, ds, world_size)
    except LauncherError as err:
        if cfg.preflight == "error":
            raise
        print(f"warning: memory plan skipped ({one_line(err)})", file=sys.stderr)
        return
    if problem and cfg.preflight == "error":
        raise LauncherError(f"{problem} (preflight=error; preflight=warn only warns)")
    if problem:
        print(f"warning: {problem}", file=sys.stderr)


def run_job(cfg: DictConfig) -> float | None:
    """Plan, then train (or only print the plan with dry_run=true). Returns the sweep objective."""
    context = _hydra_context()
    run_dir: Path = context["run_dir"]
    started = time.time()
    launched = False
    try:
        ds, facts = plan_deepspeed(cfg, context["overrides"])
        check_inputs(cfg, ds, facts, launching=not cfg.dry_run)
        check_memory(cfg, ds, facts["world_size"])
        model = OmegaConf.to_container(cfg.model, resolve=True)
        resume_tag = _resume_tag(cfg, run_dir)
        if resume_tag is not None:
            check_resumable(run_dir, resume_tag, ds, facts["world_size"], model)
        write_json_atomic(run_dir / DS_CONFIG_FILE, ds)
        if cfg.dry_run:
            print(json.dumps(ds, indent=2))
            print(f"dry run: wrote {run_dir / DS_CONFIG_FILE}; nothing trained", file=sys.stderr)
            return None
        job = {**context, **facts, "run_dir": str(run_dir), "model": model, "resume_tag": resume_tag}
        write_json_atomic(run_dir / JOB_FILE, job)
        from launcher.processes import launch

        launched = True
        summary = launch(cfg, run_dir, isolate=context["multirun"])
    except LauncherError as err:
        message = one_line(err)
        if _resumed_run_files and not launched:
            # A refused resume leaves the run it would have continued as it was.
            _restore_run_files()
        else:
            write_failed_summary(run_dir, context, message, wall_s=time.time() - started)
        print(f"error: {message}", file=sys.stderr)
        if context["multirun"]:
            # The sweep records the failure and goes on (it exits non-zero at the end); NaN marks
            # the trial as failed for optimising sweepers such as Optuna.
            return math.nan
        sys.exit(err.exit_code)
    if summary.get("status") == "preempted":
        print(f"preempted after step {summary['steps']}: resume with resume={run_dir}", file=sys.stderr)
        if not context["multirun"]:
            sys.exit(PREEMPTED_EXIT_CODE)
        return math.nan
    objective = summary.get("objective")
    return math.nan if objective is None else float(objective)
