"""The fast data path: every record tokenized once into memory-mapped shards, its images kept encoded
(or, for small sets of small images, as pixel values).

Without it each step runs the whole processor again (the chat template, the tokenizer, the image
processor). With it a step reads ready token tensors and pads them; DataLoader workers decode each
record's images from the bytes stored beside its tokens and run the image processor on them, as the
processor would (`data.cache_images=encoded`). `data.cache_images=pixels` stores the image processor's
float32 output instead (4 bytes per value: 1.3 MiB per 336 x 336 image, against the tens of KB of its
JPEG): no image work left for the workers, for sets small enough to afford the disk. `auto`, the default,
picks pixels while they surely fit in PIXELS_BUDGET_BYTES (`image_storage`).

Layout of one cache (a directory under cache_dir/data_cache/, named by its key):
    meta.json          the key's inputs, record count, the records skipped (and why) and cut, the shards and
                       every tensor's dtype and trailing shape, every other file's size and XXH3-128 checksum
    records.npz        each record's position in the records given and its source; ids.arrow: its id
    shards/NNNNN/      the records [N x shard_records, (N+1) x shard_records) that survived:
        <name>.bin     one flat file per tensor (input_ids, labels, image_bytes, ...), records back to back;
                       64-bit integers in 32 bits (read back as 64-bit)
        index.npz      per tensor: the offsets of each record's rows
        shard.json     what the shard kept, skipped and cut, its files' sizes and checksums; its presence
                       marks the shard complete

Every rank builds the shards whose number is its rank modulo the world size, at the same time as the
others (with `data.num_workers` DataLoader workers each); a killed build leaves its complete shards, and
the next one builds only the others. Rank 0 then writes meta.json, and the build's directory is renamed
into place: nothing that looks complete exists before the last write.

Every start checks a complete cache against meta.json's sizes and checksums before it trains on it (rank 0,
bound by the disk: launcher.core.manifest). A shard that differs (cut short, bytes changed, missing) is
named in one line and built again, the intact ones kept: the cache goes back to being a build that lacks
those shards. A cache written before the checksums existed is trusted as it is.

Why flat files and np.memmap, not the `datasets` Arrow cache: a record is a handful of arrays of
different lengths; reading one from a memory map is a slice and a copy, with no conversion of nested
lists, and the page cache shares the bytes between DataLoader workers and ranks on one machine.

The key covers what the tensors and their bookkeeping depend on: the records (for indexed files, the
record index's key: each data file's path, size and modification time and how it was read; for records
read into a list, their source, text, and each image's path, size and modification time, or its bytes:
so an image replaced in place under the same name is noticed only then), the processor (tokenizer,
chat template, image settings such as min/max pixels), the model, data.max_length / data.truncation (a
record over the limit is stored cut, or skipped) and data.cache_images. A change to any of them builds a
new cache; a complete cache is reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset

from launcher.config.schema import CacheImages, DataConfig
from launcher.core.children import helper_process
from launcher.core.disk import free_space
from launcher.core.errors import Interrupted, LauncherError, TrainingFailed
from launcher.core.manifest import damage, fingerprint
from launcher.core.signals import pause_for_test
from launcher.data.collate import Collator, add_dummy_media, nothing_fits
from launcher.data.formats import BadRecordError, open_image, skipped_entry
from launcher.data.index import Records, holds_videos
from launcher.data.length import IMAGES, VIDEOS, LengthLimit, RecordTooLong, fit_to_length, one_row, pad_rows, unchanged
from launcher.data.records import ConversationDataset
from launcher.data.video import (
    VideoSampling,
    decode_clip,
    decode_frames,
    images_per_video,
    tile_frames,
    video_pixels,
)

log = logging.getLogger("launcher")

# 10: a frames-as-images model's frames tiled data.video.grid x grid per image, Qwen2.5-VL's seconds per
# temporal patch (remade with the pixels); 9: the Qwen2-VL family takes videos as videos (video_grid_thw;
# stored whole); 8: videos (their files' bytes, the frames kept of each) and data.video in the key; 7: answers
# kept as written (no longer stripped: code keeps its indentation); 6: 64-bit integer tensors stored in 32 bits
# (NARROWED); 5: which records it holds in arrays (records.npz, ids.arrow), not in meta.json; 4: images kept
# encoded (data.cache_images), shards built by every rank; 3: data.max_length in the key
CACHE_VERSION = 10
META_FILE = "meta.json"
RECORDS_FILE = "records.npz"
IDS_FILE = "ids.arrow"
INDEX_FILE = "index.npz"
SHARD_FILE = "shard.json"
SHARDS_DIR = "shards"
CHECKSUM = "xxh3_128"  # the files' checksum in shard.json and meta.json (launcher.core.manifest)
CHECK_SAY_S = 10.0  # a check of a complete cache that takes longer says how long it took
SHARD_RECORDS = 2048  # records per shard: what a killed build loses at most, per rank
IMAGE_STORAGE = tuple(choice.value for choice in CacheImages if choice.value != "auto")  # how a cache keeps them
# data.cache_images=auto keeps pixel values while a split's would take at most this: on a small set of small
# images (the built-in one: 4,200 of 32 x 32, 50 MB) the workers' decoding cost the default job 1.36x the CPU
# of keeping pixels (bench/default_job.py, issue 44); on LLaVA-665K they would take ~900 GB.
PIXELS_BUDGET_BYTES = 2 << 30
# The tensors an encoded record holds in place of pixel_values: its images' bytes, and each one's length; a
# record with videos also holds, per stored file in the order of its parts, 0 for an image or the number of
# the video's sampled frames it keeps (its frames decoded again in the worker, as sampled when it was built).
IMAGE_BYTES, IMAGE_LENGTHS, VIDEO_FRAMES = "image_bytes", "image_lengths", "video_frames"
PROGRESS_EVERY_S = 30.0
FINISH_WAIT_S = 60.0  # how long a build whose shard vanished waits for the job that is finishing the cache
# 64-bit integer tensors (token ids, labels, masks, image grids, image byte lengths) are stored in 32 bits,
# half the disk and page cache, and read back as 64-bit: a token id or length past 2**31 is refused.
NARROWED = {np.dtype(np.int64).str: np.dtype(np.int32)}


def cache_key(
    records: Sequence[dict],
    processor: Any,
    model: str,
    limit: Any = None,
    images: str = "encoded",
    video: VideoSampling | None = None,
) -> str:
    """A digest of everything a cached tensor depends on (`limit`: a data.LengthLimit, or None; `images`:
    data.cache_images; `video`: data.video, which frames of a video train)."""
    digest = hashlib.sha256()
    length = {"max_length": limit.max_length, "truncation": limit.truncation} if limit is not None else None
    sampling = asdict(video or VideoSampling())
    settings = {"version": CACHE_VERSION, "model": model, "length": length, "images": images, "video": sampling}
    digest.update(json.dumps(settings).encode())
    digest.update(processor_fingerprint(processor).encode())
    indexed = records.fingerprint() if isinstance(records, Records) else None
    if indexed is not None:  # the record index's key covers each data file and how it was read
        digest.update(indexed.encode())
        return digest.hexdigest()[:20]
    for record in records:
        identities = [_image_identity(image) for image in [*record["images"], *record.get("videos", ())]]
        digest.update(json.dumps([record["id"], record.get("source", 0), record["messages"], identities]).encode())
    return digest.hexdigest()[:20]


def processor_fingerprint(processor: Any) -> str:
    """The processor settings tensors depend on: image processing, chat template, tokenizer."""
    tokenizer = processor.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state: Any = repr(tokenizer.get_vocab())
    if backend is not None:
        # Less the padding and truncation state, which the first call with padding=True sets: otherwise
        # a processor that has encoded a batch (rank 0's, after building the train split's cache) gives
        # other keys than a fresh one.
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
    parts = {
        "class": type(processor).__name__,
        "image_processor": processor.image_processor.to_dict(),
        "chat_template": processor.chat_template,
        "tokenizer": state,
        "special": tokenizer.special_tokens_map,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _image_identity(image: str | bytes) -> Any:
    if isinstance(image, bytes):
        return hashlib.sha256(image).hexdigest()
    stat = os.stat(image)
    return [image, stat.st_size, stat.st_mtime_ns]


def image_storage(setting: str, processor: Any, sample: Sequence[dict], records: int, *, videos: bool) -> str:
    """How a split of `records` records like `sample`'s keeps its images: `setting` (data.cache_images),
    with auto made pixels when the image processor's output has a bound (a fixed size, or a max_pixels)
    whose total over the split's images stays within PIXELS_BUDGET_BYTES, encoded otherwise; encoded
    whenever the split has a video (`videos`: `holds_videos` of the whole split), as a video's frames stay in
    its file."""
    if setting != "auto":
        return setting
    if videos:  # a video's frames stay in its file, never decoded on disk
        return "encoded"
    per_image = pixel_bytes_bound(processor.image_processor)
    images_per_record = sum(len(record.get("images") or ()) for record in sample) / max(1, len(sample))
    if per_image is None or images_per_record * records * per_image > PIXELS_BUDGET_BYTES:
        return "encoded"
    return "pixels"


def pixel_bytes_bound(image_processor: Any) -> int | None:
    """The most bytes one image's float32 pixel values take with this image processor: a fixed size (a
    centre crop, or a resize to height x width), or a dynamic resolution's max_pixels (Qwen2-VL: two
    frames per patch); None when nothing bounds it."""
    size = getattr(image_processor, "size", None) or {}
    most = getattr(image_processor, "max_pixels", None) or size.get("longest_edge")
    if most and hasattr(image_processor, "temporal_patch_size"):
        return int(most) * 3 * int(image_processor.temporal_patch_size or 2) * 4
    crop = getattr(image_processor, "crop_size", None) if getattr(image_processor, "do_center_crop", False) else None
    fixed = crop or (size if "height" in size and "width" in size else None)
    if fixed and "height" in fixed and "width" in fixed:
        return int(fixed["height"]) * int(fixed["width"]) * 3 * 4
    return None


# ----------------------------------------------------------------------------- building
class RecordEncoder:
    """A decoded sample -> (its tensors, whether they were cut): `Collator`'s batch of that one sample,
    without the batch axis, cut to `limit` (data.max_length) as `Collator` cuts it; RecordTooLong when
    the sample is skipped instead. With `images="encoded"` the pixel values give way to the bytes of the
    images the cut kept (`encoded_images`), which `CachedDataset` turns back into the same pixel values. A
    sample with videos (its "media") keeps each video's file, sampled again as `video` says when read."""

    def __init__(self, processor: Any, limit: Any = None, images: str = "encoded", video: VideoSampling | None = None):
        if images not in IMAGE_STORAGE:
            raise LauncherError(f"data.cache_images={images} is not one of {', '.join(IMAGE_STORAGE)}")
        self.processor = processor
        self.collate = Collator(processor)
        self.limit = limit or LengthLimit()
        self.images = images
        self.video = video or VideoSampling()

    def __call__(self, sample: dict, sources: list[str | bytes] | None = None) -> tuple[dict[str, torch.Tensor], bool]:
        tensors, cut = fit_to_length(one_row(self.collate.labelled([sample])), self.limit, self.processor)
        pixels = [name for name in ("pixel_values", "pixel_values_videos") if name in tensors]
        if self.images == "encoded" and pixels:
            media = sample.get("media")
            if not media:
                stored = encoded_images(sources or [], kept=IMAGES.count(tensors))
            elif VIDEOS.grid in tensors:  # videos as videos: every image and video kept whole, in order
                stored = encoded_media(media, kept=IMAGES.count(tensors) + VIDEOS.count(tensors), whole_videos=True)
            else:  # videos as their frames: the first `kept` pictures
                stored = encoded_media(media, kept=IMAGES.count(tensors), grid=self.video.grid)
            tensors = {name: value for name, value in tensors.items() if name not in pixels}
            tensors.update(stored)
        return tensors, cut


