"""The record index: each data file's records, read and checked once, kept as a memory-mapped Arrow file.

Reading a data file means parsing it (a 665K-record LLaVA JSON is ~1 GB of text) and checking every
record and image header: minutes, and gigabytes of Python objects in every process that does it (the
launcher and each rank). The first reader of a file writes its records, in the common form of
launcher/data/formats.py, to cache_dir/record_index/KEY.arrow; every later reader, in any process,
memory-maps that file. A record is made into a dict only when it is asked for, so what a process holds
does not grow with the set: the pages of the file live in the page cache, shared by every process of the
machine. KEY covers the file's path, size and modification time and the read options (format, image
root, bad-record handling, image checks): an edited file, or other options, make a new index. A large
file is parsed in a child process (CHILD_BUILD_BYTES), so that the reader keeps none of the parse's memory.

Hub ids (read through `datasets`, whose own cache is Arrow already) are read as before, into a list.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from launcher.core.children import helper_process
from launcher.core.manifest import damage, fingerprint
from launcher.data.formats import ReadOptions, read_records

INDEX_VERSION = 2  # 2: records' videos

log = logging.getLogger("launcher")
BATCH_ROWS = 4096  # records per Arrow record batch: what one sequential read parses at a time
# Data files at least this large are indexed in a child process: parsing one holds ~15x its size in
# Python objects (2 GB for a 132 MiB, 665K-record JSON), which the launcher, living as long as the job,
# would otherwise keep. Smaller ones are read in place (a child costs ~1 s to start).
CHILD_BUILD_BYTES = 32 * 2**20
IMAGE = pa.struct([("path", pa.string()), ("bytes", pa.binary())])
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("where", pa.string()),
        ("file", pa.string()),
        ("index", pa.int64()),
        ("images", pa.list_(IMAGE)),
        ("messages", pa.string()),  # JSON: the chat-template messages
        ("videos", pa.list_(IMAGE)),  # as images: a path or the bytes
    ]
)


class RecordTable(Sequence):
    """The records of one indexed file: a memory-mapped Arrow table, each record made a dict when read.

    Pickles as its path (a DataLoader worker maps the file itself)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._table: pa.Table | None = None
        self._length = int(json.loads(self.path.with_suffix(".json").read_text())["records"])

    @property
    def table(self) -> pa.Table:
        if self._table is None:
            with pa.memory_map(str(self.path)) as source:
                self._table = pa.ipc.open_file(source).read_all()
        return self._table

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        if isinstance(index, slice):  # a list of the records, as a list's slice is
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -self._length <= index < self._length:
            raise IndexError(index)
        row = self.table.slice(index % self._length, 1).to_pylist()[0]
        return _record(row)

    def __iter__(self) -> Iterator[dict]:
        for batch in self.table.to_batches(max_chunksize=BATCH_ROWS):
            for row in batch.to_pylist():
                yield _record(row)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_table": None}


def holds_videos(records: Sequence[dict]) -> bool:
    """Whether any of `records` has a video: an indexed file's from its videos column alone (milliseconds at
    a million records, no record read), a list's by looking at each."""
    if isinstance(records, Records):
        return any(holds_videos(part) for part in records.parts)
    if isinstance(records, RecordTable):
        most = pc.max(pc.list_value_length(records.table.column("videos"))).as_py()
        return bool(most)  # None when the file has no records
    return any(record.get("videos") for record in records)


class Records(Sequence):
    """The records of several sources as one sequence: record i of source s carries "source": s.

    Each source's records are a RecordTable or a list; `sources` gives every record's source number
    without reading the records."""

    def __init__(self, parts: list[Sequence[dict]], numbers: list[int] | None = None):
        self.parts = parts
        self.numbers = numbers if numbers is not None else list(range(len(parts)))
        self.starts = np.cumsum([0, *(len(part) for part in parts)]).tolist()

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: int) -> dict:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = bisect.bisect_right(self.starts, index) - 1
        return {**self.parts[part][index - self.starts[part]], "source": self.numbers[part]}

    def __iter__(self) -> Iterator[dict]:
        for part, number in zip(self.parts, self.numbers, strict=True):
            for record in part:
                yield {**record, "source": number}

    def fingerprint(self) -> str | None:
        """What the records are, without reading them: their index files and sources; None when a part is
        not indexed (a hub id's list)."""
        if not all(isinstance(part, RecordTable) for part in self.parts):
            return None
        return json.dumps([[part.path.stem, number] for part, number in zip(self.parts, self.numbers, strict=True)])

    @property
    def sources(self) -> np.ndarray:
        """Each record's source number, in order."""
        return np.repeat(np.asarray(self.numbers, dtype=np.int64), [len(part) for part in self.parts])


