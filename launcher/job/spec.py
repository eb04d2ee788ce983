"""The job: every fact a run depends on, decided once by the launcher and read by every rank.

    launcher (launcher.launch.run) ── plan_job ──> Job ── job.json ──> each rank (launcher.train.trainer)

World size, device, the language model's hidden size, the resolved model path, the final DeepSpeed dict
and the precision it trains in, the config with its training length in steps, and what a resume
continues from: computed in the launcher, written to `job.json`, and read back by the ranks with
`Job.from_json`, field by field. Nothing downstream asks these questions again, so two parts of the
launcher cannot disagree about them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config.groups import describe_groups, group_specs
from launcher.config.precision import Device, labelled_choices, offload_of, precision_of
from launcher.config.schema import Config, freeze_flags, from_plain, plain
from launcher.config.stages import Stage, plan_stages
from launcher.core import credentials
from launcher.core.json_files import read_json
from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.job.reshard import Reshard

# The version of job.json's layout: a rank refuses a job written by another layout.
JOB_VERSION = 2


@dataclass(frozen=True)
class HydraJob:
    """What Hydra (or a resume, which composes the old run's command line) says about this job."""

    run_dir: Path
    overrides: tuple[str, ...] = ()
    choices: Mapping[str, str] = field(default_factory=dict)
    multirun: bool = False
    group: str = ""  # the W&B group: all jobs of one sweep share one; a single run is its own
    # Hydra's own config of the job (what .hydra/hydra.yaml holds); None for a job not started by Hydra.
    node: Any = field(default=None, compare=False, repr=False)

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
            group=f"sweep-{sweep_dir.parent.name}-{sweep_dir.name}" if multirun else run_group(run_dir),
            node=hydra_cfg,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "overrides": list(self.overrides),
            "choices": dict(self.choices),
            "multirun": self.multirun,
            "group": self.group,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HydraJob:
        return cls(
            run_dir=Path(data["run_dir"]),
            overrides=tuple(data["overrides"]),
            choices=dict(data["choices"]),
            multirun=bool(data["multirun"]),
            group=str(data["group"]),
        )


def choices_of(runtime_choices: Mapping[str, Any]) -> dict[str, str]:
    """The group choices of a composed config, without Hydra's own groups."""
    return {key: value for key, value in runtime_choices.items() if not key.startswith("hydra")}


def run_group(run_dir: Path) -> str:
    """The W&B group of a single run: its own, named by its directory."""
    return f"run-{run_dir.parent.name}-{run_dir.name}"


@dataclass(frozen=True)
class Resume:
    """Where a job continues from: a checkpoint of its run, maybe saved on another shape."""

    tag: str
    reshard: Reshard | None = None  # another world size or ZeRO stage (launcher.job.reshard)

    def to_json(self) -> dict[str, Any]:
        return {"tag": self.tag, "reshard": None if self.reshard is None else self.reshard.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Resume:
        reshard = data.get("reshard")
        return cls(tag=str(data["tag"]), reshard=None if reshard is None else Reshard.from_json(reshard))


@dataclass(frozen=True)
class Job:
    """One job: its Hydra facts, its config, its shape on the machine, and the DeepSpeed dict it trains with."""

    hydra: HydraJob
    config: Config  # typed; train.max_steps set (a length given in train.epochs is counted in steps)
    ds_config: dict[str, Any]  # the final DeepSpeed dict, exactly as given to deepspeed.initialize
    world_size: int
    ranks_per_node: int
    device: Device
    hidden_size: int  # the language model's (bucket sizes)
    explicit_groups: frozenset[str] = frozenset()  # what the command line named (launcher.config.ds_config)
    model_path: str | None = None  # the hub id or directory the ranks load (a tiny model built); None: unresolved
    launch_id: str | None = None  # which start of a SLURM job this is (launcher.launch.slurm.launch_id)
    resume: Resume | None = None
    # The planner's bytes per rank for this job (launcher.plan.memory.planned_bytes); None: not planned
    # (preflight=off, or the estimate failed). summary.json shows it beside the measured peak.
    planned_memory_bytes: int | None = None

    # ------------------------------------------------------------------ facts read from the dict
    @property
    def run_dir(self) -> Path:
        return self.hydra.run_dir

    @property
    def precision(self) -> str:
        """fp32 | bf16 | fp16: what the DeepSpeed dict trains in (launcher.config.precision.precision_of)."""
        return precision_of(self.ds_config)

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])

    @property
    def offload_optimizer(self) -> str | None:
        """cpu | nvme where the optimizer states live when offloaded, else None."""
        device = (self.ds_config["zero_optimization"].get("offload_optimizer") or {}).get("device")
        return None if device in (None, "none") else str(device)

    @property
    def micro_batch(self) -> int:
        return int(self.ds_config["train_micro_batch_size_per_gpu"])

    @property
    def global_batch(self) -> int:
        return int(self.ds_config["train_batch_size"])

    @property
    def max_steps(self) -> int:
        return int(self.config.train.max_steps)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """train.stages as planned over train.max_steps (launcher.config.stages); () without a schedule."""
        train, model = self.config.train, self.config.model
        frozen = freeze_flags(model)
        return plan_stages(train.stages, max_steps=self.max_steps, frozen=frozen, warmup_steps=train.warmup_steps)

    @property
    def labels(self) -> dict[str, Any]:
        """The group choices that say what the dict trains with (launcher.config.precision.labelled_choices):
        job.json's "choices", which summary.json, the comparison and W&B's tags read."""
        return labelled_choices(
            self.hydra.choices, self.ds_config, device=self.device, deepspeed_json=self.config.deepspeed_json
        )

    def summary(self) -> Summary:
        """The summary of this job before it has produced anything (its command line without credentials:
        a rank's job has the real values back, and summary.json is a file like any other)."""
        return Summary.planned(
            world_size=self.world_size,
            zero_stage=self.zero_stage,
            precision=self.precision,
            overrides=[credentials.redact_override(str(item)) for item in self.hydra.overrides],
            choices=self.labels,
            planned_memory_bytes=self.planned_memory_bytes,
        )

    def describe(self) -> str:
        """The line a run starts with: what the launcher decided, read from the final dict."""
        ds = self.ds_config
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        base_lr = float(ds["optimizer"]["params"]["lr"])
        rates = describe_groups(group_specs(self.config.train.groups), base_lr)
        if self.stages:
            rates = (rates + "; " if rates else "") + "stages " + ", ".join(s.describe(base_lr) for s in self.stages)
        data, per_rank = self.config.data, f"{ds['train_micro_batch_size_per_gpu']}"
        if data.packing:  # a micro batch is rows of several records each
            row = data.pack_length if data.pack_length is not None else data.max_length
            per_rank += f" packed rows of {row} tokens"
        return (
            f"job: {self.config.model.name} ({self.config.method.name}) on {ranks} ({self.device.kind}), "
            f"ZeRO {self.zero_stage}, offload {offload_of(ds)}, {self.precision}; batch {ds['train_batch_size']} "
            f"= {per_rank} per rank x {ds.get('gradient_accumulation_steps', 1)} "
            f"accumulated x {ranks}; {rates + '; ' if rates else ''}run dir {self.hydra.run_dir}"
        )

    def replace(self, **changes: Any) -> Job:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ job.json
    def to_json(self) -> dict[str, Any]:
        """job.json: the job, and (for readers of the file) the facts derived from it."""
        return {
            "version": JOB_VERSION,
            "hydra": self.hydra.to_json(),
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,
            "device": dataclasses.asdict(self.device),
            "hidden_size": self.hidden_size,
            "explicit_groups": sorted(self.explicit_groups),
            "model_path": self.model_path,
            "launch_id": self.launch_id,
            "resume": None if self.resume is None else self.resume.to_json(),
            "planned_memory_bytes": self.planned_memory_bytes,
            # Derived, for people and tools reading the file (not read back).
            "precision": self.precision,
            "stages": [stage.to_json() for stage in self.stages],
            "zero_stage": self.zero_stage,
            "max_steps": self.max_steps,
            "choices": self.labels,
            "config": plain(self.config),
            "ds_config": self.ds_config,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Job:
        if data.get("version") != JOB_VERSION:
            raise ValueError(f"job.json of layout {data.get('version')}, this launcher reads layout {JOB_VERSION}")
        resume = data.get("resume")
        return cls(
            hydra=HydraJob.from_json(data["hydra"]),
            config=from_plain(data["config"]),
            ds_config=dict(data["ds_config"]),
            world_size=int(data["world_size"]),
            ranks_per_node=int(data["ranks_per_node"]),
            device=Device(**data["device"]),
            hidden_size=int(data["hidden_size"]),
            explicit_groups=frozenset(data["explicit_groups"]),
            model_path=data.get("model_path"),
            launch_id=data.get("launch_id"),
            resume=None if resume is None else Resume.from_json(resume),
            planned_memory_bytes=data.get("planned_memory_bytes"),
        )


def read_job(run_dir: Path) -> Job:
    """The job a rank runs: job.json, with the credentials the launcher handed this process (its
    environment, never a file) put back (launcher.core.credentials)."""
    data = read_json(RunDir(Path(run_dir)).job)
    return Job.from_json(credentials.restore(data, credentials.from_environment()))