def encoded_images(sources: list[str | bytes], *, kept: int) -> dict[str, torch.Tensor]:
    """The first `kept` images' file bytes, back to back, and each one's length."""
    blobs = [source if isinstance(source, bytes) else Path(source).read_bytes() for source in sources[:kept]]
    joined = np.frombuffer(b"".join(blobs), dtype=np.uint8).copy()
    return {
        IMAGE_BYTES: torch.from_numpy(joined),
        IMAGE_LENGTHS: torch.tensor([len(blob) for blob in blobs], dtype=torch.int64),
    }


def encoded_media(
    media: list[tuple[str | bytes, int]], *, kept: int, whole_videos: bool = False, grid: int = 1
) -> dict[str, torch.Tensor]:
    """The files of a record's images and videos (source, frames; 0 frames: an image) whose pictures are among
    the first `kept`, back to back, each one's length, and the frames kept of each video (0 for an image).
    `whole_videos` (a model that takes videos as videos): a video counts as one picture, its frames all kept;
    else its frames are pictures of grid x grid frames each (launcher.data.video.tile_frames)."""
    files, frames_kept = [], []
    for source, frames in media:
        if kept <= 0:
            break
        pictures = 1 if whole_videos or not frames else images_per_video(frames, grid)
        files.append(source)
        frames_kept.append(frames if whole_videos else min(frames, kept * grid * grid))
        kept -= pictures
    return {
        **encoded_images(files, kept=len(files)),
        VIDEO_FRAMES: torch.tensor(frames_kept, dtype=torch.int64),
    }


