"""What a job's data costs to prepare, said before it is built: the record index and the data cache.

The planner (`python -m launcher.plan`) prints it; the launcher logs the index's line before it indexes a
file. A built index or cache is described as it is (records, size on disk, the build's time); a missing
one is estimated from a sample: the file's first SAMPLE_ROWS rows are read and checked as the index
build reads them, and the figures are scaled to the file's rows (from parquet metadata, a count of JSON
lines, or, for a JSON list, its size over the sample's). The data cache is estimated by encoding 8 sample
records with the job's processor (when it is on local disk): their stored bytes and encoding time, times
the records (the time shared by the ranks); without the processor, a bound: encoded images (their files'
bytes) and token tensors at data.max_length.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from launcher.core.errors import LauncherError
from launcher.data.formats import BadRecordError, ReadOptions, detect_format, normalize
from launcher.data.index import SCHEMA, file_identity, index_table, read_index_meta, table_row
from launcher.data.records import ConversationDataset
from launcher.data.stream import file_length, file_rows

SAMPLE_ROWS = 500
TOKEN_TENSORS = 3  # input_ids, labels, mm_token_type_ids (Qwen2-VL), each 4 bytes per token


@dataclass
class DataCost:
    """What building one thing (the record index of a file, a split's data cache) costs, or cost."""

    what: str
    built: bool
    records: int | None = None
    bytes: int | None = None
    seconds: float | None = None  # one process's time (a build shared by ranks: each rank's)
    sample: list[dict] | None = None  # the records read to estimate it (a missing index)
    at_most: bool = False  # `bytes` is a bound (the data cache: every record at data.max_length tokens)

    def line(self) -> str:
        facts = [f"{self.records:,} records" if self.records is not None else ""]
        if self.bytes is not None:
            facts.append(f"{'at most ' if self.at_most else ''}{self.bytes / 2**20:,.1f} MiB")
        if self.seconds is not None:
            facts.append(f"{'built in' if self.built else 'about'} {self.seconds:,.1f} s")
        said = ", ".join(fact for fact in facts if fact)
        if self.built:
            return f"{self.what}: built ({said})"
        return f"{self.what}: not built yet; estimated {said} (from its first {SAMPLE_ROWS} records)"


def index_cost(path: str, options: ReadOptions, index_dir: Path) -> DataCost | None:
    """The record index of one data file: as built, or estimated; None for a hub id, a `datasets` folder (not
    sampled) or a file that does not read (indexing it reports why)."""
    identity = file_identity(path)
    if identity is None:
        return None
    table = index_table(identity, options, index_dir)
    meta = read_index_meta(table)
    what = f"record index of {path}"
    if meta is not None:
        return DataCost(what, True, int(meta["records"]), table.stat().st_size, meta.get("build_seconds"))
    if Path(path).is_dir():
        return None
    started = time.process_time()
    try:  # a JSON list: parsed whole, once, as a build does
        rows = list(itertools.islice(file_rows(path), SAMPLE_ROWS))
    except (LauncherError, OSError, pa.ArrowException):  # reading it for the index says what is wrong, in one line
        return None
    read_s = time.process_time() - started
    started = time.process_time()
    records = _checked(path, rows, options)
    check_s = time.process_time() - started
    if not rows:
        return DataCost(what, False, 0, 0, read_s)
    listed = Path(path).suffix == ".json" and not isinstance(rows[0], str)  # a JSON list, not JSON lines
    total = _rows_in(path, rows, listed=listed)
    arrow = pa.Table.from_pylist([table_row(record) for record in records], schema=SCHEMA).nbytes if records else 0
    seconds = (read_s if listed else read_s * total / len(rows)) + check_s * total / len(rows)
    return DataCost(what, False, total, int(arrow * total / len(rows)), seconds, records)


def _checked(path: str, rows: list[Any], options: ReadOptions) -> list[dict]:
    """The sample's rows made records and checked (image headers among the checks) as the index build does."""
    image_root = Path(os.path.abspath(options.image_root or Path(path).parent))
    records, fmt = [], None if options.format == "auto" else options.format
    for index, raw in enumerate(rows):
        where = f"{path} record {index}"
        try:
            raw = json.loads(raw) if isinstance(raw, str) else raw
            fmt = fmt or detect_format(raw, where)
            records.append({**normalize(raw, fmt, where, image_root, options), "file": path, "index": index})
        except (BadRecordError, ValueError):
            continue
    return records


def _rows_in(path: str, sample: list[Any], *, listed: bool) -> int:
    """The file's rows: the sample's when it is all of them, else counted (JSON lines unparsed, parquet
    metadata) or, for a JSON list, its size over the sample's rather than parsing it again."""
    if len(sample) < SAMPLE_ROWS:
        return len(sample)
    if not listed:
        return file_length(path)
    sample_bytes = sum(len(json.dumps(row)) + 2 for row in sample)
    return round(len(sample) * os.path.getsize(path) / sample_bytes)


def cache_cost(
    records: int, sample: list[dict], *, max_length: int | None, images: str, encode: Any = None, ranks: int = 1
) -> DataCost:
    """A split's data cache of `records` records like `sample`'s. With `encode` (the job's RecordEncoder):
    its size as 8 sample records encode and store, and its build time per rank (their encoding time, times
    the records, over the ranks). Without: at most its size with encoded images (their files' bytes) and
    every record at data.max_length tokens; no time."""
    if encode is None or not sample:
        files = [media for record in sample for media in [*record["images"], *record.get("videos", ())]]
        mean_image = sum(_image_bytes(media) for media in files) / max(1, len(sample))
        tokens = TOKEN_TENSORS * 4 * (max_length or 0)
        size = int(records * (mean_image + tokens)) if images == "encoded" and max_length else None
        return DataCost("data cache", False, records, size, None, at_most=True)
    few = ConversationDataset(sample[:9], encode.video)
    _encoded_bytes(encode, few, 0)  # the first call compiles the chat template: not what a record costs
    started, stored = time.process_time(), 0
    for index in range(1, len(few)):
        stored += _encoded_bytes(encode, few, index)
    per_record = (time.process_time() - started) / max(1, len(few) - 1)
    size = int(records * stored / max(1, len(few) - 1))
    return DataCost("data cache", False, records, size, per_record * records / ranks)


def _encoded_bytes(encode: Any, records: ConversationDataset, index: int) -> int:
    """What one record's tensors take in the cache (64-bit integers stored in 32); 0 for a record skipped."""
    try:
        tensors, _ = encode(records[index], records.records[index]["images"])
    except BadRecordError:
        return 0
    return sum(t.numel() * (4 if t.dtype == torch.int64 else t.element_size()) for t in tensors.values())


def _image_bytes(image: str | bytes) -> int:
    if isinstance(image, bytes):
        return len(image)
    try:
        return os.path.getsize(image)
    except OSError:
        return 0
