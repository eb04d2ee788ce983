"""One sample's tensors: cut to data.max_length, and padded into a batch with others.

A sample longer than data.max_length is cut on its answer side, images kept whole, or skipped
(`fit_to_length`), alike with the data cache and without, so both paths train on the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from launcher.config.schema import DataConfig
from launcher.data.formats import BadRecordError
from launcher.data.video import SECONDS_PER_PATCH

IGNORE_INDEX = -100  # label value the loss skips

# A cut record keeps at least this many answer tokens (its whole answer when shorter); a record whose
# prompt and images leave less room is skipped instead: a few tokens of an answer teach little.
MIN_ANSWER_TOKENS = 16


# The token tensors a batch pads, and with what (None: the pad token); attention_mask is made by padding.
PADDED_KEYS = {"input_ids": None, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}


# The tensors of a sample that hold one entry per token; the others hold rows per image.
TOKEN_KEYS = (*PADDED_KEYS, "attention_mask")


class RecordTooLong(BadRecordError):
    """A record over data.max_length that is not cut (data.truncation=skip, or no room left for its
    answer): skipped and listed in RUN/skipped_records.jsonl, whatever data.on_bad_record says."""


@dataclass(frozen=True)
class LengthLimit:
    """data.max_length (tokens per sample, image tokens included; None: no limit) and data.truncation."""

    max_length: int | None = None
    truncation: str = "truncate"  # truncate: cut the answer side (or skip when that cannot fit) | skip

    @classmethod
    def of(cls, data: DataConfig) -> LengthLimit:
        return cls(None if data.max_length is None else int(data.max_length), str(data.truncation))


def one_row(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A one-sample batch -> that sample's tensors: token tensors without the batch axis, no attention mask."""
    return {key: value[0] if key in TOKEN_KEYS else value for key, value in batch.items() if key != "attention_mask"}


def fit_to_length(row: dict[str, torch.Tensor], limit: LengthLimit, processor) -> tuple[dict[str, torch.Tensor], bool]:
    """One sample's tensors (`one_row`) within limit.max_length; returns (tensors, whether they were cut).

    truncate: the sample ends at its last answer token within the limit, so the prompt before the first
    answer stays whole and the answer side is cut from the end (later turns first). An image whose
    tokens would lie past the cut goes whole, with its pixels (a video likewise): the model checks that
    image tokens and image features agree. At least MIN_ANSWER_TOKENS answer tokens (or the whole answer)
    must remain, else RecordTooLong. skip: RecordTooLong for any longer sample. The reason says nothing of
    where the record is; callers add that."""
    length, longest = len(row["input_ids"]), limit.max_length
    if longest is None or length <= longest:
        return row, False
    if limit.truncation == "skip":
        raise RecordTooLong(f"{length:,} tokens, over data.max_length={longest} (data.truncation=skip)")
    answer = (row["labels"] != IGNORE_INDEX).nonzero().flatten()
    kept = answer[answer < longest]
    wanted = max(1, min(MIN_ANSWER_TOKENS, len(answer)))
    if len(kept) < wanted:
        before = int(answer[0]) if len(answer) else length
        fix = "raise data.max_length or shorten the prompt"
        if "image_grid_thw" in row:  # Qwen2-VL: an image's tokens follow its pixels
            fix += " (or lower model.max_pixels: fewer tokens per image)"
        if "video_grid_thw" in row:  # a video taken as a video: its tokens follow its frames
            fix += " (or sample fewer or smaller frames: data.video.max_frames, data.video.max_pixels)"
        raise RecordTooLong(
            f"{length:,} tokens, over data.max_length={longest}, and {before:,} of them (prompt and images) come "
            f"before the answer: no room for {wanted} answer tokens; {fix}"
        )
    end = int(kept[-1]) + 1
    out = {key: value[:end] for key, value in row.items() if key in TOKEN_KEYS}
    for kind in (IMAGES, VIDEOS):
        if kind.grid in row or kind.pixels in row:
            out.update(_kept_whole(row, end, kind, processor, f"{length:,} tokens, over data.max_length={longest}"))
    return out, True