@dataclass
class CacheInfo:
    """What `ensure_cache` found or built."""

    path: Path
    built: bool  # False: a complete cache was reused
    build_seconds: float | None
    records: int
    skipped: int  # records whose images failed to decode while building (data.on_bad_record=skip)
    truncated: int = 0  # records stored cut to data.max_length
    too_long: int = 0  # records over data.max_length that could not be cut (or data.truncation=skip)
    skip_log: list[dict] = field(default_factory=list)  # each skipped record: formats.skipped_entry
    bytes: int = 0  # the cache's size on disk


@dataclass(frozen=True)
class Part:
    """Which shards this process builds: those whose number is `rank` modulo `world_size`. `barrier` waits
    for every rank (a no-op for one process). `stop_wanted` says whether a stop signal reached this process
    (checked between shards); `any_rank` tells every rank whether any rank's flag is set (a collective, so
    the ranks stop a build together; None: only this process's flag counts)."""

    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] = lambda: None
    stop_wanted: Callable[[], bool] = lambda: False
    any_rank: Callable[[bool], bool] | None = None

    def agree_to_stop(self, flag: bool) -> bool:
        """A barrier at which every rank learns whether any of them was asked to stop."""
        if self.any_rank is None:
            self.barrier()
            return flag
        return self.any_rank(flag)


def ensure_cache(
    root: Path,
    records: Sequence[dict],
    processor: Any,
    model: str,
    encode: RecordEncoder,
    load: Callable[[int], dict],
    *,
    on_bad_record: str,
    num_workers: int,
    part: Part = Part(),
    shard_records: int = SHARD_RECORDS,
    check: str = "checksums",
) -> CacheInfo:
    """The cache for these records, built when missing, by every rank of `part` at once (each rank calls
    this). `load(i)` decodes record i (images and all, raising BadRecordError when it cannot); `encode`
    turns it into the record's tensors, cut to its limit (part of the key). A record over the limit that
    cannot be cut is skipped whatever `on_bad_record` says. `check` (data.cache_check): what rank 0 checks of
    a complete cache first, every file's checksum or its size."""
    key = cache_key(records, processor, model, encode.limit, encode.images, encode.video)
    path = root / key
    started = time.perf_counter()
    building = root / f".{key}.building"  # shared by every rank, and by the next attempt of a killed build
    if part.rank == 0 and path.exists():
        with _one_check_at_a_time(root):  # two jobs that start on one damaged cache would both reopen it
            if path.exists():  # the other job may have reopened it meanwhile: then this one builds with it
                _reopen_if_damaged(path, building, sizes_only=check == "sizes")
    part.barrier()  # every rank sees the cache rank 0 checked (or the build it became)
    existed = _read_meta(path) is not None
    build = _ShardBuild(building, records, encode, load, on_bad_record, num_workers, shard_records)
    if not existed:
        if part.rank == 0:
            log.info("data cache: tokenizing %d records once, into %s", len(records), path)
        mine = range(part.rank, build.shards, part.world_size)
        _unless_finished_elsewhere(path, lambda: build.run(mine, progress=part.rank == 0, stop=part.stop_wanted))
    if part.agree_to_stop(build.stopped):  # every rank's shards are written, or some rank was asked to stop
        done = sum(_read_json(build.shard_dir(n) / SHARD_FILE) is not None for n in range(build.shards))
        raise Interrupted(
            f"stopped by a signal while building the data cache {path}: {done} of its {build.shards} shards are "
            "written and kept, and the next start builds only the rest"
        )
    if part.rank == 0 and _read_meta(path) is None:
        _unless_finished_elsewhere(path, lambda: build.finish(path, key, model, started))
    part.barrier()  # meta.json is written
    meta = _read_meta(path)
    if meta is None:  # this rank's cache_dir is not rank 0's (another node's own disk): finish it here
        meta = build.finish(path, key, model, started)
    return _info(path, meta, built=not existed)


