"""Packing: several records in one row up to a token budget, instead of one record per row padded to the
longest (data.packing, the budget data.pack_length).

The plan is a pure function of (lengths, budget, seed, epoch): the epoch's records are shuffled, taken in
blocks of PACK_BLOCK, and each block is packed best-fit decreasing (longest first, each into the open row
it fills most tightly, else a new row); the rows of a block are then shuffled, so that rows of long
records do not come together. A resumed run recomputes the same plan and skips the rows it consumed.

A packed row keeps its records apart: its tokens carry each record's own positions (restarting at 0),
from which the language model builds a block-diagonal causal mask (transformers' packed-sequence path; no
2-D attention mask is passed), and for Qwen2-VL each record's 3-D rotary index is computed on the record
alone (launcher.model.packing). Images go to the vision tower in the row's order. Labels stay each
record's own: a record's first token is never a target (the chat template opens every record), so the
label shift at a record boundary takes no loss across it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from launcher.data.collate import blank_media
from launcher.data.length import IGNORE_INDEX, IMAGES, VIDEOS

PACK_BLOCK = 1000  # records packed together: the plan's window, and what its rows are shuffled within
RECORD_LENGTHS = "record_lengths"  # a packed batch's tokens per record, per row: read by the step, not the model
RECORD_IMAGES = "record_images"  # images per record, per row (Qwen2-VL's per-record rotary index needs them)
RECORD_VIDEOS = "record_videos"  # videos (taken as videos) per record, per row: likewise
REAL_TOKENS = "real_tokens"  # a packed batch's mask of real (non-padding) tokens: for accounting only


def pack_rows(
    lengths: Sequence[int] | np.ndarray,
    budget: int,
    *,
    seed: int,
    epoch: int,
    images: Sequence[int] | np.ndarray | None = None,
    max_images: int | None = None,
) -> list[list[int]]:
    """Rows of record indices, each at most `budget` tokens (a longer record is a row of its own) and, given
    `max_images` and each record's `images`, at most that many images (a record with more: a row of its own).
    A record goes into the open row it fills most tightly among those with room for its images too."""
    lengths = np.asarray(lengths, dtype=np.int64)
    capped = max_images is not None and images is not None
    held = np.asarray(images if capped else np.zeros(len(lengths)), dtype=np.int64)
    most = int(max_images) if capped else 0
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    rows: list[list[int]] = []
    for start in range(0, len(order), PACK_BLOCK):
        block = order[start : start + PACK_BLOCK]
        block = block[np.argsort(-lengths[block], kind="stable")]  # longest first
        packed: list[list[int]] = []
        row_images: list[int] = []
        open_rows: list[tuple[int, int]] = []  # (room left, row number), sorted: the tightest fit found by bisection
        for index in block.tolist():
            size, count = int(lengths[index]), int(held[index])
            at = bisect.bisect_left(open_rows, (size, -1))
            if capped:  # the tightest row that has room for the record's images as well
                while at < len(open_rows) and row_images[open_rows[at][1]] + count > most:
                    at += 1
            if at < len(open_rows):
                room, number = open_rows.pop(at)
                packed[number].append(index)
                row_images[number] += count
            else:
                room, number = budget, len(packed)
                packed.append([index])
                row_images.append(count)
            if room - size > 0:  # a row at the image limit stays open to records without images
                bisect.insort(open_rows, (room - size, number))
        rows += [packed[i] for i in rng.permutation(len(packed))]
    return rows


class PackedRows(Dataset):
    """A dataset whose items are rows: index it with a tuple of record indices (PackedSampler's), get the
    records' items in that order."""

    def __init__(self, records: Any):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, row: tuple[int, ...]) -> list[Any]:
        return [self.records[index] for index in row]


class PackedCollator:
    """Rows of cached records ({"tensors"}, as CachedDataset gives them) -> one packed batch: each row's
    records back to back, rows right-padded to the longest; the padding is a sequence of its own (positions
    from 0, no labels). Position ids are left to the step (launcher.model.packing), which needs the model
    for Qwen2-VL's rotary index: the batch carries each row's record lengths and image and video counts."""

    def __init__(self, processor: Any, *, image_every_batch: bool = False, video_every_batch: bool = False):
        self.processor = processor
        self.pad_token_id = processor.tokenizer.pad_token_id
        self.image_every_batch = image_every_batch
        self.video_every_batch = video_every_batch

    def __call__(self, rows: list[list[dict]]) -> dict[str, Any]:
        records = [[record["tensors"] for record in row] for row in rows]
        held = [record for row in records for record in row]
        if self.image_every_batch and not any(IMAGES.count(record) for record in held):
            records[0] = [*records[0], self._blank(video=False)]
        if self.video_every_batch and not any(VIDEOS.count(record) for record in held):
            records[0] = [*records[0], self._blank(video=True)]
        joined = [self._joined(row) for row in records]
        width = max(len(row["input_ids"]) for row in joined)
        fills = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
        batch: dict[str, Any] = {}
        for name, fill in fills.items():
            if name in joined[0]:
                batch[name] = torch.full((len(rows), width), fill, dtype=joined[0][name].dtype)
                for number, row in enumerate(joined):
                    batch[name][number, : len(row[name])] = row[name]
        batch[REAL_TOKENS] = torch.zeros((len(rows), width), dtype=torch.int64)
        for number, row in enumerate(joined):
            batch[REAL_TOKENS][number, : len(row["input_ids"])] = 1
        for name in MEDIA_KEYS:
            held = [row[name] for row in joined if name in row and len(row[name])]
            if held:
                batch[name] = torch.cat(held)
        batch[RECORD_LENGTHS] = [row["lengths"] for row in joined]
        batch[RECORD_IMAGES] = [row["images"] for row in joined]
        batch[RECORD_VIDEOS] = [row["videos"] for row in joined]
        return batch

    def _blank(self, *, video: bool) -> dict[str, torch.Tensor]:
        """A record of one blank image (or video) and no target, added to a batch without one under the ZeRO-3
        modality guard: every rank's forward then runs the vision tower as often. A record of its own, it sees
        no other and none sees it; it has no labels, so the loss and every gradient are what they were."""
        blank = blank_media(self.processor, video=video)
        record = {key: value[0] for key, value in blank.items() if key in ("input_ids", "mm_token_type_ids")}
        record["labels"] = torch.full_like(record["input_ids"], IGNORE_INDEX)
        record.update({key: blank[key] for key in MEDIA_KEYS if key in blank})
        return record

    @staticmethod
    def _joined(records: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One row: its records' token tensors end to end, their images in order, and per record its
        length and image count."""
        joined: dict[str, Any] = {}
        for name in ("input_ids", "labels", "mm_token_type_ids"):
            if name in records[0]:
                joined[name] = torch.cat([record[name] for record in records])
        for name in MEDIA_KEYS:
            held = [record[name] for record in records if name in record and len(record[name])]
            if held:
                joined[name] = torch.cat(held)
        joined["lengths"] = [len(record["input_ids"]) for record in records]
        joined["images"] = [IMAGES.count(record) for record in records]
        joined["videos"] = [VIDEOS.count(record) for record in records]
        return joined


# A record's tensors of images and videos, concatenated over a row's records in order.
MEDIA_KEYS = (IMAGES.pixels, IMAGES.grid, *IMAGES.per_item, VIDEOS.pixels, VIDEOS.grid, *VIDEOS.per_item)
