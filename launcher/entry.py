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
from launcher.rundir import DS_CONFIG_FILE, JOB_FILE, write_failed_summary, write_json_atomic

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


def apply_resume_argument(argv: list[str] | None = None) -> None:
    """`resume=DIR`: rerun the old run's overrides (new ones win) with hydra.run.dir=DIR.

    The resumed job then runs in the old run directory for everything (Hydra's files, the DeepSpeed
    dict, metrics, W&B), and without repeating the old command line it trains the same job.
    A DIR without a Hydra run in it is left alone; `run_job` reports it."""
    argv = sys.argv if argv is None else argv
    values = [arg.split("=", 1)[1] for arg in argv[1:] if _override_key(arg) == "resume" and "=" in arg]
    if not values or values[-1] in ("auto", "null", "") or "-m" in argv or "--multirun" in argv:
        return
    run_dir = Path(values[-1]).expanduser()
    old_overrides = run_dir / ".hydra" / "overrides.yaml"
    if not old_overrides.is_file():
        return
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
    if wanted.resolve() != run_dir.resolve():
        raise LauncherError(f"resume={cfg.resume}: {wanted} is not a run directory (no .hydra/overrides.yaml)")
    tag = find_resume_tag(run_dir / CHECKPOINT_DIR)
    if tag is None and cfg.resume != "auto":
        raise LauncherError(f"resume={cfg.resume}: no complete checkpoint in {run_dir / CHECKPOINT_DIR}")
    if tag is None:
        print(f"resume=auto: no checkpoint in {run_dir / CHECKPOINT_DIR}, starting fresh", file=sys.stderr)
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
    try:
        ds, facts = plan_deepspeed(cfg, context["overrides"])
        check_memory(cfg, ds, facts["world_size"])
        model = OmegaConf.to_container(cfg.model, resolve=True)
        resume_tag = None if cfg.dry_run else _resume_tag(cfg, run_dir)
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

        summary = launch(cfg, run_dir, isolate=context["multirun"])
    except LauncherError as err:
        message = one_line(err)
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