def cache_damage(path: Path, *, sizes_only: bool = False, meta: dict | None = None) -> dict[str, str]:
    """Each file of the complete cache at `path` that differs from its meta.json (relative path -> why; `meta`:
    that file, read already); empty when none does, or when the cache predates the checksums. `sizes_only`:
    compare the sizes, not the bytes."""
    meta = meta if meta is not None else _read_meta(path) or {}
    found = {}
    for name, recorded in meta.get("files", {}).items():
        problem = damage(path / name, {"bytes": recorded["bytes"]} if sizes_only else recorded)
        if problem is not None:
            found[name] = problem
    return found


@contextlib.contextmanager
def _one_check_at_a_time(root: Path) -> Iterator[None]:
    """Hold the data caches' folder (an OS lock on the folder itself, so no file is left behind) while a
    job checks, and perhaps reopens, a cache in it; another job's check waits. Released however the
    process ends."""
    handle = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)  # releases the lock


def _reopen_if_damaged(path: Path, building: Path, *, sizes_only: bool) -> None:
    """Check the complete cache at `path`; a damaged one goes back to being the build `building` with its
    intact shards, so that the build writes the others again (records.npz, ids.arrow and meta.json too).
    One whose meta.json cannot be read (it is renamed into place with it: never legitimately) is removed."""
    meta = _read_meta(path)
    if meta is None:
        log.warning("data cache %s: its %s cannot be read (damaged): building the cache again", path, META_FILE)
        _removed(path)
        return
    started = time.perf_counter()
    found = cache_damage(path, sizes_only=sizes_only, meta=meta)
    seconds = time.perf_counter() - started
    if seconds > CHECK_SAY_S:
        log.info("data cache: %s checked in %.0f s (data.cache_check=sizes checks the sizes alone)", path, seconds)
    if not found:
        return
    first = next(iter(found))
    shards = sorted({name.split("/")[1] for name in found if name.startswith(f"{SHARDS_DIR}/")})
    log.warning(
        "data cache %s is damaged (%s: %s%s): building %s again, the other shards kept",
        path,
        path / first,
        found[first],
        f"; {len(found) - 1} more file(s)" if len(found) > 1 else "",
        f"shard(s) {', '.join(shards)}" if shards else "its record list",
    )
    try:
        (path / META_FILE).unlink()  # first: from here on nothing says the cache is complete
        shutil.rmtree(building, ignore_errors=True)  # a leftover of a build that another job then finished
        os.rename(path, building)
        for shard in shards:
            if (building / SHARDS_DIR / shard).exists():
                shutil.rmtree(building / SHARDS_DIR / shard)
        for name in (RECORDS_FILE, IDS_FILE):
            (building / name).unlink(missing_ok=True)
    except OSError as error:
        raise LauncherError(
            f"data cache {path} is damaged ({path / first}: {found[first]}) and cannot be rebuilt in place "
            f"({error.strerror or error}): delete it (and {building}) to have it built again, or set cache_dir "
            "to a writable disk"
        ) from error


def _removed(path: Path) -> None:
    """Remove a damaged cache: renamed aside first (atomic: no reader finds it half-removed), then deleted."""
    aside = path.with_name(f".{path.name}.damaged-{os.getpid()}")
    try:
        os.rename(path, aside)
    except OSError as error:
        raise LauncherError(
            f"data cache {path} is damaged and cannot be removed ({error.strerror or error}): delete it to have it "
            "built again, or set cache_dir to a writable disk"
        ) from error
    shutil.rmtree(aside, ignore_errors=True)


def ensure_job_cache(
    data: DataConfig, cache: Path, model: str, processor: Any, records: Sequence[dict], part: Part
) -> CacheInfo:
    """The cache of one split of a job's records, as a job with this `data` config and `model` (its
    resolved path) keys and builds it: the job itself, and `python -m launcher.prepare` before it."""
    encode = job_encoder(data, processor, records)
    return ensure_cache(
        cache / "data_cache",
        records,
        processor,
        model,
        encode,
        ConversationDataset(records, encode.video).__getitem__,
        on_bad_record=str(data.on_bad_record),
        num_workers=int(data.num_workers),
        part=part,
        check=str(data.cache_check),
    )


def job_encoder(data: DataConfig, processor: Any, records: Sequence[dict]) -> RecordEncoder:
    """How a job with this `data` config encodes a split of `records` into its cache: its length limit, how
    it keeps images (data.cache_images, auto decided from the split), which frames of a video train."""
    sample = [records[index] for index in range(min(len(records), 1000))]
    images = image_storage(str(data.cache_images), processor, sample, len(records), videos=holds_videos(records))
    return RecordEncoder(processor, LengthLimit.of(data), images, VideoSampling.of(data.video))


