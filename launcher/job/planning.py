"""Planning a job: from a typed config and the machine to the `Job` (launcher.job.spec).

    plan_job(config, hydra)      world size, device, hidden size, the DeepSpeed dict (validated): a Job
    training_length(config, ...) train.epochs counted in optimizer steps, once the data is known
    variant_overrides(...)       the command line of the same job with another preset and precision

The planner (launcher.plan) and the tuner (launcher.tune) plan what-if variants of a job the same way,
with another device or without the checks that need this machine (`validate=False`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.config.batch import resolve_batch_sizes
from launcher.config.ds_config import build_ds_config, explicit_groups_from_overrides
from launcher.config.precision import Device
from launcher.config.schema import Config, ModelConfig, plain
from launcher.core import credentials
from launcher.core.errors import LauncherError
from launcher.core.overrides import override_key
from launcher.data.records import read_data
from launcher.job.checks import (
    check_image_text_to_text,
    check_optimizer_and_scheduler,
    check_paths,
    detect_device,
    validate_with_deepspeed,
)
from launcher.job.spec import HydraJob, Job
from launcher.model.loading import read_config, text_hidden_size


def world_size_of(config: Config) -> int:
    """Ranks in the job: dist.nproc_per_node x dist.nnodes (the only place this product is taken)."""
    nproc, nnodes = int(config.dist.nproc_per_node), int(config.dist.nnodes)
    if nproc < 1 or nnodes < 1:
        raise LauncherError(f"dist.nproc_per_node={nproc} x dist.nnodes={nnodes} must be positive")
    return nproc * nnodes


def cache_dir(config: Config) -> Path:
    """Where built-in data, tiny models and data caches live (cache_dir, absolute)."""
    return Path(config.cache_dir).expanduser().absolute()


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


def model_hidden_size(model: ModelConfig) -> int:
    """Hidden size of the language model: a tiny model's config says; a real one's config file does
    (its `text_config`, shipped with the launcher for the real presets)."""
    if str(model.source) == "tiny":
        return int(model.hidden_size)
    if not model.path:
        raise LauncherError(f"model.path is empty for model={model.name}: give a hub id or a local directory")
    config = read_config(str(model.path))
    check_image_text_to_text(config, model.path)
    try:
        return text_hidden_size(config)
    except AttributeError:
        raise LauncherError(f"model.path={model.path}: its config has no hidden_size for the language model") from None


def plan_job(
    config: Config,
    hydra: HydraJob,
    *,
    device: Device | None = None,
    hidden_size: int | None = None,
    validate: bool = True,
) -> Job:
    """The job of a typed config on this machine (or on `device`, when planning for another).

    `validate` also runs the checks that need this machine (NVMe paths) and DeepSpeed's own config
    models; the planner's what-if variants skip them. The config's ranges were checked before
    (launcher.config.ranges.check_config)."""
    world_size = world_size_of(config)
    device = device or detect_device()
    hidden_size = hidden_size or model_hidden_size(config.model)
    explicit = explicit_groups_from_overrides(list(hydra.overrides))
    base = load_deepspeed_json(config.deepspeed_json) if config.deepspeed_json else None
    composed = plain(config)
    if composed["train"]["max_steps"] is None:
        # Planned before the data is counted (the planner, the tuner's candidates; a run counts it first,
        # `training_length`): the schedule's length changes no memory figure, so a stand-in does.
        composed["train"]["max_steps"] = 1
    ds = build_ds_config(
        composed,
        world_size=world_size,
        hidden_size=hidden_size,
        device=device,
        base=base,
        base_source=f"deepspeed_json={config.deepspeed_json}",
        explicit_groups=explicit,
    )
    if validate:
        check_paths(ds)
        validate_with_deepspeed(ds)
        check_optimizer_and_scheduler(ds)
    return Job(
        hydra=hydra,
        config=config,
        ds_config=ds,
        world_size=world_size,
        ranks_per_node=int(config.dist.nproc_per_node),
        device=device,
        hidden_size=hidden_size,
        explicit_groups=explicit,
    )


def job_credentials(config: Config) -> dict[str, Any]:
    """The credentials job.json leaves out of a job of this config, by their paths in it: the config's
    own, and the DeepSpeed dict's (only deepspeed_json and deepspeed_extra bring any; extra is merged last)."""
    base = load_deepspeed_json(config.deepspeed_json) if config.deepspeed_json else {}
    return {
        **credentials.split({"config": plain(config)})[1],
        **credentials.split({"ds_config": base})[1],
        **credentials.split({"ds_config": config.deepspeed_extra})[1],
    }


# ----------------------------------------------------------------------------- length in epochs
def steps_for_epochs(epochs: float, records: int, global_batch: int) -> int:
    """Optimizer steps of `epochs` passes over `records` at `global_batch` samples per step (at least 1)."""
    return max(1, math.ceil(epochs * records / global_batch))


def training_records(config: Config) -> int:
    """How many training records the data config holds (the built-in set: data.n_train, unread).

    Counted as read (before any image turns out not to decode under data.on_bad_record=skip)."""
    data = config.data
    if data.packing:
        raise LauncherError(
            "train.epochs with data.packing=true: a step holds as many records as its rows fit, known only once "
            "they are planned; give train.max_steps instead"
        )
    if data.synthetic:
        return int(data.n_train)
    if data.streaming:
        raise LauncherError(
            "train.epochs with data.streaming=true: a stream is not counted before training; give train.max_steps "
            "instead (steps = epochs x records / global batch)"
        )
    if data.sources:
        raise LauncherError(
            "train.epochs with a data mixture (data.sources): a mixture draws by weight, not in passes over "
            "its sources; give train.max_steps instead"
        )
    return len(read_data(data, cache_dir(config)).train)


def training_length(config: Config) -> tuple[Config, str | None]:
    """The config with train.max_steps set from train.epochs when only the epochs are given, and the line
    that says so; the config as it is otherwise.

    The published recipes (conf/recipe/) give their length in passes over the data; DeepSpeed's schedule
    needs optimizer steps: steps = ceil(epochs x training records / global batch). `train.max_steps`,
    when set, wins, as in the HF Trainer (`max_steps` overrides `num_train_epochs`), so
    `train.max_steps=50` shortens a recipe's run."""
    train = config.train
    if train.max_steps is not None or train.epochs is None:
        return config, None
    batch = resolve_batch_sizes(
        train.micro_batch_size, train.grad_accum, train.global_batch_size, world_size_of(config)
    )
    records = training_records(config)
    steps = steps_for_epochs(float(train.epochs), records, batch.total)
    counted = dataclasses.replace(config, train=dataclasses.replace(train, max_steps=steps))
    line = (
        f"train.epochs={train.epochs:g} over {records:,} training records at a global batch of {batch.total}: "
        f"train.max_steps={steps}"
    )
    return counted, line


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


def variant_overrides(overrides: Sequence[str], preset: str, dtype: str) -> list[str]:
    """The command line of `train.py OVERRIDES` with `deepspeed=PRESET precision=DTYPE` instead of the
    user's own ZeRO, offload and precision choices."""
    kept = [o for o in overrides if override_key(o) not in VARIANT_KEYS]
    return [*kept, f"deepspeed={preset}", f"precision={dtype}"]
