"""The fast data path: every record decoded, resized and tokenized once, into memory-mapped tensor shards.

Without it each step decodes its images and runs the processor again (PIL, resizing, normalising, the
chat template, the tokenizer): on a small model that is most of a step. With it a step reads ready
tensors and pads them.

Layout of one cache (a directory under cache_dir/data_cache/, named by its key):
    meta.json          the key's inputs, record count, the records skipped (and why) and cut, each record's
                       id, source and position
    <name>.bin         one flat file per tensor (input_ids, labels, pixel_values, ...), records back to back
    index.npz          per tensor: the offsets of each record's rows, its dtype and its trailing shape

Why flat files and np.memmap, not the `datasets` Arrow cache: a record is a handful of arrays of
different lengths (pixel_values is most of the bytes); reading one from a memory map is a slice and a
copy, with no conversion of nested lists, and the page cache shares the bytes between DataLoader workers
and ranks on one machine. pixel_values are kept in the processor's dtype (float32), so a cached batch is
bitwise the batch the processor makes: 4 bytes per value, e.g. 1.3 MiB per 336 x 336 image.

The key covers what the tensors and their bookkeeping depend on: the records (source, text, and each
image's path, size and modification time, or its bytes), the processor (tokenizer, chat template, image settings such as
min/max pixels), the model, and data.max_length / data.truncation (a record over the limit is stored
cut, or skipped). A change to any of them builds a new cache; a complete cache is reused.
A build is written to a temporary directory and renamed into place: a crash leaves nothing that looks
complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from launcher.core.errors import LauncherError, TrainingFailed
from launcher.data.collate import Collator, add_dummy_image, nothing_fits
from launcher.data.formats import BadRecordError, skipped_entry
from launcher.data.length import LengthLimit, RecordTooLong, fit_to_length, one_row, pad_rows, unchanged

log = logging.getLogger("launcher")

CACHE_VERSION = 3  # 3: data.max_length in the key; meta.json lists the records skipped and counts those cut
META_FILE = "meta.json"
INDEX_FILE = "index.npz"


def cache_key(records: list[dict], processor: Any, model: str, limit: Any = None) -> str:
    """A digest of everything a cached tensor depends on (`limit`: a data.LengthLimit, or None)."""
    digest = hashlib.sha256()
    length = {"max_length": limit.max_length, "truncation": limit.truncation} if limit is not None else None
    digest.update(json.dumps({"version": CACHE_VERSION, "model": model, "length": length}).encode())
    digest.update(processor_fingerprint(processor).encode())
    for record in records:
        images = [_image_identity(image) for image in record["images"]]
        digest.update(json.dumps([record["id"], record.get("source", 0), record["messages"], images]).encode())
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


# ----------------------------------------------------------------------------- building
class RecordEncoder:
    """A decoded sample -> (its tensors, whether they were cut): `Collator`'s batch of that one sample,
    without the batch axis, cut to `limit` (data.max_length) as `Collator` cuts it; RecordTooLong when
    the sample is skipped instead."""

    def __init__(self, processor: Any, limit: Any = None):
        self.processor = processor
        self.collate = Collator(processor)
        self.limit = limit or LengthLimit()

    def __call__(self, sample: dict) -> tuple[dict[str, torch.Tensor], bool]:
        return fit_to_length(one_row(self.collate.labelled([sample])), self.limit, self.processor)


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


def ensure_cache(
    root: Path,
    records: list[dict],
    processor: Any,
    model: str,
    encode: RecordEncoder,
    load: Callable[[int], dict],
    *,
    on_bad_record: str,
    num_workers: int,
) -> CacheInfo:
    """The cache for these records, built when missing. `load(i)` decodes record i (images and all,
    raising BadRecordError when it cannot); `encode(sample)` turns it into the record's tensors, cut to
    its limit (part of the key). A record over the limit that cannot be cut is skipped whatever
    `on_bad_record` says."""
    key = cache_key(records, processor, model, encode.limit)
    path = root / key
    meta = _read_meta(path)
    if meta is not None:
        return _info(path, meta, built=False)
    log.info("data cache: decoding and tokenizing %d records once, into %s", len(records), path)
    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    tmp.chmod(0o755)
    try:
        try:
            written = _write_tensors(tmp, records, encode, load, on_bad_record=on_bad_record, workers=num_workers)
        except OSError as error:  # a full disk, a file size limit
            free = shutil.disk_usage(root).free / 2**30
            raise TrainingFailed(
                f"cannot write the data cache under {root} ({error.strerror or error}; {free:.1f} GiB free): free "
                "disk space, set cache_dir to a disk with room, or data.cache=false"
            ) from error
        meta = _meta(key, model, records, written, encode, round(time.perf_counter() - started, 3))
        (tmp / META_FILE).write_text(json.dumps(meta) + "\n")  # last: its presence marks a complete cache
        try:
            os.rename(tmp, path)
        except OSError:  # another process finished the same cache first
            if _read_meta(path) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _info(path, meta, built=True)


def _meta(key: str, model: str, records: list[dict], written: _Written, encode: RecordEncoder, seconds: float) -> dict:
    """meta.json of a cache built: which records it holds, which it skipped or cut, and why; or the one line
    saying that no record is left."""
    kept = written.kept
    if not kept and not written.too_long:
        raise LauncherError(
            f"data: none of the {written.skipped} records could be decoded (all skipped under "
            f"data.on_bad_record=skip): fix the images, e.g. those of {records[0]['where']}"
        )
    if not kept:
        raise nothing_fits(len(records), encode.limit, written.too_long, written.skipped, written.too_long_example)
    return {
        "version": CACHE_VERSION,
        "key": key,
        "model": model,
        "records": len(kept),
        "skipped": written.skipped,
        "truncated": written.cut,
        "too_long": written.too_long,
        "skip_log": written.skip_log,
        "indices": kept,  # positions in the records given: which survived a skip
        "ids": [records[i]["id"] for i in kept],
        "sources": [records[i].get("source", 0) for i in kept],
        "build_seconds": seconds,
    }


def _info(path: Path, meta: dict, *, built: bool) -> CacheInfo:
    return CacheInfo(
        path,
        built,
        meta["build_seconds"],
        meta["records"],
        meta["skipped"],
        meta["truncated"],
        meta["too_long"],
        meta["skip_log"],
    )


class _Decoded(Dataset):
    """Record i -> (i, its tensors, whether they were cut) or (i, the BadRecordError, False); decoding
    and encoding run in the workers."""

    def __init__(self, count: int, load: Callable[[int], dict], encode: RecordEncoder):
        self.count, self.load, self.encode = count, load, encode

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[int, Any, bool]:
        try:
            tensors, cut = self.encode(self.load(index))
            return index, {k: v.numpy() for k, v in tensors.items()}, cut
        except BadRecordError as error:  # RecordTooLong among them
            return index, error, False


@dataclass
class _Written:
    kept: list[int]  # positions of the records written
    skipped: int  # bad records skipped (data.on_bad_record=skip)
    cut: int  # records written cut to data.max_length
    too_long: int  # records over data.max_length not written
    skip_log: list[dict]  # each record not written, and why
    too_long_example: str = ""  # the first record over data.max_length, and why


def _write_tensors(
    out: Path,
    records: list[dict],
    encode: RecordEncoder,
    load: Callable[[int], dict],
    *,
    on_bad_record: str,
    workers: int,
) -> _Written:

    decoded = _Decoded(len(records), load, encode)
    loader = DataLoader(
        decoded, batch_size=None, num_workers=workers, prefetch_factor=8 if workers else None, collate_fn=unchanged
    )
    files: dict[str, Any] = {}
    offsets: dict[str, list[int]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    written = _Written([], 0, 0, 0, [])
    kept = written.kept
    try:
        for index, tensors, cut in loader:
            if isinstance(tensors, BadRecordError):
                record = records[index]
                if isinstance(tensors, RecordTooLong):
                    written.too_long += 1
                    reason = f"{record['where']}: {tensors}"
                    written.too_long_example = written.too_long_example or reason
                elif on_bad_record != "skip":
                    raise tensors
                else:
                    written.skipped += 1
                    reason = str(tensors)
                written.skip_log.append(skipped_entry(record.get("file", ""), record.get("index", index), reason))
                continue
            written.cut += cut
            for name, array in tensors.items():
                if name not in files:  # a tensor first seen here (pixel_values after text-only records)
                    files[name] = open(out / f"{name}.bin", "wb")  # noqa: SIM115 (closed in finally)
                    offsets[name], shapes[name], dtypes[name] = [0] * (len(kept) + 1), array.shape[1:], array.dtype.str
                if array.shape[1:] != shapes[name] or array.dtype.str != dtypes[name]:
                    raise LauncherError(
                        f"{records[index]['where']}: {name} has shape {array.shape} ({array.dtype}), unlike the "
                        f"records before it ({shapes[name]}, {dtypes[name]}): set data.cache=false for this processor"
                    )
                files[name].write(np.ascontiguousarray(array).tobytes())
            for name in files:  # a record without a tensor (no images) holds zero rows of it
                offsets[name].append(offsets[name][-1] + (tensors[name].shape[0] if name in tensors else 0))
            kept.append(index)
    finally:
        for handle in files.values():
            handle.close()
    np.savez(
        out / INDEX_FILE,
        **{f"{name}.offsets": np.asarray(offsets[name], dtype=np.int64) for name in files},
        **{f"{name}.shape": np.asarray(shapes[name], dtype=np.int64) for name in files},
        **{f"{name}.dtype": np.asarray(dtypes[name]) for name in files},
    )
    return written


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta if meta.get("version") == CACHE_VERSION else None


# ----------------------------------------------------------------------------- reading
class CachedDataset(Dataset):
    """A built cache -> {"tensors": {name: tensor}, "id", "source"} per record; reads are slices of memory maps."""

    def __init__(self, path: Path):
        self.path = Path(path)
        meta = _read_meta(self.path)
        if meta is None:
            raise LauncherError(f"{self.path}: not a complete data cache; delete it to have it built again")
        self.ids, self.sources, self.indices = meta["ids"], meta["sources"], meta["indices"]
        index = np.load(self.path / INDEX_FILE)
        self.names = sorted({key.rsplit(".", 1)[0] for key in index.files})
        self.offsets = {name: index[f"{name}.offsets"] for name in self.names}
        self._layout = {name: (str(index[f"{name}.dtype"]), tuple(index[f"{name}.shape"])) for name in self.names}
        self._maps: dict[str, np.memmap] | None = None  # opened lazily, in each worker

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self) -> list[int]:
        """Tokens per record (image tokens included): what length-grouped batches sort by."""
        return np.diff(self.offsets["input_ids"]).tolist()

    def _open(self) -> dict[str, np.memmap]:
        if self._maps is None:
            self._maps = {
                name: np.memmap(self.path / f"{name}.bin", dtype=dtype, mode="r").reshape(-1, *shape)
                for name, (dtype, shape) in self._layout.items()
            }
        return self._maps

    def __getitem__(self, index: int) -> dict:
        maps = self._open()
        tensors = {
            name: torch.from_numpy(np.array(maps[name][self.offsets[name][index] : self.offsets[name][index + 1]]))
            for name in self.names
        }
        return {"tensors": tensors, "id": self.ids[index], "source": self.sources[index]}

    def __getstate__(self) -> dict:  # workers open their own maps
        return {**self.__dict__, "_maps": None}


class CachedCollator:
    """Cached records -> the batch `Collator` makes from the same records (right-padded, labels)."""

    def __init__(self, processor: Any, *, image_every_batch: bool = False):
        self.processor = processor
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.image_every_batch = image_every_batch

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:

        batch = pad_rows([sample["tensors"] for sample in samples], self.pad_token_id)
        if self.image_every_batch and "pixel_values" not in batch:
            batch = add_dummy_image(self.processor, batch, padding_side="right")
        return batch
