"""The job spec: every fact a job depends on, derived once from the composed config and the machine.

World size, device, the language model's hidden size, the user's JSON base, the groups named on the
command line, the final DeepSpeed dict and the precision it trains in are computed here and nowhere
else. The launcher writes the spec to `job.json`; every rank, the planner, W&B and the checkpoints read
these facts from it (or from the spec itself), so two parts of the launcher cannot disagree about them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.config.ds_config import (
    Device,
    build_ds_config,
    explicit_groups_from_overrides,
    labelled_choices,
    offload_of,
    precision_of,
)
from launcher.core.errors import LauncherError

# GiB a rank's CUDA allocator may hold: launcher.tune sets it for its candidates on a GPU, so a
# candidate over the budget meets a real CUDA out-of-memory error (launcher.recipe applies it).
CUDA_MEMORY_CAP_ENV = "LAUNCHER_CUDA_MEMORY_GB"


@dataclass(frozen=True)
class HydraJob:
    """What Hydra (or a resume, which composes the old run's command line) says about this job."""

    run_dir: Path
    overrides: tuple[str, ...] = ()
    choices: Mapping[str, str] = field(default_factory=dict)
    multirun: bool = False
    group: str = ""  # the W&B group: all jobs of one sweep share one; a single run is its own

    @classmethod
    def from_hydra(cls) -> HydraJob:
        """The job Hydra is running now (inside `@hydra.main`)."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        run_dir = Path(hydra_cfg.runtime.output_dir)
        sweep_dir = Path(hydra_cfg.sweep.dir)
        return cls(
            run_dir=run_dir,
            overrides=tuple(hydra_cfg.overrides.task),
            choices=choices_of(hydra_cfg.runtime.choices),
            multirun=multirun,
            group=f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}"
            if multirun
            else f"run-{run_dir.parent.name}-{run_dir.name}",
        )


def choices_of(runtime_choices: Mapping[str, Any]) -> dict[str, str]:
    """The group choices of a composed config, without Hydra's own groups."""
    return {key: value for key, value in runtime_choices.items() if not key.startswith("hydra")}


@dataclass(frozen=True)
class JobSpec:
    """One job: its Hydra facts, its shape on the machine, and the DeepSpeed dict it trains with."""

    hydra: HydraJob
    world_size: int
    ranks_per_node: int
    device: Device
    hidden_size: int
    explicit_groups: frozenset[str]
    ds_config: dict[str, Any]
    model: dict[str, Any]  # the model config, as composed
    method: dict[str, Any]  # what trains (the method group), as composed
    resume_tag: str | None = None
    reshard: dict[str, Any] | None = None  # a resume on another world size or ZeRO stage (launcher.reshard)
    deepspeed_json: str | None = None  # the user's JSON the dict was composed onto (its path, as given)

    @property
    def precision(self) -> str:
        """fp32 | bf16 | fp16: what the DeepSpeed dict trains in (launcher.ds_config.precision_of)."""
        return precision_of(self.ds_config)

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])

    @property
    def labels(self) -> dict[str, Any]:
        """The group choices that say what the dict trains with (launcher.ds_config.labelled_choices):
        job.json's "choices", which summary.json, the comparison and W&B's tags read."""
        return labelled_choices(
            self.hydra.choices, self.ds_config, device=self.device, deepspeed_json=self.deepspeed_json
        )

    def describe(self) -> str:
        """The line a run starts with: what the launcher decided, read from the final dict."""
        ds = self.ds_config
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        return (
            f"job: {self.model.get('name')} ({self.method.get('name')}) on {ranks} ({self.device.kind}), "
            f"ZeRO {self.zero_stage}, offload {offload_of(ds)}, {self.precision}; batch {ds['train_batch_size']} "
            f"= {ds['train_micro_batch_size_per_gpu']} per rank x {ds.get('gradient_accumulation_steps', 1)} "
            f"accumulated x {ranks}; run dir {self.hydra.run_dir}"
        )

    def with_resume(self, tag: str | None, reshard: dict[str, Any] | None = None) -> JobSpec:
        return dataclasses.replace(self, resume_tag=tag, reshard=reshard)

    def to_json(self) -> dict[str, Any]:
        """job.json: what the ranks, W&B and the checkpoints read about the job."""
        return {
            "run_dir": str(self.hydra.run_dir),
            "multirun": self.hydra.multirun,
            "overrides": list(self.hydra.overrides),
            "choices": self.labels,
            "group": self.hydra.group,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "hidden_size": self.hidden_size,
            "device": self.device.kind,
            "precision": self.precision,
            "zero_stage": self.zero_stage,
            "model": self.model,
            "method": self.method,
            "resume_tag": self.resume_tag,
            "reshard": self.reshard,
        }


