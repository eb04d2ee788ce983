"""Streaming: training records read from their shard files as training goes (`data.streaming=true`).

For sets that do not fit on local disk, sit in object storage, or would take hours to index: nothing is
read before the first step. `data.path` names the shards: one file, a folder (every .json, .jsonl,
.parquet and .arrow file under it), a glob (`data/train-*.parquet`), or the same with an fsspec URL
(`s3://bucket/set/*.parquet`, which needs that file system's fsspec package, e.g. s3fs). Records are
in any format launcher/data/formats.py reads; images are paths under data.image_root (local shards:
default the shard's folder) or embedded bytes (what remote shards must hold).

The order is a pure function of (shards, train.seed, epoch, rank, world size), so a stream resumes
exactly:
- each epoch the shard files are permuted (seed, epoch); with at least as many files as ranks each rank
  reads its own files (rank r: files r, r + world, ...), otherwise every rank reads every file and
  keeps every world-th row (more reading, the same records);
- a rank's rows are taken in blocks of `data.shuffle_block` consecutive rows, each block permuted
  (seed, epoch, rank, block): a shuffle whose state is its position, so no shuffle buffer is saved;
- the position saved in a checkpoint is (epoch, rows of this rank's stream consumed); a resume skips
  whole files and parquet row groups by their metadata, counts JSON lines without parsing them, and
  re-reads only the block it stopped in.

Each raw row is made a record, its images decoded and the whole encoded into the tensors the data cache
would hold (launcher.data.cache.RecordEncoder), in the DataLoader's workers: worker w of W encodes the
rows w, w + W, ... of the rank's stream, and the loader hands them back in stream order. Each worker reads
the rank's rows to find its own (the files are read W times, from the page cache when local; embedded
image bytes with them), and decodes and encodes only its own. The training
process drops the rows that cannot train (bad, under data.on_bad_record=skip, or over data.max_length)
and pads every `micro` kept rows into a batch (CachedCollator): the batches the data cache would give
for the same records in the same order, bit for bit.
"""

from __future__ import annotations

import glob
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from torch.utils.data import IterableDataset, get_worker_info

from launcher.core.errors import LauncherError
from launcher.data.formats import (
    DATASET_SUFFIXES,
    BadRecordError,
    ReadOptions,
    SkipTally,
    detect_format,
    normalize,
    skipped_entry,
)
from launcher.data.length import RecordTooLong
from launcher.data.records import decode_record

STREAM_SUFFIXES = (".json", ".jsonl", *DATASET_SUFFIXES)
VOCABULARY_RECORDS = 10_000  # a tiny model's vocabulary comes from this many records of a stream


# ----------------------------------------------------------------------------- the shard files
def stream_files(path: str) -> list[str]:
    """The shard files `data.path` names (a file, a folder, a glob; local or an fsspec URL), sorted."""
    if _remote(path):
        return _remote_files(path)
    local = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    if os.path.isdir(local):
        found = [str(p) for p in sorted(Path(local).rglob("*")) if p.suffix in STREAM_SUFFIXES and p.is_file()]
    elif glob.has_magic(local):
        found = [p for p in sorted(glob.glob(local, recursive=True)) if os.path.isfile(p)]
    else:
        found = [local] if os.path.isfile(local) else []
    if not found:
        raise LauncherError(
            f"data.path={path}: no data files there (data.streaming reads {', '.join(STREAM_SUFFIXES)} files: "
            "give a file, a folder of them, or a glob such as data/train-*.jsonl)"
        )
    return found


def _remote_files(path: str) -> list[str]:
    try:
        fs, root = fsspec.core.url_to_fs(path)
        listed = fs.glob(root) if glob.has_magic(root) else (fs.find(root) if fs.isdir(root) else [root])
    except (ImportError, ValueError) as error:  # no fsspec file system for the scheme
        raise LauncherError(f"data.path={path}: cannot open it ({error}): install that file system's package") from None
    except OSError as error:
        raise LauncherError(f"data.path={path}: cannot list it ({error})") from None
    found = sorted(fs.unstrip_protocol(p) for p in listed if Path(p).suffix in STREAM_SUFFIXES)
    if not found:
        raise LauncherError(f"data.path={path}: no {', '.join(STREAM_SUFFIXES)} files there")
    return found


def _remote(file: str) -> bool:
    return "://" in file and not file.startswith("file://")


def _open(file: str) -> Any:
    if _remote(file):
        return fsspec.open(file, "rb").open()
    return open(file.removeprefix("file://"), "rb")


