"""Data: the built-in shapes set, sources and mixtures, collation and exact-match eval.

Records are read by launcher/formats.py (LLaVA, ShareGPT, OpenAI-style messages; JSON, JSON lines,
`datasets` files) into one form: {"id", "where", "images", "messages"}, any number of images each.

Collation renders each conversation with the processor's own chat template and tokenizes it with the
processor (image tokens expanded), so the same code serves tiny builds and real llava-1.5 / Qwen2-VL
processors. Loss is on the assistant's tokens only. A sample longer than data.max_length is cut on its
answer side, images kept whole, or skipped (`fit_to_length`), alike with the data cache and without.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import tempfile
from bisect import bisect_right
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset

from launcher.core.errors import LauncherError
from launcher.data.formats import (
    DEFAULT_MAX_IMAGE_PIXELS,
    IMAGE_PLACEHOLDER,
    BadRecordError,
    ReadOptions,
    looks_like_hub_id,
    open_image,
    read_records,
)

IGNORE_INDEX = -100  # label value the loss skips
QUESTION = "what is in the image?"
COLOUR_QUESTION = "what colour is the shape?"
# The built-in set's tasks (data.task): the question each asks, and its answer from (colour, shape).
TASKS = {
    "shape": (QUESTION, lambda colour, shape: f"{colour} {shape}"),
    "colour": (COLOUR_QUESTION, lambda colour, shape: colour),
}

# ---------------------------------------------------------------------------------------------------
# The built-in data set: coloured shapes


COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (225, 205, 30),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}
SHAPES = ("circle", "square", "triangle")
_SHAPES_VERSION = 1  # bump when the drawing changes, so cached sets are regenerated
# A shape's side as a fraction of the image side (min, max). At 32 px, shapes of 11-22 px left the tiny
# models guessing circle vs square for long (0.6 exact match after 1500 steps); 16-29 px is learned
# to >0.95 in 1000 steps of 32 (bench/learnability.py).
SHAPE_EXTENT = (0.5, 0.9)
_SHAPES_MARKER = "shapes.json"


def generate_shapes(
    out_dir: Path, *, seed: int, n_train: int, n_eval: int, image_size: int, task: str = "shape"
) -> tuple[Path, Path, Path]:
    """Write a deterministic coloured-shapes question set; return (train json, eval json, image root).

    Each image holds one shape (6 colours x 3 shapes) at a random position and size (SHAPE_EXTENT) on a
    lightly noisy background, with jittered colours. `task` picks the question: "shape" asks what is in
    the image (18 answers such as "red circle"), "colour" asks the shape's colour (6 answers such as
    "red"); the images are the same for the same seed whatever the task. Classes are balanced; the eval
    split holds images that do not occur in the train split. The files are ordinary LLaVA-format records
    + PNGs, so they go through the same loader as user data. A complete set for the same arguments is
    reused; a new one is written to a temporary directory and renamed into place.
    """
    if task not in TASKS:
        raise LauncherError(f"data.task={task} is not a task of the built-in set: choose one of {', '.join(TASKS)}")
    question, answer = TASKS[task]
    out_dir = Path(out_dir)
    arguments = {
        "version": _SHAPES_VERSION,
        "task": task,
        "seed": seed,
        "n_train": n_train,
        "n_eval": n_eval,
        "image_size": image_size,
        "extent": list(SHAPE_EXTENT),
    }
    paths = (out_dir / "train.json", out_dir / "eval.json", out_dir / "images")
    if _read_json(out_dir / _SHAPES_MARKER) == arguments:
        return paths

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        seen: set[str] = set()
        for split, count, stream in (("train", n_train, 0), ("eval", n_eval, 1)):
            rng = np.random.default_rng([seed, stream])
            (tmp_dir / "images" / split).mkdir(parents=True)
            records = []
            labels = [(c, s) for c in COLOURS for s in SHAPES]
            order = [labels[i % len(labels)] for i in rng.permutation(count)]
            for index, (colour, shape) in enumerate(order):
                pixels = _draw_unseen(rng, colour, shape, image_size, seen)
                name = f"{split}/{index:05d}.png"
                Image.fromarray(pixels).save(tmp_dir / "images" / name)
                records.append(
                    {
                        "id": f"{split}-{index:05d}",
                        "image": name,
                        "conversations": [
                            {"from": "human", "value": f"{IMAGE_PLACEHOLDER}\n{question}"},
                            {"from": "gpt", "value": answer(colour, shape)},
                        ],
                    }
                )
            (tmp_dir / f"{split}.json").write_text(json.dumps(records, indent=1) + "\n")
        (tmp_dir / _SHAPES_MARKER).write_text(json.dumps(arguments, indent=2) + "\n")
        if out_dir.exists() and _read_json(out_dir / _SHAPES_MARKER) != arguments:
            shutil.rmtree(out_dir, ignore_errors=True)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:  # another rank got there first
            if _read_json(out_dir / _SHAPES_MARKER) != arguments:
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return paths


def _draw_unseen(rng: np.random.Generator, colour: str, shape: str, size: int, seen: set[str]) -> np.ndarray:
    """Draw until the image differs from every image drawn before (keeps the splits disjoint)."""
    while True:
        pixels = _draw_shape(rng, colour, shape, size)
        digest = hashlib.sha1(pixels.tobytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            return pixels


def _draw_shape(rng: np.random.Generator, colour: str, shape: str, size: int) -> np.ndarray:
    background = rng.integers(200, 250)
    noise = rng.integers(-12, 13, size=(size, size, 3))
    image = Image.fromarray(np.clip(background + noise, 0, 255).astype(np.uint8))
    extent = int(rng.integers(round(SHAPE_EXTENT[0] * size), round(SHAPE_EXTENT[1] * size) + 1))
    left = int(rng.integers(0, size - extent + 1))
    top = int(rng.integers(0, size - extent + 1))
    box = (left, top, left + extent - 1, top + extent - 1)
    fill = tuple(int(np.clip(v + rng.integers(-20, 21), 0, 255)) for v in COLOURS[colour])
    draw = ImageDraw.Draw(image)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(left + (extent - 1) / 2, top), (box[0], box[3]), (box[2], box[3])], fill=fill)
    return np.asarray(image)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------------
# Loading records


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

    train: list[dict]
    eval: list[dict]
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


def read_data(data: Any, cache: Path, *, decode: bool = False) -> LoadedData:
    """The train and eval records of the `data` config (the built-in set is generated first).

    `decode=True` decodes every image while reading, so that under data.on_bad_record=skip a truncated
    image is skipped here rather than failing a DataLoader worker later."""
    sources, eval_source = data_sources(data, cache, decode=decode)
    train, skipped, formats = [], 0, []
    train_log: list[dict] = []
    for index, source in enumerate(sources):
        records, source_skipped, fmt = read_records(source.path, source.options, train_log)
        for record in records:
            record["source"] = index
        train += records
        skipped += source_skipped
        formats.append(fmt)
    eval_records: list[dict] = []
    eval_log: list[dict] = []
    if eval_source is not None:
        eval_records, eval_skipped, _ = read_records(eval_source.path, eval_source.options, eval_log)
        skipped += eval_skipped
    skip_log = [{"split": split, **entry} for split, log in (("train", train_log), ("eval", eval_log)) for entry in log]
    return LoadedData(train, eval_records, skipped, sources, formats, skip_log)


def data_sources(data: Any, cache: Path, *, decode: bool = False) -> tuple[list[Source], Source | None]:
    """The training sources (one, or data.sources) and the held-out source of the `data` config."""
    if data.synthetic:
        train_file, eval_file, image_root = prepare_data(data, cache)
        options = _read_options(data, cache, image_root=image_root, decode=decode, check_headers=False)
        return [Source(str(data.name), str(train_file), 1.0, options)], Source("eval", str(eval_file), 1.0, options)
    if data.image_root and not Path(str(data.image_root)).expanduser().is_dir():
        raise LauncherError(f"data.image_root={data.image_root}: no such directory")
    listed = list(data.get("sources") or [])
    if listed and data.path:
        raise LauncherError("data.path and data.sources are both set: give one file (data.path) or a mixture")
    if not listed and not data.path:
        raise LauncherError(f"data.path is not set for data={data.name}: give the training file, folder or hub id")
    entries = listed or [{"path": data.path, "weight": 1.0}]
    sources = []
    for index, entry in enumerate(entries):
        key = f"data.sources[{index}]" if listed else "data"
        path = _existing_data_path(entry.get("path"), f"{key}.path")
        weight = entry.get("weight", 1.0)
        if not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
            raise LauncherError(f"{key}.weight={weight}: a mixture weight must be a positive number")
        name = entry.get("name") or Path(path).stem or f"source{index}"
        root = entry.get("image_root") or data.image_root
        options = _read_options(data, cache, image_root=root, decode=decode, fmt=entry.get("format"))
        sources.append(Source(str(name), path, float(weight), options))
    names = [source.name for source in sources]
    if len(set(names)) < len(names):
        raise LauncherError(f"data.sources: names {names} repeat; give each source a distinct name")
    eval_source = None
    if data.eval_path:
        path = _existing_data_path(data.eval_path, "data.eval_path")
        eval_options = _read_options(data, cache, image_root=data.image_root, decode=decode)
        eval_source = Source("eval", path, 1.0, replace(eval_options, split=str(data.get("eval_split") or "train")))
    return sources, eval_source


def _read_options(
    data: Any, cache: Path, *, image_root: Any, decode: bool, fmt: Any = None, check_headers: bool = True
) -> ReadOptions:
    return ReadOptions(
        check_headers=check_headers,
        format=str(fmt or data.get("format") or "auto"),
        image_root=Path(str(image_root)).expanduser() if image_root else None,
        on_bad_record=str(data.on_bad_record),
        max_image_pixels=int(data.get("max_image_pixels") or DEFAULT_MAX_IMAGE_PIXELS),
        decode=decode,
        split=str(data.get("split") or "train"),
        cache_dir=cache / "hf_datasets",
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


# ---------------------------------------------------------------------------------------------------
# Dataset


class ConversationDataset(Dataset):
    """Records -> {"id", "where", "images": RGB PIL images, "messages", "source"}; images decode here, in workers."""

    def __init__(self, records: list[dict]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        images = [open_image(image, record["where"]) for image in record["images"]]
        return {
            "id": record["id"],
            "where": record["where"],
            "images": images,
            "messages": record["messages"],
            "source": record.get("source", 0),
        }


# ---------------------------------------------------------------------------------------------------
# Collation


def _render(processor, messages: list[dict], *, add_generation_prompt: bool) -> str:
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_with_assistant_spans(processor, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and find the character span of each assistant reply (answer + end token).

    A reply's span runs from the end of the generation prompt rendered for the turns before it to the
    end of that reply's rendering, less trailing whitespace: it works for any template whose renderings
    of shorter conversations are prefixes of longer ones. When the template ends an assistant turn
    without the tokenizer's eos token (llava-1.5's does), eos is appended to the reply, so the model
    learns to stop.
    """
    eos = processor.tokenizer.eos_token or ""
    full = _render(processor, messages, add_generation_prompt=False)
    pieces: list[str] = []  # the output text, built from slices of `full` and appended eos tokens
    length = done = 0  # output length so far; how much of `full` is copied
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(processor, messages[:turn], add_generation_prompt=True)
        last = turn == len(messages) - 1
        upto = full if last else _render(processor, messages[: turn + 1], add_generation_prompt=False)
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise LauncherError(
                f"{type(processor).__name__}: its chat template does not render conversations "
                "prefix by prefix, so the assistant's tokens cannot be located for the labels"
            )
        end = len(upto.rstrip())
        start = length + len(prompt) - done
        pieces.append(full[done:end])
        length += end - done
        if eos and not full[len(prompt) : end].endswith(eos):
            pieces.append(eos)
            length += len(eos)
        spans.append((start, length))
        done = end
    pieces.append(full[done:])
    return "".join(pieces), spans


