"""A split's records as a DataLoader takes them, whichever kind of source they come from.

Three kinds, each behind one call:

- **decoded** (`decoded_split`): an index's records, each decoded and encoded per batch in the loader's
  workers by `Collator`; those that cannot fit data.max_length are found first (`fit_records`), so that
  every rank drops the same ones.
- **cached** (`cached_split`): the same records tokenized once into the data cache (launcher.data.cache,
  which the ranks build together); the loader reads tensors and decodes the images and videos kept with them.
- **streamed** (`streamed_batches_of`): rows read from shard files as training goes (launcher.data.stream),
  encoded in the workers as the cache encodes them; what they skip is met, and counted, while training.

The first two give a `Split`: a map-style dataset, its collate function, which records train, and what
was skipped. A stream gives batches. The loaders (launcher.train.loaders) choose the kind from data.cache
and data.streaming and never branch on it again. ZeRO-3's `ModalityGuard` is here too: every kind's
collator adds what it says to a batch that lacks it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from launcher.config.schema import DataConfig
from launcher.data.cache import CachedCollator, CachedDataset, CacheInfo, RecordEncoder
from launcher.data.collate import Collator, fit_records
from launcher.data.formats import SkipTally, skipped_entry
from launcher.data.index import Records, holds_videos
from launcher.data.length import LengthLimit, unchanged
from launcher.data.records import ConversationDataset, Source
from launcher.data.stream import RecordStream, StreamOrder, stream_files, stream_options, streamed_batches
from launcher.data.video import VideoSampling, takes_videos

log = logging.getLogger("launcher")


@dataclass(frozen=True)
class ModalityGuard:
    """What the ZeRO-3 modality guard gives a batch that lacks it, so that every rank's forward calls the
    vision tower as often: a blank image (`images`), a blank video (`videos`: a model that takes videos as
    videos calls its tower once for a batch's images and once more for its videos)."""

    images: bool
    videos: bool = False

    @classmethod
    def of(cls, images: bool, processor: Any, splits: Iterable[Records], *, streaming: bool) -> ModalityGuard:
        """The guard for this data: a blank video only where the model takes videos as videos and the data
        may hold one (a stream's rows are not known before training: it may)."""
        videos = takes_videos(processor) and (streaming or any(holds_videos(split) for split in splits if split))
        return cls(images, videos=images and videos)

    def args(self) -> dict[str, bool]:
        """The collators' arguments."""
        return {"image_every_batch": self.images, "video_every_batch": self.videos}


@dataclass
class Split:
    """One split's records ready for a DataLoader."""

    dataset: Any  # map-style, over the records that train
    collate: Callable[[list[dict]], dict[str, Any]]
    kept: Sequence[int]  # the positions, in the split's records, of those that train
    skips: SkipTally  # left out (bad, over data.max_length) and cut; its lines name the split
    cache: CacheInfo | None = None  # the data cache it reads, for a cached split


def cached_split(info: CacheInfo, processor: Any, guard: ModalityGuard, split: str) -> Split:
    """A split read from its data cache (built by launcher.data.cache.ensure_job_cache)."""
    dataset = CachedDataset(info.path, processor)
    skips = SkipTally(bad=info.skipped, too_long=info.too_long, truncated=info.truncated)
    skips.entries = [{"split": split, **entry} for entry in info.skip_log]
    return Split(dataset, CachedCollator(processor, **guard.args()), dataset.indices, skips, info)


def decoded_split(data: DataConfig, processor: Any, records: Records, guard: ModalityGuard, split: str) -> Split:
    """A split decoded and encoded per batch: the records that do not fit data.max_length are found first,
    so that every rank cuts and skips the same records the data cache would."""
    limit, video = LengthLimit.of(data), VideoSampling.of(data.video)
    report = fit_records(records, processor, limit, num_workers=int(data.num_workers), video=video)
    skips = SkipTally(too_long=len(report.skipped), truncated=report.cut)
    for index, reason in report.skipped:
        record = records[index]
        entry = skipped_entry(record.get("file", ""), record.get("index", index), reason)
        skips.entries.append({"split": split, **entry})
    kept = Subset(records, report.kept) if len(report.kept) < len(records) else records
    collate = Collator(processor, limit=limit, **guard.args())
    return Split(ConversationDataset(kept, video), collate, report.kept, skips)


def streamed_batches_of(
    data: DataConfig,
    source: Source,
    processor: Any,
    guard: ModalityGuard,
    *,
    place: tuple[int, int, int],
    micro: int,
    position: Any,
    skips: SkipTally,
    loader_args: dict[str, Any],
) -> Iterator[dict[str, Any]]:
    """Training batches of `micro` rows read from `source`'s shard files as training goes, from `position`
    on (epoch, records of the epoch consumed: read when the first batch is asked for, after a resume has
    set it). `place` is (seed, rank, world size): each rank reads its own rows. What is skipped or cut is
    counted in `skips` as it is met."""
    seed, rank, world_size = place
    files = tuple(stream_files(source.path))
    order = StreamOrder(files, seed, rank, world_size, int(data.shuffle_block))
    encode = RecordEncoder(processor, LengthLimit.of(data), "pixels")

    def rows() -> Iterator[Any]:
        options = stream_options(source.options)
        stream = RecordStream(order, options, encode, epoch=position.epoch, start=position.records)
        args = {**loader_args, "pin_memory": False}  # rows, not batches: nothing to pin
        yield from DataLoader(
            stream, batch_size=None, collate_fn=unchanged, generator=torch.Generator().manual_seed(seed), **args
        )

    if rank == 0:
        how = "its own files" if order.by_file else "every file, every world-th row"
        log.info("data: streaming %d file(s) from %s (each rank reads %s)", len(files), source.path, how)
    collate = CachedCollator(processor, **guard.args())
    return streamed_batches(rows(), position, micro, collate, str(data.on_bad_record), skips)
