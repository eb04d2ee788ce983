"""A job's data made ready before its first step, outside the job: its record index and data cache, keyed as
the job keys them. `python -m launcher.prepare` (launcher/prepare) runs it on its own; the tuner runs it
before planning its candidates, so they are planned from the records in the cache (launcher.plan.data)."""

from __future__ import annotations

from launcher.config.schema import Config
from launcher.core.errors import LauncherError
from launcher.data.cache import CacheInfo, Part, ensure_job_cache
from launcher.data.records import LoadedData, read_data
from launcher.job.planning import cache_dir
from launcher.model.loading import load_processor
from launcher.model.stats import model_dir


def prepare(cfg: Config, part: Part) -> tuple[LoadedData, dict[str, CacheInfo]]:
    """The records (from their index) and each split's data cache of the job `cfg` describes (every process
    of `part` calls it; process 0 indexes the data first, the others then open its index)."""
    if not cfg.data.cache:
        raise LauncherError("data.cache=false: the job reads its records as they are; there is no cache to prepare")
    if cfg.data.streaming:
        raise LauncherError(
            "data.streaming=true: the job reads its training records as it trains; there is nothing to prepare"
        )
    if part.rank != 0:
        part.barrier()
    model = model_dir(cfg)  # a tiny model is built from the data here, as the launcher builds it
    loaded = read_data(cfg.data, cache_dir(cfg))
    if part.rank == 0:
        part.barrier()
    processor = load_processor(model, min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels)
    splits = {"train": loaded.train, "eval": loaded.eval}
    return loaded, {
        split: ensure_job_cache(cfg.data, cache_dir(cfg), str(model), processor, records, part)
        for split, records in splits.items()
        if len(records)
    }
