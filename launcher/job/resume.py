"""`resume=DIR|auto`: continue a run in its own directory, with its own command line.

    python train.py resume=outputs/runs/2026-12-01/10-00-00                 # the same job, continued
    python train.py resume=outputs/runs/2026-12-01/10-00-00 train.max_steps=2000   # new overrides win
    python train.py ... hydra.run.dir=/shared/runs/exp1 resume=auto          # SLURM requeue: same command

Resolving a resume is one explicit step before any job starts: the old run's `.hydra/overrides.yaml`
and the new command line compose, through Hydra's compose API, into the config of the continued job;
its run directory is the old one. Nothing in the old run is touched until the launcher accepts the
resume (same world size, model and ZeRO stage as the checkpoint): only then are the new `.hydra/`
files written, so a refused `resume=DIR deepspeed=z2` leaves the run as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

from launcher.job.spec import HydraJob, choices_of

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# Hydra flags that print something instead of running a job.
NO_JOB_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--version", "--shell-completion"}


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def argument(argv: Sequence[str], key: str) -> str | None:
    """The last value given to KEY on the command line, without quotes (None when not given)."""
    values = [arg.split("=", 1)[1] for arg in argv[1:] if override_key(arg) == key and "=" in arg]
    return values[-1].strip("'\"") if values else None


def runs_a_job(argv: Sequence[str]) -> bool:
    """False for Hydra's flags that print a config or help instead of running the job."""
    return not any(arg.split("=", 1)[0] in NO_JOB_FLAGS for arg in argv[1:])


def is_multirun(argv: Sequence[str]) -> bool:
    return "-m" in argv or "--multirun" in argv


def resumed_run_dir(argv: Sequence[str]) -> Path | None:
    """The run directory this command continues, or None when it starts a new run.

    `resume=DIR` continues DIR; `resume=auto` continues hydra.run.dir when a run was started there
    (else the job starts fresh, as Hydra runs it). A DIR without a Hydra run is left to the launcher,
    which reports it. Sweeps (-m) never resume."""
    value = argument(argv, "resume")
    if not value or value == "null" or is_multirun(argv) or not runs_a_job(argv):
        return None
    if value == "auto":
        value = argument(argv, "hydra.run.dir")
        if not value:
            return None
    run_dir = Path(value).expanduser().absolute()
    return run_dir if (run_dir / ".hydra" / "overrides.yaml").is_file() else None


def resumed_overrides(old: Sequence[str], new: Sequence[str]) -> list[str]:
    """The old run's overrides, each replaced by a new one of the same key, then the new ones."""
    new = [arg for arg in new if override_key(arg) != "hydra.run.dir"]
    new_keys = {override_key(arg) for arg in new}
    return [*(arg for arg in old if override_key(arg) not in new_keys), *new]


@dataclass
class ResumedJob:
    """The composed config of a continued run, and what is written into its directory once accepted."""

    cfg: DictConfig
    hydra_cfg: DictConfig
    job: HydraJob

    def write_hydra_files(self) -> None:
        """The run's `.hydra/` files, as Hydra writes them for a job: config, hydra node, overrides."""
        out = self.job.run_dir / ".hydra"
        out.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.cfg, out / "config.yaml")
        OmegaConf.save(OmegaConf.create({"hydra": self.hydra_cfg}), out / "hydra.yaml")
        (out / "overrides.yaml").write_text(yaml.safe_dump(list(self.job.overrides), default_flow_style=False))


def compose_resumed(run_dir: Path, argv: Sequence[str]) -> ResumedJob:
    """Compose the continued job: the old run's overrides with the new command line's (which win)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    old = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []
    new = [arg for arg in argv[1:] if not arg.startswith("-")]
    task = resumed_overrides(old, [arg for arg in new if not override_key(arg).startswith("hydra.")])
    hydra_overrides = [
        arg for arg in new if override_key(arg).startswith("hydra.") and override_key(arg) != "hydra.run.dir"
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        cfg = compose(config_name="config", overrides=[*task, *hydra_overrides], return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.run.dir = str(run_dir)
        cfg.hydra.runtime.output_dir = str(run_dir)
        cfg.hydra.overrides.task = task
    HydraConfig.instance().set_config(cfg)  # ${hydra:...} interpolations resolve as in a Hydra run
    hydra_cfg = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    job = HydraJob(
        run_dir=run_dir,
        overrides=tuple(task),
        choices=choices_of(hydra_cfg.runtime.choices),
        multirun=False,
        group=f"run-{run_dir.parent.name}-{run_dir.name}",
    )
    return ResumedJob(cfg=cfg, hydra_cfg=hydra_cfg, job=job)
