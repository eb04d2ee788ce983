"""A run's length in epochs: `train.epochs` becomes `train.max_steps` once the data is known.

The published recipes (conf/recipe/) give their length in passes over the data; DeepSpeed's schedule
needs a number of optimizer steps. `train.max_steps`, when set, wins over `train.epochs`, as in the
HF Trainer (`max_steps` overrides `num_train_epochs`), so `train.max_steps=50` shortens a recipe's run.

steps = ceil(epochs x training records / global batch), counting the records of the training files
as read (before any image turns out not to decode under `data.on_bad_record=skip`). A mixture draws by
weight rather than passing over its sources, so it takes `train.max_steps`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from launcher.core.errors import LauncherError


def steps_for_epochs(epochs: float, records: int, global_batch: int) -> int:
    """Optimizer steps of `epochs` passes over `records` at `global_batch` samples per step (at least 1)."""
    return max(1, math.ceil(epochs * records / global_batch))


def training_records(data: Any, cache: Path) -> int:
    """How many training records the `data` config holds (the built-in set: data.n_train, unread)."""
    if data.synthetic:
        return int(data.n_train)
    if data.get("sources"):
        raise LauncherError(
            "train.epochs with a data mixture (data.sources): a mixture draws by weight, not in passes over "
            "its sources; give train.max_steps instead"
        )
    from launcher.data.records import read_data

    return len(read_data(data, cache).train)


def resolve_training_length(cfg: Any, world_size: int) -> str | None:
    """Set train.max_steps from train.epochs when only the epochs are given; the line that says so."""
    train = cfg.train
    if train.max_steps is not None or train.epochs is None:
        return None
    from launcher.config.ds_config import resolve_batch_sizes

    batch = resolve_batch_sizes(train.micro_batch_size, train.grad_accum, train.global_batch_size, world_size)
    records = training_records(cfg.data, Path(str(cfg.cache_dir)).expanduser())
    steps = steps_for_epochs(float(train.epochs), records, batch.total)
    train.max_steps = steps
    return (
        f"train.epochs={train.epochs:g} over {records:,} training records at a global batch of {batch.total}: "
        f"train.max_steps={steps}"
    )