def plain(cfg: DictConfig) -> dict[str, Any]:
    """The composed config as plain data: resolved, choices as their strings."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def world_size_of(cfg: DictConfig) -> int:
    """Ranks in the job: dist.nproc_per_node x dist.nnodes (the only place this product is taken)."""
    nproc, nnodes = int(cfg.dist.nproc_per_node), int(cfg.dist.nnodes)
    if nproc < 1 or nnodes < 1:
        raise LauncherError(f"dist.nproc_per_node={nproc} x dist.nnodes={nnodes} must be positive")
    return nproc * nnodes


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


def model_hidden_size(model_cfg: Any) -> int:
    """Hidden size of the language model: a tiny model's config says; a real one's config file does
    (its `text_config`, shipped with the launcher for the real presets)."""
    if model_cfg.source == "tiny":
        return int(model_cfg.hidden_size)
    if not model_cfg.path:
        raise LauncherError(f"model.path is empty for model={model_cfg.name}: give a hub id or a local directory")
    from launcher.job.checks import check_image_text_to_text
    from launcher.model.models import read_config, text_hidden_size

    config = read_config(str(model_cfg.path))
    check_image_text_to_text(config, model_cfg.path)
    try:
        return text_hidden_size(config)
    except AttributeError:
        raise LauncherError(
            f"model.path={model_cfg.path}: its config has no hidden_size for the language model"
        ) from None


def plan_job(
    cfg: DictConfig,
    hydra: HydraJob,
    *,
    device: Device | None = None,
    hidden_size: int | None = None,
    validate: bool = True,
) -> JobSpec:
    """The job spec of a composed config on this machine (or on `device`, when planning for another).

    `validate` also runs the checks that need this machine (NVMe paths) and DeepSpeed's own config
    models; the planner's what-if variants skip them."""
    from launcher.job.checks import (
        check_knobs,
        check_optimizer_and_scheduler,
        check_paths,
        detect_device,
        validate_with_deepspeed,
    )

    check_knobs(cfg)
    world_size = world_size_of(cfg)
    device = device or detect_device()
    hidden_size = hidden_size or model_hidden_size(cfg.model)
    explicit = explicit_groups_from_overrides(list(hydra.overrides))
    base = load_deepspeed_json(cfg.deepspeed_json) if cfg.deepspeed_json else None
    job_cfg = plain(cfg)
    if job_cfg["train"]["max_steps"] is None and job_cfg["train"]["epochs"] is not None:
        # Planned before the data is counted (the planner, the tuner's candidates; a run counts it first,
        # launcher.training_length): the schedule's length changes no memory figure, so a stand-in does.
        job_cfg["train"]["max_steps"] = 1
    ds = build_ds_config(
        job_cfg,
        world_size=world_size,
        hidden_size=hidden_size,
        device=device,
        base=base,
        base_source=f"deepspeed_json={cfg.deepspeed_json}",
        explicit_groups=explicit,
    )
    if validate:
        check_paths(ds)
        validate_with_deepspeed(ds)
        check_optimizer_and_scheduler(ds)
    return JobSpec(
        hydra=hydra,
        world_size=world_size,
        ranks_per_node=int(cfg.dist.nproc_per_node),
        device=device,
        hidden_size=hidden_size,
        explicit_groups=explicit,
        ds_config=ds,
        model=plain(cfg.model),
        method=plain(cfg.method),
        resume_tag=None,
        deepspeed_json=cfg.deepspeed_json or None,
    )


# ----------------------------------------------------------------------------- what-if variants
# The groups a variant sets; the user's own choices of these are replaced, every other override kept.
VARIANT_KEYS = (
    "deepspeed",
    "zero",
    "offload",
    "precision",
    "zero.stage",
    "precision.dtype",
    "offload.optimizer",
    "offload.param",
)


def override_key(override: str) -> str:
    """The key an override sets: `+model.lr@x=1` -> `model.lr`."""
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def variant_overrides(overrides: Sequence[str], preset: str, dtype: str) -> list[str]:
    """The command line of `train.py OVERRIDES` with `deepspeed=PRESET precision=DTYPE` instead of the
    user's own ZeRO, offload and precision choices."""
    kept = [o for o in overrides if override_key(o) not in VARIANT_KEYS]
    return [*kept, f"deepspeed={preset}", f"precision={dtype}"]
