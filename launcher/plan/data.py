"""The planner's lines about the job's data: what will be read, indexed and cached before the first step,
how large and how long (launcher.data.estimate), or that it is built already."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from launcher.config.schema import Config
from launcher.core.errors import LauncherError
from launcher.data.cache import CachedDataset, RecordEncoder, built_cache, cache_key, image_storage, job_cache_path
from launcher.data.estimate import DataCost, cache_cost, index_cost
from launcher.data.index import Records, RecordTable, file_identity, holds_videos, index_table, read_index_meta
from launcher.data.length import LengthLimit
from launcher.data.records import INDEX_DIR, Source, data_sources, read_data
from launcher.data.stream import stream_files
from launcher.data.video import VideoSampling
from launcher.job.planning import cache_dir, world_size_of
from launcher.model.loading import load_processor
from launcher.model.stats import RecordShapes

log = logging.getLogger("launcher")


def data_lines(cfg: Config, model_path: str) -> list[str]:
    """One line per data file (its record index) and per split (its data cache), for the plan."""
    data = cfg.data
    if data.synthetic:
        return [f"data: the built-in set ({data.n_train} train, {data.n_eval} eval records), made at the first start"]
    if data.streaming:
        files = stream_files(str(data.path))
        return [f"data: streamed from {len(files)} file(s) as training goes; nothing is indexed or cached first"]
    cache = cache_dir(cfg)
    sources, eval_source = data_sources(data, cache)
    encode = _encoder(cfg, model_path) if data.cache else None
    lines = []
    for split, source in [*(("train", s) for s in sources), *([("eval", eval_source)] if eval_source else [])]:
        index = index_cost(source.path, source.options, cache / INDEX_DIR)
        if index is None:
            lines.append(f"record index of {source.path}: not estimated (a hub id, a `datasets` folder, or unreadable)")
            continue
        lines.append(index.line())
        if data.cache and index.records:
            lines.append(f"{split} {_cache(cfg, source, index, encode, model_path).line()}")
    return lines


def _cache(cfg: Config, source: Source, index: DataCost, encode: RecordEncoder | None, model_path: str) -> DataCost:
    """The split's data cache: built (when the index is, its key can be computed), or estimated."""
    data, cache = cfg.data, cache_dir(cfg)
    sample = index.sample or []
    videos = holds_videos(sample)  # of the records read so far; the whole split's where it is indexed
    if index.built:
        identity = file_identity(source.path) or []  # a local file: index_cost found its index
        table = RecordTable(index_table(identity, source.options, cache / INDEX_DIR))
        sample = [table[i] for i in range(min(len(table), 1000))]
        videos = holds_videos(table)
    records = int(index.records or 0)
    images = str(data.cache_images)
    if encode is not None:  # data.cache_images=auto decided as the job decides it (launcher.data.cache)
        images = image_storage(images, encode.processor, sample, records, videos=videos)
        encode = RecordEncoder(encode.processor, encode.limit, images, encode.video)
    if index.built and encode is not None:
        key = cache_key(Records([table]), encode.processor, model_path, encode.limit, encode.images, encode.video)
        built = built_cache(cache / "data_cache" / key)
        if built is not None:
            return DataCost("data cache", True, built.records, built.bytes, built.build_seconds)
    return cache_cost(
        records,
        sample or [],
        max_length=data.max_length,
        images=images,
        encode=encode,
        ranks=world_size_of(cfg),
    )


def _encoder(cfg: Config, model_path: str) -> RecordEncoder | None:
    """The job's record encoder, when its processor is in a local directory (a hub id is not fetched for a
    plan: no build time then)."""
    processor = _local_processor(cfg, model_path)
    if processor is None:
        return None
    return RecordEncoder(processor, LengthLimit.of(cfg.data), video=VideoSampling.of(cfg.data.video))  # images: _cache


def _local_processor(cfg: Config, model_path: str):
    """The job's processor when it is in a local directory, else None (a hub id is not fetched for a plan)."""
    if not Path(model_path).expanduser().is_dir():
        return None
    try:
        return load_processor(model_path, min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels)
    except (LauncherError, OSError, ValueError) as err:
        log.debug("no processor for the data plan: %s", err)
        return None


def record_shapes(cfg: Config, model_path: str) -> RecordShapes | None:
    """The tokens and images of each record of the job's train split, read from its data cache when that is
    built (by an earlier job with the same data settings, or `python -m launcher.prepare`); None when it is
    not, or cannot be looked for without building something: no data cache (data.cache=false, streaming), a
    data file not indexed yet, a processor not on local disk (a hub id is not fetched for a plan)."""
    data = cfg.data
    if not data.cache or data.streaming:
        return None
    cache = cache_dir(cfg)
    if not data.synthetic:  # only a built index is read: a plan indexes nothing
        sources, _ = data_sources(data, cache)
        for source in sources:
            identity = file_identity(source.path)
            if identity is None or read_index_meta(index_table(identity, source.options, cache / INDEX_DIR)) is None:
                return None
    processor = _local_processor(cfg, model_path)
    if processor is None:
        return None
    train = read_data(data, cache).train
    path = job_cache_path(data, cache, model_path, processor, train)
    if built_cache(path) is None:
        return None
    return cache_shapes(path, processor)


def cache_shapes(path: Path, processor: Any) -> RecordShapes:
    """The tokens and images of each record of the built data cache at `path` (read from its offsets and
    grids: no pixel is read)."""
    cached = CachedDataset(path, processor)
    images, patches = cached.vision_inputs()
    return RecordShapes(cached.lengths(), images, patches, str(path))