class Collator:
    """Samples -> a batch for `model(**batch)`: right-padded, with `labels` on assistant tokens only.

    The batch holds exactly what the processor returns for the model (input_ids, attention_mask,
    pixel_values, and for Qwen2-VL image_grid_thw and mm_token_type_ids) plus `labels`. For tokens/s
    count non-pad tokens as `int(batch["attention_mask"].sum())`.

    `image_every_batch`: a batch without images gets a dummy one (see `add_dummy_image`), so that the
    vision tower runs on every batch: under ZeRO-3 with several ranks every rank must gather the same
    parameters in the same order, or the collectives wait forever.

    `limit` (data.max_length): a batch with a longer sample is made again from each sample cut alone
    (`fit_to_length`) and padded as `CachedCollator` pads, so it is the batch the data cache gives.
    Samples that cannot be cut are found before training (`fit_records`); meeting one here is an error.
    """

    def __init__(self, processor, *, image_every_batch: bool = False, limit: LengthLimit | None = None):
        self.processor = processor
        self.image_every_batch = image_every_batch
        self.limit = limit or LengthLimit()

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.labelled(samples)
        longest = self.limit.max_length
        if longest is not None and batch["input_ids"].shape[1] > longest:
            rows = []
            for sample in samples:
                try:
                    rows.append(fit_to_length(one_row(self.labelled([sample])), self.limit, self.processor)[0])
                except RecordTooLong as error:
                    raise RecordTooLong(f"{sample.get('where', sample['id'])}: {error}") from None
            batch = pad_rows(rows, self.processor.tokenizer.pad_token_id)
        if self.image_every_batch and "pixel_values" not in batch:
            batch = add_dummy_image(self.processor, batch, padding_side="right")
        return batch

    def labelled(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        """The processor's batch of the samples, whole, with `labels`."""
        rendered = [render_with_assistant_spans(self.processor, sample["messages"]) for sample in samples]
        texts, spans = [text for text, _ in rendered], [spans for _, spans in rendered]
        batch = _encode(self.processor, texts, [s["images"] for s in samples], padding_side="right")
        offsets = batch.pop("offset_mapping")
        replacements = batch.pop("text_replacement_offsets")
        token_start, token_end = offsets[..., 0], offsets[..., 1]
        supervised = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for row, (row_spans, row_replacements) in enumerate(zip(spans, replacements, strict=True)):
            for start, end in _expanded_spans(row_spans, row_replacements):
                # Tokens overlapping the span; zero-width entries (padding, an added bos) never do.
                supervised[row] |= (token_start[row] < end) & (token_end[row] > start)
        batch = dict(batch)
        batch["labels"] = batch["input_ids"].masked_fill(~supervised, IGNORE_INDEX)
        return batch


def _encode(processor, texts: list[str], images: list[list], *, padding_side: str):
    batch = processor(
        text=texts,
        images=images if any(images) else None,
        padding=True,
        padding_side=padding_side,
        return_tensors="pt",
        return_offsets_mapping=True,
        return_text_replacement_offsets=True,
    )
    if "offset_mapping" not in batch or "text_replacement_offsets" not in batch:
        raise LauncherError(
            f"{type(processor).__name__} does not report token offsets (it needs a fast tokenizer), "
            "so assistant tokens cannot be labelled"
        )
    return batch


def add_dummy_image(processor, batch: dict[str, torch.Tensor], *, padding_side: str) -> dict[str, torch.Tensor]:
    """The batch with a blank image's tokens added to row 0, where nothing sees them.

    The image's tokens go after the padding (right-padded batches) or before it (left-padded) with
    attention mask 0 and label IGNORE_INDEX: no real token attends to them, no loss is taken on them,
    so the loss, and every gradient, is what it was (the vision tower's gradient from them is zero),
    while the forward runs the vision tower as for any batch with images."""
    dummy = processor(text=[processor.image_token], images=[Image.new("RGB", (32, 32))], return_tensors="pt")
    width, rows = dummy["input_ids"].shape[1], batch["input_ids"].shape[0]
    fills = {"input_ids": processor.tokenizer.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
    out = dict(batch)
    for key, value in batch.items():
        if value.dim() != 2 or value.shape[0] != rows or key not in (*fills, "mm_token_type_ids"):
            continue
        extra = torch.full((rows, width), fills.get(key, 0), dtype=value.dtype)
        if key in ("input_ids", "mm_token_type_ids"):
            extra[0] = dummy[key][0]
        out[key] = torch.cat([value, extra] if padding_side == "right" else [extra, value], dim=1)
    for key, value in dummy.items():
        if key not in batch:  # pixel_values, image_grid_thw
            out[key] = value
    return out


def _expanded_spans(spans: list[tuple[int, int]], replacements: list[dict]) -> list[tuple[int, int]]:
    """Move character spans of the rendered text to the text with image placeholders expanded."""
    placeholder_ends = [r["span"][1] for r in replacements]
    # Characters gained by all expansions up to and including the k-th placeholder.
    gained = [0] + [r["new_span"][1] - r["span"][1] for r in replacements]
    return [tuple(c + gained[bisect_right(placeholder_ends, c)] for c in span) for span in spans]


# ---------------------------------------------------------------------------------------------------
# Sequence length: data.max_length, data.truncation

# A cut record keeps at least this many answer tokens (its whole answer when shorter); a record whose
# prompt and images leave less room is skipped instead: a few tokens of an answer teach little.
MIN_ANSWER_TOKENS = 16
# The token tensors a batch pads, and with what (None: the pad token); attention_mask is made by padding.
PADDED_KEYS = {"input_ids": None, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
# The tensors of a sample that hold one entry per token; the others hold rows per image.
TOKEN_KEYS = (*PADDED_KEYS, "attention_mask")
# Records estimated at least this far under the limit are not encoded before training (`fit_records`).
ESTIMATE_MARGIN = 8


class RecordTooLong(BadRecordError):
    """A record over data.max_length that is not cut (data.truncation=skip, or no room left for its
    answer): skipped and listed in RUN/skipped_records.jsonl, whatever data.on_bad_record says."""


@dataclass(frozen=True)
class LengthLimit:
    """data.max_length (tokens per sample, image tokens included; None: no limit) and data.truncation."""

    max_length: int | None = None
    truncation: str = "truncate"  # truncate: cut the answer side (or skip when that cannot fit) | skip

    @classmethod
    def of(cls, data: Any) -> LengthLimit:
        longest = data.get("max_length")
        return cls(None if longest is None else int(longest), str(data.get("truncation") or "truncate"))


def one_row(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A one-sample batch -> that sample's tensors: token tensors without the batch axis, no attention mask."""
    return {key: value[0] if key in TOKEN_KEYS else value for key, value in batch.items() if key != "attention_mask"}


def fit_to_length(row: dict[str, torch.Tensor], limit: LengthLimit, processor) -> tuple[dict[str, torch.Tensor], bool]:
    """One sample's tensors (`one_row`) within limit.max_length; returns (tensors, whether they were cut).

    truncate: the sample ends at its last answer token within the limit, so the prompt before the first
    answer stays whole and the answer side is cut from the end (later turns first). An image whose
    tokens would lie past the cut goes whole, with its pixels: the model checks that image tokens and
    image features agree. At least MIN_ANSWER_TOKENS answer tokens (or the whole answer) must remain,
    else RecordTooLong. skip: RecordTooLong for any longer sample. The reason says nothing of where the
    record is; callers add that."""
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
        raise RecordTooLong(
            f"{length:,} tokens, over data.max_length={longest}, and {before:,} of them (prompt and images) come "
            f"before the answer: no room for {wanted} answer tokens; {fix}"
        )
    end = int(kept[-1]) + 1
    per_image = _tokens_per_image(row, processor)
    held = int((row["input_ids"][:end] == processor.image_token_id).sum())
    images = total = 0
    while images < len(per_image) and total + per_image[images] <= held:
        total, images = total + per_image[images], images + 1
    if total != held:  # a cut ends on an answer token, so never inside an image's tokens
        raise RecordTooLong(f"{length:,} tokens, over data.max_length={longest}: cannot be cut between its images")
    grid = row.get("image_grid_thw")
    out = {}
    for key, value in row.items():
        if key in TOKEN_KEYS:
            out[key] = value[:end]
        elif key == "pixel_values" and grid is not None:  # Qwen2-VL: rows of patches, per image t*h*w
            out[key] = value[: int(grid[:images].prod(-1).sum())]
        else:  # a row per image: pixel_values (LLaVA), image_grid_thw
            out[key] = value[:images]
    return out, True


def _tokens_per_image(row: dict[str, torch.Tensor], processor) -> list[int]:
    """Language-model tokens of each image of a sample, in order."""
    grid = row.get("image_grid_thw")
    if grid is not None:  # Qwen2-VL: merge x merge patches make one token
        merge = int(getattr(processor.image_processor, "merge_size", 1))
        return [int(patches) // merge**2 for patches in grid.prod(-1)]
    pixels = row.get("pixel_values")
    images = 0 if pixels is None else len(pixels)
    held = int((row["input_ids"] == processor.image_token_id).sum())
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


@dataclass
class FitReport:
    """What data.max_length does to a list of records (`fit_records`)."""

    kept: list[int]  # positions of the records that train (as they are, or cut)
    cut: int  # how many of them are cut
    skipped: list[tuple[int, str]]  # (position, reason with the record's place) of those that do not


def fit_records(records: list[dict], processor, limit: LengthLimit, *, num_workers: int) -> FitReport:
    """Which records train as they are, cut, or not at all under `limit`: found before training when there
    is no data cache (building the cache finds them itself), so every rank drops the same records.

    Each record's length is estimated from its rendered text and its images' sizes (read from their
    headers, no pixels); only records estimated within ESTIMATE_MARGIN of the limit or over it are
    encoded (images decoded) and cut as `Collator` cuts them. In `num_workers` processes."""
    if limit.max_length is None:
        return FitReport(list(range(len(records))), 0, [])
    loader = DataLoader(
        _Fitted(records, processor, limit),
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=8 if num_workers else None,
        collate_fn=unchanged,
    )
    report = FitReport([], 0, [])
    for index, outcome in loader:
        if isinstance(outcome, RecordTooLong):
            report.skipped.append((index, str(outcome)))
        elif isinstance(outcome, BadRecordError):  # an image that does not decode, under data.on_bad_record=error
            raise outcome
        else:
            report.kept.append(index)
            report.cut += outcome
    if not report.kept:
        raise nothing_fits(len(records), limit, len(report.skipped), 0, report.skipped[0][1])
    return report


def nothing_fits(count: int, limit: LengthLimit, too_long: int, bad: int, example: str) -> LauncherError:
    """The error when no record of a split is left under data.max_length (one line, with one reason)."""
    return LauncherError(
        f"data: none of the {count} records fits data.max_length={limit.max_length} ({too_long} too long, "
        f"{bad} bad), e.g. {example}"
    )


class _Fitted(Dataset):
    """Record i -> (i, whether it is cut), or (i, the RecordTooLong or BadRecordError that stops it)."""

    def __init__(self, records: list[dict], processor, limit: LengthLimit):
        self.records, self.processor, self.limit = records, processor, limit

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        record = self.records[index]
        try:
            estimate = estimated_length(self.processor, record)
        except (OSError, ValueError, Image.DecompressionBombError):  # encoding it below says what is wrong
            estimate = None
        if estimate is not None and estimate <= self.limit.max_length - ESTIMATE_MARGIN:
            return index, False
        try:
            sample = ConversationDataset(self.records)[index]
            row = one_row(Collator(self.processor).labelled([sample]))
            return index, fit_to_length(row, self.limit, self.processor)[1]
        except RecordTooLong as error:
            return index, RecordTooLong(f"{record['where']}: {error}")
        except BadRecordError as error:
            return index, error


def estimated_length(processor, record: dict) -> int | None:
    """A record's tokens as the processor makes them, from its rendered text and its images' sizes (their
    headers): the text's tokens, each image placeholder counted as the tokens its image takes. None when
    the processor cannot say how many tokens an image of a given size takes."""
    text, _ = render_with_assistant_spans(processor, record["messages"])
    tokens = len(processor.tokenizer(text)["input_ids"])
    if not record["images"]:
        return tokens
    sizes = []
    for image in record["images"]:
        with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as opened:
            sizes.append((opened.height, opened.width))
    try:
        counts = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    except (AttributeError, KeyError, TypeError, NotImplementedError):
        return None
    return tokens + sum(int(count) - 1 for count in counts)


class PromptCollator:
    """Samples -> (left-padded prompt batch for `generate`, reference answers).

    The prompt is the conversation up to the last assistant turn plus the generation prompt; the
    reference is that turn's text. `image_every_batch` as for `Collator`.
    """

    def __init__(self, processor, *, image_every_batch: bool = False):
        self.processor = processor
        self.image_every_batch = image_every_batch

    def __call__(self, samples: list[dict]) -> tuple[dict[str, torch.Tensor], list[str]]:
        texts, answers = [], []
        for sample in samples:
            messages = sample["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            texts.append(_render(self.processor, messages[:last], add_generation_prompt=True))
            answers.append(" ".join(p["text"] for p in messages[last]["content"] if p["type"] == "text"))
        images = [s["images"] for s in samples]
        encoded = self.processor(
            text=texts, images=images if any(images) else None, padding=True, padding_side="left", return_tensors="pt"
        )
        batch = dict(encoded)
        if self.image_every_batch and "pixel_values" not in batch:
            batch = add_dummy_image(self.processor, batch, padding_side="left")
        return batch, answers


def normalize_answer(text: str) -> str:
    """Case- and whitespace-insensitive form used for exact match."""
    return " ".join(text.lower().split())


@torch.no_grad()
def exact_match_accuracy(
    model, processor, dataset_or_loader, *, max_new_tokens: int, synced_gpus: bool = False, batch_size: int = 32
) -> tuple[int, int]:
    """Greedy-generate an answer for each sample and count exact matches; return (correct, total).

    Takes a ConversationDataset (batched here) or a DataLoader built with `PromptCollator`. With
    several ranks under ZeRO-3 pass `synced_gpus=True` and give every rank the same number of batches
    (DistributedSampler pads to that), so the ranks' generate calls stay in lock-step.
    """
    loader = dataset_or_loader
    if isinstance(dataset_or_loader, Dataset):
        collate = PromptCollator(processor, image_every_batch=synced_gpus)
        loader = DataLoader(dataset_or_loader, batch_size=batch_size, collate_fn=collate)
    tokenizer = processor.tokenizer
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        for batch, answers in loader:
            batch = {
                key: value.to(model.device, model.dtype if value.is_floating_point() else None)
                for key, value in batch.items()
            }
            generated = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                synced_gpus=synced_gpus,
                pad_token_id=tokenizer.pad_token_id,
            )
            new_tokens = generated[:, batch["input_ids"].shape[1] :]
            for text, answer in zip(tokenizer.batch_decode(new_tokens, skip_special_tokens=True), answers, strict=True):
                correct += normalize_answer(text) == normalize_answer(answer)
                total += 1
    finally:
        model.train(was_training)
    return correct, total


def prepare_data(data: Any, cache: Path) -> tuple[Path, Path, Path]:
    """The built-in set's train file, eval file and image root, generated first when not cached."""
    task = str(data.get("task") or "shape")  # a config saved before data.task existed asks "shape"
    out = cache / "data" / f"{data.name}_{task}_seed{data.seed}_n{data.n_train}_{data.n_eval}_px{data.image_size}"
    train_file, eval_file, image_root = generate_shapes(
        out, seed=data.seed, n_train=data.n_train, n_eval=data.n_eval, image_size=data.image_size, task=task
    )
    return Path(train_file), Path(eval_file), Path(image_root)