def job_cache_path(data: DataConfig, cache: Path, model: str, processor: Any, records: Sequence[dict]) -> Path:
    """Where `ensure_job_cache` keeps (or will build) the cache of this split: read, never built, here."""
    encode = job_encoder(data, processor, records)
    return cache / "data_cache" / cache_key(records, processor, model, encode.limit, encode.images, encode.video)


def _unless_finished_elsewhere(path: Path, work: Callable[[], Any]) -> None:
    """Run a build step; another job building the same cache at once (a parallel sweep) may finish it first
    and move the build directory away: then its cache is the one to use.

    The other job, finishing, removes the temporary shards it finds (a killed build's) before it renames
    the build into place: a shard this job is writing can vanish (FileNotFoundError) a moment before the
    cache is complete. Then this job waits for that cache, up to FINISH_WAIT_S."""
    try:
        work()
    except (OSError, TrainingFailed) as error:
        cause = error if isinstance(error, OSError) else error.__cause__
        vanished = isinstance(cause, FileNotFoundError)
        deadline = time.monotonic() + (FINISH_WAIT_S if vanished else 0.0)
        while _read_meta(path) is None:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


class _ShardBuild:
    """The shards of one cache being built under `building`, and their meta.json once all exist."""

    def __init__(
        self,
        building: Path,
        records: Sequence[dict],
        encode: RecordEncoder,
        load: Callable[[int], dict],
        on_bad_record: str,
        num_workers: int,
        shard_records: int,
    ) -> None:
        self.building, self.records, self.encode, self.load = building, records, encode, load
        self.on_bad_record, self.num_workers, self.shard_records = on_bad_record, num_workers, shard_records
        self.shards = max(1, -(-len(records) // shard_records))
        self.stopped = False  # a stop request ended `run` before its last shard

    def shard_dir(self, number: int) -> Path:
        return self.building / SHARDS_DIR / f"{number:05d}"

    def span(self, number: int) -> range:
        return range(number * self.shard_records, min(len(self.records), (number + 1) * self.shard_records))

    def run(self, numbers: range | list[int], *, progress: bool, stop: Callable[[], bool] = lambda: False) -> None:
        """Write the shards `numbers` that no earlier attempt completed; before each, `stop()` may end the build
        (`stopped`: the shards written so far are complete and kept)."""
        todo = [n for n in numbers if _read_json(self.shard_dir(n) / SHARD_FILE) is None]
        total, done, started, said = sum(len(self.span(n)) for n in todo), 0, time.perf_counter(), time.perf_counter()
        for number in todo:
            if stop():
                self.stopped = True
                return
            self._write_shard(number)
            done += len(self.span(number))
            now = time.perf_counter()
            if progress and now - said > PROGRESS_EVERY_S and done < total:
                rate = done / (now - started)
                log.info(
                    "data cache: %d of this rank's %d records, %.0f records/s, about %.0f s left",
                    done,
                    total,
                    rate,
                    (total - done) / rate,
                )
                said = now

    def _write_shard(self, number: int) -> None:
        """One shard, written to a temporary directory and renamed into place."""
        (self.building / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{number:05d}.", dir=self.building / SHARDS_DIR))
        try:
            try:
                written = _write_tensors(
                    tmp, self.records, self.span(number), self.encode, self.load,
                    on_bad_record=self.on_bad_record, workers=self.num_workers,
                )  # fmt: skip
            except OSError as error:  # a full disk, a file size limit
                facts = "; ".join(f for f in (error.strerror or str(error), free_space(self.building.parent)) if f)
                raise TrainingFailed(
                    f"cannot write the data cache under {self.building.parent} ({facts}): free disk space, set "
                    "cache_dir to a disk with room, or data.cache=false"
                ) from error
            written.files = {file.name: fingerprint(file, CHECKSUM) for file in sorted(tmp.iterdir())}
            (tmp / SHARD_FILE).write_text(json.dumps(written.to_json()) + "\n")  # last: marks it complete
            try:
                os.rename(tmp, self.shard_dir(number))
            except OSError:  # another process (a job building the same cache) finished it first
                if _read_json(self.shard_dir(number) / SHARD_FILE) is None:
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def finish(self, path: Path, key: str, model: str, started: float) -> dict:
        """Build any shard still missing, write meta.json and rename the build into place."""
        self.run(range(self.shards), progress=False)
        shards = [_Written.from_json(_read_json(self.shard_dir(n) / SHARD_FILE) or {}) for n in range(self.shards)]
        meta = _meta(key, model, self.records, shards, self.encode, round(time.perf_counter() - started, 3))
        for leftover in (self.building / SHARDS_DIR).glob(".*"):  # temporary shards of killed builds
            shutil.rmtree(leftover, ignore_errors=True)
        _write_records(self.building, shards)
        files = {f"{SHARDS_DIR}/{n:05d}/{name}": held for n, s in enumerate(shards) for name, held in s.files.items()}
        files.update({name: fingerprint(self.building / name, CHECKSUM) for name in (RECORDS_FILE, IDS_FILE)})
        meta["files"] = files
        (self.building / META_FILE).write_text(json.dumps(meta) + "\n")  # last: its presence marks a complete cache
        self.building.chmod(0o755)
        try:
            os.rename(self.building, path)
        except OSError:  # another process finished the same cache first
            if _read_meta(path) is None:
                raise
            shutil.rmtree(self.building, ignore_errors=True)
        return meta


def _meta(
    key: str, model: str, records: Sequence[dict], shards: list[_Written], encode: RecordEncoder, seconds: float
) -> dict:
    """meta.json of a cache built: how many records it holds, which it skipped or cut, and why, each tensor's
    layout; or the one line saying that no record is left. Which records it holds: `_write_records`."""
    kept = [index for shard in shards for index in shard.kept]
    skipped, too_long = sum(s.skipped for s in shards), sum(s.too_long for s in shards)
    if not kept and not too_long:
        raise LauncherError(
            f"data: none of the {skipped} records could be decoded (all skipped under "
            f"data.on_bad_record=skip): fix the images, e.g. those of {records[0]['where']}"
        )
    if not kept:
        example = next(s.too_long_example for s in shards if s.too_long_example)
        raise nothing_fits(len(records), encode.limit, too_long, skipped, example)
    layout: dict[str, list] = {}
    for shard in shards:
        for name, (dtype, shape) in shard.layout.items():
            if layout.setdefault(name, [dtype, shape]) != [dtype, shape]:
                raise LauncherError(
                    f"data: {name} is {dtype} of trailing shape {shape} in some records and {layout[name]} in others: "
                    "set data.cache=false for this processor"
                )
    return {
        "version": CACHE_VERSION,
        "key": key,
        "model": model,
        "images": encode.images,
        "video": asdict(encode.video),
        "records": len(kept),
        "skipped": skipped,
        "truncated": sum(s.cut for s in shards),
        "too_long": too_long,
        "skip_log": [entry for shard in shards for entry in shard.skip_log],
        "shards": [len(shard.kept) for shard in shards],
        "layout": layout,
        "build_seconds": seconds,
    }


def _write_records(out: Path, shards: list[_Written]) -> None:
    """Which records the cache holds, in order: their positions in the records given (which survived a
    skip) and sources (records.npz), and their ids (ids.arrow). Arrays, read as arrays or memory-mapped,
    not JSON lists that every rank would make Python objects of."""
    np.savez(
        out / RECORDS_FILE,
        indices=np.asarray([i for shard in shards for i in shard.kept], dtype=np.int64),
        sources=np.asarray([s for shard in shards for s in shard.sources], dtype=np.int64),
    )
    ids = pa.array([i for shard in shards for i in shard.ids], type=pa.string())
    with (
        pa.OSFile(str(out / IDS_FILE), "wb") as sink,
        pa.ipc.new_file(sink, pa.schema([("id", pa.string())])) as writer,
    ):
        writer.write_batch(pa.RecordBatch.from_arrays([ids], names=["id"]))


def built_cache(path: Path) -> CacheInfo | None:
    """The complete cache at `path` (its `built` field: True), or None."""
    meta = _read_meta(path)
    return None if meta is None else _info(path, meta, built=True)


def _info(path: Path, meta: dict, *, built: bool) -> CacheInfo:
    size = sum(file.stat().st_size for file in path.rglob("*") if file.is_file())
    return CacheInfo(
        path,
        built,
        meta["build_seconds"],
        meta["records"],
        meta["skipped"],
        meta["truncated"],
        meta["too_long"],
        meta["skip_log"],
        size,
    )


class _Decoded(Dataset):
    """Record i of a span -> (i, its tensors, whether they were cut, its id, its source), the tensors
    being the BadRecordError where it has none; decoding and encoding run in the workers."""

    def __init__(self, records: Sequence[dict], span: range, load: Callable[[int], dict], encode: RecordEncoder):
        self.records, self.span, self.load, self.encode = records, span, load, encode

    def __len__(self) -> int:
        return len(self.span)

    def __getitem__(self, position: int) -> tuple[int, Any, bool, str, int]:
        index = self.span[position]
        record = self.records[index]
        try:
            tensors, cut = self.encode(self.load(index), record["images"])
            return index, {k: v.numpy() for k, v in tensors.items()}, cut, record["id"], record.get("source", 0)
        except BadRecordError as error:  # RecordTooLong among them
            return index, error, False, record["id"], record.get("source", 0)


@dataclass
class _Written:
    """What one shard holds (shard.json)."""

    kept: list[int] = field(default_factory=list)  # positions of the records written
    ids: list[str] = field(default_factory=list)  # and their ids
    sources: list[int] = field(default_factory=list)  # and their sources (of a mixture)
    skipped: int = 0  # bad records skipped (data.on_bad_record=skip)
    cut: int = 0  # records written cut to data.max_length
    too_long: int = 0  # records over data.max_length not written
    skip_log: list[dict] = field(default_factory=list)  # each record not written, and why
    too_long_example: str = ""  # the first record over data.max_length, and why
    layout: dict[str, list] = field(default_factory=dict)  # tensor name -> [dtype, trailing shape]
    files: dict[str, dict] = field(default_factory=dict)  # file name -> its manifest.fingerprint (xxh3_128)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> _Written:
        return cls(**data)


def _write_tensors(
    out: Path,
    records: Sequence[dict],
    span: range,
    encode: RecordEncoder,
    load: Callable[[int], dict],
    *,
    on_bad_record: str,
    workers: int,
) -> _Written:
    decoded = _Decoded(records, span, load, encode)
    # A generator of its own: an iterator draws its workers' seed from the global one otherwise, and a run
    # that built the cache would continue with another random state than one that found it built.
    loader = DataLoader(
        decoded, batch_size=None, num_workers=workers, prefetch_factor=8 if workers else None, collate_fn=unchanged,
        generator=torch.Generator(), worker_init_fn=helper_process,
    )  # fmt: skip
    files: dict[str, Any] = {}
    offsets: dict[str, list[int]] = {}
    written = _Written()
    try:
        for index, tensors, cut, record_id, source in loader:
            pause_for_test("cache")  # the tests' stop signals land here, the workers decoding (a no-op otherwise)
            if isinstance(tensors, BadRecordError):
                _skip(written, records[index], index, tensors, on_bad_record)
                continue
            written.cut += cut
            for name, array in tensors.items():
                if name not in files:  # a tensor first seen here (pixel_values after text-only records)
                    files[name] = open(out / f"{name}.bin", "wb")  # noqa: SIM115 (closed in finally)
                    offsets[name] = [0] * (len(written.kept) + 1)
                    written.layout[name] = [array.dtype.str, list(array.shape[1:])]
                if [array.dtype.str, list(array.shape[1:])] != written.layout[name]:
                    raise LauncherError(
                        f"{records[index]['where']}: {name} has shape {array.shape} ({array.dtype}), unlike the "
                        f"records before it ({written.layout[name]}): set data.cache=false for this processor"
                    )
                files[name].write(_narrowed(array, name, records[index]["where"]).tobytes())
            for name in files:  # a record without a tensor (no images) holds zero rows of it
                offsets[name].append(offsets[name][-1] + (tensors[name].shape[0] if name in tensors else 0))
            written.kept.append(index)
            written.ids.append(record_id)
            written.sources.append(source)
    finally:
        for handle in files.values():
            handle.close()
    np.savez(out / INDEX_FILE, **{f"{name}.offsets": np.asarray(offsets[name], dtype=np.int64) for name in files})
    return written


def _narrowed(array: np.ndarray, name: str, where: str) -> np.ndarray:
    """The array as stored: NARROWED types in fewer bytes, checked to fit."""
    stored = NARROWED.get(array.dtype.str)
    if stored is None:
        return np.ascontiguousarray(array)
    limits = np.iinfo(stored)
    if array.size and (array.min() < limits.min or array.max() > limits.max):
        raise LauncherError(
            f"{where}: {name} holds values beyond {stored} ({array.min()}..{array.max()}): set data.cache=false"
        )
    return np.ascontiguousarray(array, dtype=stored)


def _skip(written: _Written, record: dict, index: int, error: BadRecordError, on_bad_record: str) -> None:
    """A record not written: too long (always skipped), or bad (skipped under on_bad_record=skip)."""
    if isinstance(error, RecordTooLong):
        written.too_long += 1
        reason = f"{record['where']}: {error}"
        written.too_long_example = written.too_long_example or reason
    elif on_bad_record != "skip":
        raise error
    else:
        written.skipped += 1
        reason = str(error)
    written.skip_log.append(skipped_entry(record.get("file", ""), record.get("index", index), reason))


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_meta(path: Path) -> dict | None:
    meta = _read_json(path / META_FILE)
    return meta if meta is not None and meta.get("version") == CACHE_VERSION else None


# ----------------------------------------------------------------------------- reading
class CachedDataset(Dataset):
    """A built cache -> {"tensors": {name: tensor}, "id", "source"} per record; reads are slices of memory
    maps. An encoded cache's images are decoded here (in the DataLoader's workers) and made into pixel values
    by `processor`'s image processor, as the processor makes them."""

    def __init__(self, path: Path, processor: Any = None):
        self.path = Path(path)
        meta = _read_meta(self.path)
        if meta is None:
            raise LauncherError(f"{self.path}: not a complete data cache; delete it to have it built again")
        with np.load(self.path / RECORDS_FILE) as arrays:
            self.indices, self.sources = arrays["indices"], arrays["sources"]
        self._length = int(meta["records"])
        self._ids: pa.Array | None = None  # memory-mapped when first read, in each worker
        self.encoded = IMAGE_BYTES in meta["layout"]
        if self.encoded and processor is None:
            raise LauncherError(f"{self.path}: its images are encoded; reading it needs the processor")
        self.processor = processor if self.encoded else None
        self.video = VideoSampling(**meta.get("video", {}))  # how the build sampled its videos' frames
        self._layout = {name: (dtype, tuple(shape)) for name, (dtype, shape) in meta["layout"].items()}
        self.names = sorted(self._layout)
        # Record i is in shard k when starts[k] <= i < starts[k + 1].
        self.starts = np.concatenate([[0], np.cumsum(meta["shards"])]).astype(np.int64)
        self.offsets: list[dict[str, np.ndarray]] = []
        for number, count in enumerate(meta["shards"]):
            index = np.load(self._shard(number) / INDEX_FILE)
            held = {key.rsplit(".", 1)[0] for key in index.files}
            # A shard whose records lack a tensor (text only) holds zero rows of it for each.
            self.offsets.append(
                {
                    name: index[f"{name}.offsets"] if name in held else np.zeros(count + 1, np.int64)
                    for name in self.names
                }
            )
        self._maps: list[dict[str, np.ndarray]] | None = None  # opened lazily, in each worker

    def _shard(self, number: int) -> Path:
        return self.path / SHARDS_DIR / f"{number:05d}"

    def __len__(self) -> int:
        return self._length

    def record_id(self, index: int) -> str:
        if self._ids is None:
            with pa.memory_map(str(self.path / IDS_FILE)) as source:
                self._ids = pa.ipc.open_file(source).read_all().column("id")
        return self._ids[index].as_py()

    def lengths(self) -> np.ndarray:
        """Tokens per record (image tokens included), an int64 array: what length-grouped batches sort by."""
        return self._per_record("input_ids")

    def vision_inputs(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Per record, from the offsets and grids alone (int64 arrays): what its vision tower takes, in images (a
        video counted as the images its frames make: tiled data.video.grid^2 to an image for LLaVA, a temporal
        patch each for the Qwen2-VL family), and, where each image's and video's (t, h, w) grid is kept (the
        Qwen2-VL family), its vision-tower patches, else None. What the memory planner plans a job's records by
        (launcher.plan.data.record_shapes)."""
        grids = [kind.grid for kind in (IMAGES, VIDEOS) if kind.grid in self._layout]
        if grids:
            temporal = [self._per_record(grid, lambda rows: rows[:, 0]) for grid in grids]  # an image's t is 1
            patches = [self._per_record(grid, lambda rows: np.prod(rows, axis=-1)) for grid in grids]
            return sum(temporal), sum(patches)
        if IMAGE_LENGTHS in self._layout:  # encoded files: an image's, or a video's (its frame count above 0)
            counts = self._per_record(IMAGE_LENGTHS)
            if VIDEO_FRAMES in self._layout:  # a video's frames, tiled grid x grid into images, past its one entry
                tiles = self.video.grid**2
                counts = counts + self._per_record(VIDEO_FRAMES, lambda frames: np.maximum(0, -(-frames // tiles) - 1))
            return counts, None
        if IMAGES.pixels in self._layout:  # a row of pixel values per image (LLaVA; a video is kept encoded)
            return self._per_record(IMAGES.pixels), None
        return np.zeros(len(self), np.int64), None

    def _per_record(self, name: str, value: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
        """Per record: its rows of tensor `name`, or (`value`: rows -> a number per row) their values summed."""
        if value is None:
            return np.concatenate([np.diff(offsets[name]) for offsets in self.offsets])
        each = []
        for maps, offsets in zip(self._open(), self.offsets, strict=True):
            summed = np.concatenate([[0], np.cumsum(value(np.asarray(maps[name], dtype=np.int64)))])
            each.append(summed[offsets[name][1:]] - summed[offsets[name][:-1]])
        return np.concatenate(each).astype(np.int64)

    def _open(self) -> list[dict[str, np.ndarray]]:
        if self._maps is None:
            self._maps = []
            for number, offsets in enumerate(self.offsets):
                maps = {}
                for name, (dtype, shape) in self._layout.items():
                    file = self._shard(number) / f"{name}.bin"
                    empty = offsets[name][-1] == 0  # np.memmap refuses an empty file
                    stored = NARROWED.get(dtype, dtype)
                    maps[name] = (
                        np.empty((0, *shape), dtype=stored)
                        if empty
                        else np.memmap(file, dtype=stored, mode="r").reshape(-1, *shape)
                    )
                self._maps.append(maps)
        return self._maps

    def __getitem__(self, index: int) -> dict:
        shard = int(np.searchsorted(self.starts, index, side="right")) - 1
        local, maps, offsets = index - int(self.starts[shard]), self._open()[shard], self.offsets[shard]
        tensors = {
            name: torch.from_numpy(
                np.array(maps[name][offsets[name][local] : offsets[name][local + 1]], dtype=self._layout[name][0])
            )
            for name in self.names
        }
        record_id = self.record_id(index)
        if self.encoded:
            tensors = self._decoded(tensors, record_id)
        return {"tensors": tensors, "id": record_id, "source": int(self.sources[index])}

    def _decoded(self, tensors: dict[str, torch.Tensor], record_id: str) -> dict[str, torch.Tensor]:
        """The record's tensors with its stored image bytes made into the processor's pixel values."""
        blob, lengths = tensors.pop(IMAGE_BYTES).numpy().tobytes(), tensors.pop(IMAGE_LENGTHS).tolist()
        frames = tensors.pop(VIDEO_FRAMES).tolist() if VIDEO_FRAMES in tensors else []
        if not lengths:
            return tensors
        frames = frames or [0] * len(lengths)  # a record of images alone stores no frame counts
        as_videos = len(tensors.get("video_grid_thw", ())) > 0  # a model that takes videos as videos
        ends = np.cumsum(lengths).tolist()
        images, videos, fps = [], [], []
        for end, length, kept in zip(ends, lengths, frames, strict=True):
            stored = blob[end - length : end]
            if kept and as_videos:
                clip = decode_clip(stored, self.video)
                videos.append(clip.frames[:kept])
                fps.append(clip.fps)
            elif kept:  # frames placed as images, tiled as the collator tiles them
                images += tile_frames(decode_frames(stored, self.video)[:kept], self.video.grid)
            else:
                images.append(open_image(stored, record_id))
        if images:
            tensors["pixel_values"] = self.processor.image_processor(images, return_tensors="pt")["pixel_values"]
        if videos:
            tensors.update(video_pixels(self.processor, videos, fps))
        return tensors

    def __getstate__(self) -> dict:  # workers open their own maps
        return {**self.__dict__, "_maps": None, "_ids": None}


class CachedCollator:
    """Cached records -> the batch `Collator` makes from the same records (right-padded, labels)."""

    def __init__(self, processor: Any, *, image_every_batch: bool = False, video_every_batch: bool = False):
        self.processor = processor
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.image_every_batch = image_every_batch
        self.video_every_batch = video_every_batch

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = pad_rows([sample["tensors"] for sample in samples], self.pad_token_id)
        return add_dummy_media(
            self.processor, batch, "right", image=self.image_every_batch, video=self.video_every_batch
        )