def indexed_records(
    path: str, options: ReadOptions, index_dir: Path, skip_log: list[dict] | None = None
) -> tuple[Sequence[dict], int, str]:
    """(records, skipped, format) of one data file, as launcher.data.formats.read_records gives them, read
    from the file's index (built here when missing). A hub id is read into a list, unindexed."""
    identity = file_identity(path)
    if identity is None:
        return read_records(path, options, skip_log)
    table = index_table(identity, options, index_dir)
    meta = read_index_meta(table)
    if meta is None and sum(size for _, size, _ in identity[1]) < CHILD_BUILD_BYTES:
        meta = _build(path, options, table)
    elif meta is None:  # parsed in a process of its own, whose memory (GBs at 665K records) goes with it
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn, initializer=helper_process) as child:
            meta = child.submit(_build, path, options, table).result()
    if skip_log is not None:
        skip_log += meta["skip_log"]
    return RecordTable(table), int(meta["skipped"]), str(meta["format"])


def index_table(identity: list[Any], options: ReadOptions, index_dir: Path) -> Path:
    """Where the index of the file `identity` (`file_identity`) read with `options` is (or goes)."""
    read = asdict(options)
    if not options.decode:  # reading checks a video's length alone; which frames train is the loaders' concern
        read["video"] = {"max_seconds": options.video.max_seconds}
    key = hashlib.sha256(json.dumps([INDEX_VERSION, identity, read], sort_keys=True, default=str).encode()).hexdigest()
    key = key[:20]
    return index_dir / f"{key}.arrow"


def _build(path: str, options: ReadOptions, table: Path) -> dict:
    """Read and check the file, write its index; its meta (the index's .json)."""
    started = time.perf_counter()
    records, skipped, fmt = read_records(path, options, log := [])
    meta = {"version": INDEX_VERSION, "records": len(records), "skipped": skipped, "format": fmt, "skip_log": log}
    meta["build_seconds"] = round(time.perf_counter() - started, 3)  # the write's share left out: small
    _write(table, records, meta)
    return meta


def file_identity(path: str) -> list[Any] | None:
    """What says a local data file (or `datasets` folder) changed: its path, and each file's size and
    modification time; None for a hub id."""
    local = Path(path).expanduser()
    if not local.exists():
        return None
    files = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else [local]
    stats = [(str(p.relative_to(local)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return [os.path.abspath(local), stats]


def read_index_meta(table: Path) -> dict | None:
    """The index's meta when the index is complete and its Arrow file the one written (size and SHA-256 as
    the meta records); None: build it (again), a damaged one named in one line first."""
    done = table.with_suffix(".json")
    try:
        meta = json.loads(done.read_text())
    except OSError:
        return None  # not built yet, or killed before it was marked complete
    except ValueError:
        meta, why = None, f"{done.name} does not parse as JSON"
    else:
        if not isinstance(meta, dict) or meta.get("version") != INDEX_VERSION:
            return None
        why = damage(table, meta.get("arrow"))
        if why is None:
            return meta
    log.warning("record index %s is damaged (%s): building it again", table, why)
    done.unlink(missing_ok=True)
    return None


def _write(table: Path, records: list[dict], meta: dict) -> None:
    """The Arrow file, then its .json (which marks it complete), each written aside and renamed into place:
    readers at the same time see the whole index or none."""
    table.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=table.parent, prefix=f".{table.stem}.", suffix=".arrow", delete=False) as tmp:
        try:
            with pa.ipc.new_file(tmp, SCHEMA) as writer:
                for start in range(0, len(records), BATCH_ROWS):
                    rows = [table_row(record) for record in records[start : start + BATCH_ROWS]]
                    writer.write_batch(pa.RecordBatch.from_pylist(rows, schema=SCHEMA))
        except BaseException:
            os.unlink(tmp.name)
            raise
    os.replace(tmp.name, table)
    meta = {**meta, "arrow": fingerprint(table)}  # what a reader checks before it trusts the Arrow file
    done = table.with_suffix(".json")
    partial = done.with_name(f".{done.name}.{os.getpid()}")
    partial.write_text(json.dumps(meta) + "\n")
    os.replace(partial, done)


def table_row(record: dict) -> dict:
    return {
        "id": record["id"],
        "where": record["where"],
        "file": record["file"],
        "index": record["index"],
        "images": _media_column(record["images"]),
        "messages": json.dumps(record["messages"]),
        "videos": _media_column(record.get("videos") or []),
    }


def _media_column(sources: list[str | bytes]) -> list[dict]:
    return [{"path": None, "bytes": s} if isinstance(s, bytes) else {"path": s, "bytes": None} for s in sources]


def _record(row: dict) -> dict:
    record = {**row, "messages": json.loads(row["messages"])}
    for kind in ("images", "videos"):
        record[kind] = [media["bytes"] if media["path"] is None else media["path"] for media in row.get(kind) or []]
    if not record["videos"]:  # as formats.normalize makes it: "videos" only where a record has some
        del record["videos"]
    return record
