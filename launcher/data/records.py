"""A job's records: its sources (one file, or a weighted mixture), read into one form, and the dataset over them.

Records are read by launcher/data/formats.py (LLaVA, ShareGPT, OpenAI-style messages; JSON, JSON lines,
`datasets` files) into one form: {"id", "where", "images", "messages"}, any number of images each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from launcher.config.schema import DataConfig, SourceConfig
from launcher.core.errors import LauncherError
from launcher.data.formats import (
    DEFAULT_MAX_IMAGE_PIXELS,
    BadRecordError,
    ReadOptions,
    looks_like_hub_id,
    open_image,
    read_records,
)
from launcher.data.index import Records, indexed_records
from launcher.data.shapes import prepare_data
from launcher.data.video import BadVideoError, Clip, VideoSampling, decode_clip, media_in_order

INDEX_DIR = "record_index"  # under cache_dir


@dataclass
class Source:
    """One data source: a file, folder or hub id, its mixture weight, and how to read it."""

    name: str
    path: str
    weight: float
    options: ReadOptions


@dataclass
class LoadedData:
    """The records of a run: every train record carries "source", its index into `sources`."""

    train: Records
    eval: Records
    skipped: int
    sources: list[Source]
    formats: list[str]  # each source's format, as read (auto-detected or given)
    skip_log: list[dict] = field(default_factory=list)  # one entry per skipped record (formats.skipped_entry)

    @property
    def mixture(self) -> bool:
        return len(self.sources) > 1


def load_records(path: str | Path, image_root: str | Path | None = None, **options: Any) -> tuple[list[dict], int]:
    """Read one file's records (any format, see launcher/formats.py); return (records, number skipped)."""
    root = Path(image_root) if image_root is not None else None
    records, skipped, _ = read_records(path, ReadOptions(image_root=root, **options))
    return records, skipped


def read_data(data: DataConfig, cache: Path, *, decode: bool = False) -> LoadedData:
    """The train and eval records of the `data` config (the built-in set is generated first), each file's
    from its record index (launcher.data.index: read and checked once, then memory-mapped).

    `decode=True` decodes every image while reading, so that under data.on_bad_record=skip a truncated
    image is skipped here rather than failing a DataLoader worker later."""
    sources, eval_source = data_sources(data, cache, decode=decode)
    parts, skipped, formats = [], 0, []
    train_log: list[dict] = []
    if data.streaming:  # the training records are read as training goes (launcher.data.stream)
        formats = [f"{data.format} (streamed)"]
    for source in [] if data.streaming else sources:
        records, source_skipped, fmt = indexed_records(source.path, source.options, cache / INDEX_DIR, train_log)
        parts.append(records)
        skipped += source_skipped
        formats.append(fmt)
    eval_records = Records([])
    eval_log: list[dict] = []
    if eval_source is not None:
        records, eval_skipped, _ = indexed_records(eval_source.path, eval_source.options, cache / INDEX_DIR, eval_log)
        eval_records = Records([records])
        skipped += eval_skipped
    skip_log = [{"split": split, **entry} for split, log in (("train", train_log), ("eval", eval_log)) for entry in log]
    return LoadedData(Records(parts), eval_records, skipped, sources, formats, skip_log)


def data_sources(data: DataConfig, cache: Path, *, decode: bool = False) -> tuple[list[Source], Source | None]:
    """The training sources (one, or data.sources) and the held-out source of the `data` config."""
    if data.synthetic:
        train_file, eval_file, image_root = prepare_data(data, cache)
        options = _read_options(data, cache, image_root=image_root, decode=decode, check_headers=False)
        return [Source(str(data.name), str(train_file), 1.0, options)], Source("eval", str(eval_file), 1.0, options)
    if data.image_root and not Path(str(data.image_root)).expanduser().is_dir():
        raise LauncherError(f"data.image_root={data.image_root}: no such directory")
    if data.streaming:  # data.path names shard files (a folder, a glob, a URL): launcher.data.stream lists them
        options = _read_options(data, cache, image_root=data.image_root, decode=False)
        return [Source(str(data.name), str(data.path), 1.0, options)], _eval_source(data, cache, decode)
    listed = list(data.sources or [])
    if listed and data.path:
        raise LauncherError("data.path and data.sources are both set: give one file (data.path) or a mixture")
    if not listed and not data.path:
        raise LauncherError(f"data.path is not set for data={data.name}: give the training file, folder or hub id")
    entries = listed or [SourceConfig(path=str(data.path))]
    sources = []
    for index, entry in enumerate(entries):
        key = f"data.sources[{index}]" if listed else "data"
        path = _existing_data_path(entry.path, f"{key}.path")
        weight = entry.weight
        if not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
            raise LauncherError(f"{key}.weight={weight}: a mixture weight must be a positive number")
        name = entry.name or Path(path).stem or f"source{index}"
        root = entry.image_root or data.image_root
        options = _read_options(data, cache, image_root=root, decode=decode, fmt=entry.format)
        sources.append(Source(str(name), path, float(weight), options))
    names = [source.name for source in sources]
    if len(set(names)) < len(names):
        raise LauncherError(f"data.sources: names {names} repeat; give each source a distinct name")
    return sources, _eval_source(data, cache, decode)