def file_rows(file: str, start: int = 0) -> Iterator[Any]:
    """The rows of one shard from row `start` on: a parsed JSON record, the text of a JSON line (parsed
    by whoever keeps it) or a parquet/arrow row as a dict. Rows before `start` are skipped without being
    parsed where the format allows (JSON lines, parquet row groups, arrow record batches)."""
    suffix = Path(file).suffix
    with _open(file) as handle:
        if suffix == ".parquet":
            parquet = pq.ParquetFile(handle)
            for group in range(parquet.num_row_groups):
                rows = parquet.metadata.row_group(group).num_rows
                if start >= rows:
                    start -= rows
                    continue
                yield from parquet.read_row_group(group).slice(start).to_pylist()
                start = 0
        elif suffix == ".arrow":
            # Mapped (a local file) or read through the handle as batches are asked for, never whole.
            source = pa.PythonFile(handle, mode="r") if _remote(file) else pa.memory_map(file.removeprefix("file://"))
            yield from _arrow_rows(source, start)
        else:
            yield from _json_rows(handle, start)


def _arrow_rows(source: Any, start: int) -> Iterator[dict]:
    try:
        reader: Any = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:  # `datasets` writes Arrow streams
        source.seek(0)
        batches = iter(pa.ipc.open_stream(source))
    for batch in batches:
        if start >= batch.num_rows:
            start -= batch.num_rows
            continue
        yield from batch.slice(start).to_pylist()
        start = 0


def _json_rows(handle: Any, start: int) -> Iterator[Any]:
    text = io.TextIOWrapper(handle, encoding="utf-8")
    try:
        head = text.read(4096)
        if head.lstrip().startswith("["):  # a JSON list: parsed whole
            yield from json.loads(head + text.read())[start:]
            return
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise LauncherError(f"{getattr(handle, 'name', 'a data file')}: not a JSON list of records ({error})") from None
    lines = io.StringIO(head).readlines()
    if lines and not lines[-1].endswith("\n"):  # the rest of a line cut at 4096 characters
        lines[-1] += text.readline()
    row = 0
    for line in _chain(lines, text):
        if not line.strip():
            continue
        if row >= start:
            yield line  # parsed in the worker that keeps it
        row += 1


def _chain(first: list[str], rest: Any) -> Iterator[str]:
    yield from first
    yield from rest


def file_length(file: str) -> int:
    """Rows of one shard: parquet and arrow from their metadata, JSON lines counted unparsed."""
    if Path(file).suffix == ".parquet":
        with _open(file) as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    return sum(1 for _ in file_rows(file))


def stream_head(path: str, options: ReadOptions, count: int) -> list[dict]:
    """The first `count` records that read (in the files' sorted order): what a tiny model's vocabulary
    is built from when the set is streamed, rather than read whole first."""
    records: list[dict] = []
    options = stream_options(options)
    for file in stream_files(path):
        stream = RecordStream(StreamOrder((file,), seed=0), options, encode=None)
        for row, raw in enumerate(file_rows(file)):
            if len(records) >= count:
                return records
            try:
                records.append(stream.record(file, row, raw))
            except BadRecordError:
                continue
    return records


# ----------------------------------------------------------------------------- the order
@dataclass(frozen=True)
class StreamOrder:
    """Which rows a rank reads in which order, epoch by epoch (see the module docstring)."""

    files: tuple[str, ...]
    seed: int
    rank: int = 0
    world_size: int = 1
    block: int = 1000  # data.shuffle_block: rows permuted together; 1 keeps the files' order
    _lengths: dict[str, int] = field(default_factory=dict, compare=False, repr=False)

    @property
    def by_file(self) -> bool:
        """Whether each rank reads files of its own (else every rank reads all, keeping every world-th row)."""
        return len(self.files) >= self.world_size

    def epoch_files(self, epoch: int) -> list[str]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.files))
        files = [self.files[i] for i in order]
        return files[self.rank :: self.world_size] if self.by_file else files

    def rows(self, epoch: int, start: int = 0) -> Iterator[tuple[int, str, int, Any]]:
        """(position in this rank's epoch, file, row in the file, raw row) from position `start` on."""
        first_block = start // self.block
        raw = self._rank_rows(epoch, first_block * self.block)
        number = first_block
        while True:
            block = [row for _, row in zip(range(self.block), raw, strict=False)]
            if not block:
                return
            permuted = np.random.default_rng([self.seed, epoch, self.rank, number]).permutation(len(block))
            for offset, index in enumerate(permuted):
                position = number * self.block + offset
                if position >= start:
                    yield (position, *block[index])
            number += 1

    def _rank_rows(self, epoch: int, skip: int) -> Iterator[tuple[str, int, Any]]:
        """(file, row in file, raw row) of this rank's rows of the epoch in file order, after `skip` of them.

        Reading every file, a rank keeps the rows whose number g over the epoch's files has g % world ==
        rank: its row i is row g = i x world + rank."""
        step, phase = (1, 0) if self.by_file else (self.world_size, self.rank)
        target = skip * step + phase  # the first row to keep, counted over the epoch's files
        base = 0  # the number of this file's first row
        for file in self.epoch_files(epoch):
            if target > base and target >= base + self._length(file):
                base += self._length(file)  # skipped whole, unread
                continue
            first = max(target - base, 0)
            first += (phase - (base + first)) % step
            number = first
            for row in file_rows(file, first):
                if (base + number) % step == phase:
                    yield file, number, row
                number += 1
            base += number if number > first or first == 0 else self._length(file)

    def _length(self, file: str) -> int:
        if file not in self._lengths:
            self._lengths[file] = file_length(file)
        return self._lengths[file]