@dataclass(frozen=True)
class MediaKind:
    """Where a kind of media (images, videos) keeps its tokens and pixels in a sample's or batch's tensors."""

    name: str  # what the reasons call them
    token: str  # the processor's attribute naming its token id
    grid: str  # its (t, h, w) rows, one per image or video (the Qwen2-VL family)
    pixels: str
    # Other tensors of one entry per image or video (a video's seconds per temporal patch: Qwen2.5-VL).
    per_item: tuple[str, ...] = ()

    def count(self, tensors: dict[str, torch.Tensor]) -> int:
        """How many the tensors hold: a grid row each (the Qwen2-VL family), else a pixel row each (LLaVA)."""
        if self.grid in tensors:
            return len(tensors[self.grid])
        return len(tensors[self.pixels]) if self.pixels in tensors else 0


IMAGES = MediaKind("images", "image_token_id", "image_grid_thw", "pixel_values")
VIDEOS = MediaKind("videos", "video_token_id", "video_grid_thw", "pixel_values_videos", (SECONDS_PER_PATCH,))


def _kept_whole(row: dict[str, torch.Tensor], end: int, kind: MediaKind, processor, said: str) -> dict:
    """The tensors of the images (or videos) whose tokens all lie before `end`: a cut ends on an answer token,
    so never inside one's tokens."""
    token_id = getattr(processor, kind.token)
    per_item = _tokens_per_item(row, kind, token_id, processor)
    held = int((row["input_ids"][:end] == token_id).sum())
    items = total = 0
    while items < len(per_item) and total + per_item[items] <= held:
        total, items = total + per_item[items], items + 1
    if total != held:
        raise RecordTooLong(f"{said}: cannot be cut between its {kind.name}")
    grid = row.get(kind.grid)
    out = {}
    if grid is not None:  # the Qwen2-VL family: rows of patches, t x h x w per image or video
        out[kind.grid] = grid[:items]
        if kind.pixels in row:
            out[kind.pixels] = row[kind.pixels][: int(grid[:items].prod(-1).sum())]
    elif kind.pixels in row:  # LLaVA: a row of pixel values per image
        out[kind.pixels] = row[kind.pixels][:items]
    out.update({key: row[key][:items] for key in kind.per_item if key in row})
    return out


def _tokens_per_item(row: dict[str, torch.Tensor], kind: MediaKind, token_id: int, processor) -> list[int]:
    """Language-model tokens of each image (or video) of a sample, in order."""
    grid = row.get(kind.grid)
    if grid is not None:  # the Qwen2-VL family: merge x merge patches make one token
        merge = int(getattr(processor.image_processor, "merge_size", 1))
        return [int(patches) // merge**2 for patches in grid.prod(-1)]
    images = kind.count(row)
    held = int((row["input_ids"] == token_id).sum())
    return [held // images] * images if images else []  # LLaVA: every image the same


def pad_rows(rows: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Samples' tensors (`RecordEncoder`'s) -> the processor's right-padded batch of them, with
    attention_mask; per-image tensors (pixel_values, image_grid_thw) concatenated, left out when no
    sample has an image (as the processor leaves them out of a text-only batch)."""
    width = max(len(row["input_ids"]) for row in rows)
    batch: dict[str, torch.Tensor] = {}
    for name, fill in PADDED_KEYS.items():
        if name not in rows[0]:
            continue
        value = pad_token_id if fill is None else fill
        padded = torch.full((len(rows), width), value, dtype=rows[0][name].dtype)
        for number, row in enumerate(rows):
            padded[number, : len(row[name])] = row[name]
        batch[name] = padded
    batch["attention_mask"] = torch.zeros((len(rows), width), dtype=torch.int64)
    for number, row in enumerate(rows):
        batch["attention_mask"][number, : len(row["input_ids"])] = 1
    names = dict.fromkeys(name for row in rows for name in row if name not in PADDED_KEYS)  # in order, once
    for name in names:
        held = [row[name] for row in rows if name in row]
        if any(len(value) for value in held):
            batch[name] = torch.cat(held)  # pixel_values, image_grid_thw
    return batch


def unchanged(item: Any) -> Any:
    """A DataLoader's collate_fn that hands items on as they are (the default would make numpy arrays
    tensors again)."""
    return item