def _eval_source(data: DataConfig, cache: Path, decode: bool) -> Source | None:
    if not data.eval_path:
        return None
    path = _existing_data_path(data.eval_path, "data.eval_path")
    options = _read_options(data, cache, image_root=data.image_root, decode=decode)
    return Source("eval", path, 1.0, replace(options, split=str(data.eval_split or "train")))


def _read_options(
    data: DataConfig, cache: Path, *, image_root: Any, decode: bool, fmt: Any = None, check_headers: bool = True
) -> ReadOptions:
    return ReadOptions(
        check_headers=check_headers,
        format=str(fmt or data.format or "auto"),
        image_root=Path(str(image_root)).expanduser() if image_root else None,
        on_bad_record=str(data.on_bad_record),
        max_image_pixels=int(data.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS),
        video=VideoSampling.of(data.video),
        decode=decode,
        split=str(data.split or "train"),
        cache_dir=cache / "hf_datasets",
        pairs=bool(data.pairs),
    )


def _existing_data_path(path: Any, key: str) -> str:
    """A local file or folder that exists, or something that looks like a hub id ("org/name")."""
    if not path:
        raise LauncherError(f"{key} is not set: give the training file, folder or hub id")
    local = Path(str(path)).expanduser()
    if local.exists():
        return str(local)
    if looks_like_hub_id(str(path)):
        return str(path)
    raise LauncherError(f"{key}={path}: no such file or folder")


class ConversationDataset(Dataset):
    """Records -> {"id", "where", "images": RGB PIL images, "messages", "source"}; images decode here, in workers.

    A record's videos are sampled and decoded here too (`video`: data.video): such a sample also holds
    "videos" (each video's sampled frames, in order), "video_fps" (their frames per second of video),
    "video_grid" (data.video.grid) and "media" ((source, frames) per image or video part, in order, which the
    data cache stores encoded). Its messages keep their video parts: the collator gives them to the model as
    videos, or as frames tiled into images (launcher.data.video.as_model_takes)."""

    def __init__(self, records: Sequence[dict], video: VideoSampling | None = None):
        self.records = records
        self.video = video or VideoSampling()

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        return decode_record(self.records[index], self.video)


def decode_record(record: dict, video: VideoSampling) -> dict:
    """One record as training takes it: its images decoded, its videos' frames sampled and decoded."""
    where = record["where"]
    images = [open_image(image, where) for image in record["images"]]
    sample = {"id": record["id"], "where": where, "images": images, "messages": record["messages"]}
    if record.get("videos"):
        clips = [_clip(source, where, video) for source in record["videos"]]
        sample["videos"], sample["video_fps"] = [clip.frames for clip in clips], [clip.fps for clip in clips]
        sample["video_grid"] = video.grid  # how a model of images tiles them (launcher.data.video.tile_frames)
        counts = [(source, len(clip.frames)) for source, clip in zip(record["videos"], clips, strict=True)]
        sample["media"] = media_in_order(record["messages"], record["images"], counts)
    sample["source"] = record.get("source", 0)
    return sample


def _clip(source: str | bytes, where: str, video: VideoSampling) -> Clip:
    try:
        return decode_clip(source, video)
    except BadVideoError as error:
        raise BadRecordError(f"{where}: {error}; fix or remove it, or set data.on_bad_record=skip") from None


def require_one_global_batch(records: int, micro: int, world_size: int) -> None:
    """Training needs at least one micro-batch per rank of usable records."""
    if records < micro * world_size:
        raise LauncherError(
            f"data: {records} usable training records, fewer than one global micro-batch ({micro} x {world_size} ranks)"
        )