# ----------------------------------------------------------------------------- rows into tensors
@dataclass
class Streamed:
    """One row of a rank's stream, as a worker hands it back: its tensors, or why it cannot train."""

    epoch: int
    position: int  # in this rank's epoch
    file: str
    row: int  # in the file
    record_id: str
    tensors: dict[str, Any] | BadRecordError  # RecordTooLong among the errors
    cut: bool = False  # cut to data.max_length


class RecordStream(IterableDataset):
    """A rank's rows, epoch after epoch, from (`epoch`, `start`) on, each encoded by `encode` (a
    RecordEncoder keeping pixel values); worker w of W encodes rows w, w + W, ... (see the module
    docstring)."""

    def __init__(self, order: StreamOrder, options: ReadOptions, encode: Any, *, epoch: int = 0, start: int = 0):
        self.order, self.options, self.encode = order, options, encode
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[Streamed]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        count, epoch, start = 0, self.epoch, self.start
        while True:
            read = False
            for position, file, row, raw in self.order.rows(epoch, start):
                read = True
                if count % workers == worker:
                    yield self._encoded(epoch, position, file, row, raw)
                count += 1
            if not read and start == 0:
                raise LauncherError(
                    f"data.path: rank {self.order.rank}'s files hold no rows in epoch {epoch} "
                    f"({len(self.order.epoch_files(epoch))} file(s)): remove the empty files"
                )
            epoch, start = epoch + 1, 0

    def _encoded(self, epoch: int, position: int, file: str, row: int, raw: Any) -> Streamed:
        where = record_id = f"{file} record {row}"
        try:
            record = self.record(file, row, raw)
            record_id = record["id"]
            sample = decode_record({**record, "where": where}, self.options.video)  # videos: their frames as images
            tensors, cut = self.encode(sample)
            return Streamed(epoch, position, file, row, record_id, tensors, cut)
        except BadRecordError as error:
            return Streamed(epoch, position, file, row, record_id, error)

    def record(self, file: str, row: int, raw: Any) -> dict:
        """A raw row in the common record form (launcher.data.formats); BadRecordError if it cannot train."""
        where = f"{file} record {row}"
        if isinstance(raw, str):  # a JSON line, parsed by the worker that keeps it
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as error:
                raise BadRecordError(f"{where}: malformed JSON ({error.msg})") from None
        fmt = self.options.format if self.options.format != "auto" else detect_format(raw, where)
        return normalize(raw, fmt, where, self._image_root(file), self.options)

    def _image_root(self, file: str) -> Path:
        if self.options.image_root is not None:
            return Path(os.path.abspath(self.options.image_root))
        if _remote(file):
            # A remote shard's images must be embedded: a path is looked up where nothing is.
            return Path(os.sep) / "data.image_root-not-set-for-a-remote-stream"
        return Path(file.removeprefix("file://")).parent


def stream_options(options: ReadOptions) -> ReadOptions:
    """Read options for streamed rows: images are decoded in full by the worker that encodes the row, so
    opening their headers first would read each twice."""
    return replace(options, check_headers=False, decode=False)


def streamed_batches(
    rows: Iterator[Streamed], position: Any, micro: int, collate: Any, on_bad_record: str, skipped: SkipTally
) -> Iterator[dict[str, Any]]:
    """Batches of `micro` rows that can train, in stream order; `position` (epoch, records: rows of the
    epoch consumed, batches) names the row after each batch's last. A bad row raises under
    data.on_bad_record=error; rows skipped (bad under skip, or over data.max_length) and cut are counted
    in `skipped`, which calls its `on_change` after each batch that changed it."""
    kept: list[Streamed] = []
    for item in rows:
        if isinstance(item.tensors, BadRecordError):
            too_long = isinstance(item.tensors, RecordTooLong)
            if not too_long and on_bad_record != "skip":
                raise item.tensors
            skipped.add(skipped_entry(item.file, item.row, item.tensors), too_long=too_long)
            continue
        kept.append(item)
        if len(kept) < micro:
            continue
        batch = collate([{"tensors": row.tensors, "id": row.record_id, "source": 0} for row in kept])
        if item.epoch != position.epoch:
            position.epoch, position.batches = item.epoch, 0
        position.records, position.batches = item.position + 1, position.batches + 1
        skipped.truncated += sum(row.cut for row in kept)
        skipped.changed()
        kept = []
        yield batch
