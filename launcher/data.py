"""Data: LLaVA-format conversation records, the built-in shapes set, collation and exact-match eval.

A record (JSON list or JSON lines):
    {"id": "0", "image": "train/00000.png",
     "conversations": [{"from": "human", "value": "<image>\\nwhat is in the image?"},
                       {"from": "gpt", "value": "red circle"}, ...]}
"image" is relative to the image root; "<image>" marks where the image goes (first human turn).

Collation renders each conversation with the processor's own chat template and tokenizes it with the
processor (image tokens expanded), so the same code serves tiny builds and real llava-1.5 / Qwen2-VL
processors. Loss is on the assistant's tokens only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from bisect import bisect_right
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, Dataset

from launcher.errors import LauncherError

IGNORE_INDEX = -100  # label value the loss skips
IMAGE_PLACEHOLDER = "<image>"
QUESTION = "what is in the image?"
COLOUR_QUESTION = "what colour is the shape?"
# The built-in set's tasks (data.task): the question each asks, and its answer from (colour, shape).
TASKS = {
    "shape": (QUESTION, lambda colour, shape: f"{colour} {shape}"),
    "colour": (COLOUR_QUESTION, lambda colour, shape: colour),
}

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}

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


def load_records(path: Path, image_root: Path, *, on_bad_record: str = "error") -> tuple[list[dict], int]:
    """Read and check LLaVA-format records; return (records, number skipped).

    A JSON list or JSON lines (told apart by the first character). Each kept record is
    {"id", "image" (absolute path), "conversations", "where"}; "where" names the file and record for
    error messages raised later (an image that fails to decode in a DataLoader worker).
    on_bad_record="error" raises LauncherError at the first bad record; "skip" skips and counts bad
    records. An empty result is an error either way. Images are checked for existence here and
    decoded lazily, in `__getitem__`.
    """
    if on_bad_record not in ("error", "skip"):
        raise LauncherError(f"data.on_bad_record={on_bad_record}: choose 'error' or 'skip'")
    path, image_root = Path(path), Path(image_root)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise LauncherError(f"{path}: cannot read the data file ({error.strerror or error})") from error
    except UnicodeDecodeError as error:
        raise LauncherError(
            f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
            "the data file must be JSON: a list of records, or one record per line"
        ) from None

    records, skipped = [], 0
    for index, line, raw in _parse(path, text, skip=on_bad_record == "skip"):
        where = f"{path}:{line} (record {index})" if line else f"{path} record {index}"
        if raw is None:  # malformed JSON line, skipped
            skipped += 1
            continue
        try:
            records.append(_check_record(raw, where, image_root))
        except LauncherError:
            if on_bad_record == "error":
                raise
            skipped += 1
    if not records:
        reason = f"all {skipped} records are bad and were skipped" if skipped else "it holds no records"
        raise LauncherError(f"{path}: empty data set ({reason})")
    return records, skipped


def _parse(path: Path, text: str, *, skip: bool) -> Iterable[tuple[int, int | None, Any]]:
    """Yield (record index, line number or None, parsed record or None when skipped as malformed)."""
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise LauncherError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from error
        yield from ((index, None, raw) for index, raw in enumerate(data))
        return
    _refuse_wrapped_records(path, text)
    index = 0
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            if not skip:
                raise LauncherError(f"{path}:{line_number}: malformed JSON in record {index} ({error.msg})") from error
            raw = None
        yield index, line_number, raw
        index += 1


def _refuse_wrapped_records(path: Path, text: str) -> None:
    """A file holding one JSON object that is not a record (`{"data": [...]}`) is neither format."""
    if not text.lstrip().startswith("{"):
        return
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return  # JSON lines: each line is parsed, and reported, on its own
    if isinstance(whole, dict) and "conversations" not in whole:
        keys = ", ".join(repr(key) for key in list(whole)[:5])
        raise LauncherError(
            f"{path}: the file is one JSON object (keys {keys}), not records: give a JSON list of records, "
            "or one record per line (JSON lines)"
        )


def _check_record(raw: Any, where: str, image_root: Path) -> dict:
    if not isinstance(raw, dict):
        raise LauncherError(f"{where}: a record must be an object with 'image' and 'conversations'")
    for key in ("image", "conversations"):
        if key not in raw:
            raise LauncherError(f"{where}: missing '{key}'")
    image = raw["image"]
    if not isinstance(image, str) or not image:
        raise LauncherError(f"{where}: 'image' must be a relative path")
    turns = raw["conversations"]
    if not isinstance(turns, list) or not turns:
        raise LauncherError(f"{where}: 'conversations' must be a non-empty list of turns")
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise LauncherError(f"{where}: every turn needs 'from' and a string 'value'")
        if turn.get("from") not in _ROLES:
            raise LauncherError(f"{where}: unknown speaker {turn.get('from')!r} (use human, gpt or system)")
    roles = [_ROLES[turn["from"]] for turn in turns]
    if "assistant" not in roles:
        raise LauncherError(f"{where}: no assistant ('gpt') turn to learn from")
    if "user" not in roles[: roles.index("assistant")]:
        raise LauncherError(f"{where}: the first assistant turn must follow a human turn")
    if any(IMAGE_PLACEHOLDER in t["value"] for t, role in zip(turns, roles, strict=True) if role != "user"):
        raise LauncherError(f"{where}: '{IMAGE_PLACEHOLDER}' must be in a human turn")
    placeholders = sum(turn["value"].count(IMAGE_PLACEHOLDER) for turn in turns)
    if placeholders > 1:
        raise LauncherError(f"{where}: '{IMAGE_PLACEHOLDER}' appears {placeholders} times; one image per record")
    try:
        image_path = (image_root / image).resolve()
        if image_path.is_dir():
            raise LauncherError(f"{where}: image {image_path} is a directory, not an image file")
        if not image_path.is_file():
            raise LauncherError(f"{where}: image file {image_path} does not exist")
    except (OSError, RuntimeError) as error:  # a symlink loop (RuntimeError before Python 3.13), a name too long
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise LauncherError(f"{where}: image path {image_root / image} cannot be read ({reason})") from None
    return {
        "id": str(raw.get("id", where)),
        "image": str(image_path),
        "conversations": [{"from": turn["from"], "value": turn["value"]} for turn in turns],
        "where": where,
    }


# ---------------------------------------------------------------------------------------------------
# Dataset


def to_chat_messages(conversations: list[dict]) -> list[dict]:
    """LLaVA turns -> chat-template messages with typed content.

    The image goes where "<image>" stands (or before the first human turn's text when there is no
    placeholder, as LLaVA does); the placeholder's surrounding newline is the template's business.
    """
    has_placeholder = any(IMAGE_PLACEHOLDER in turn["value"] for turn in conversations)
    messages, image_placed = [], False
    for turn in conversations:
        role = _ROLES[turn["from"]]
        content: list[dict] = []
        if role == "user" and not has_placeholder and not image_placed:
            content.append({"type": "image"})
            image_placed = True
        pieces = turn["value"].split(IMAGE_PLACEHOLDER)
        for number, piece in enumerate(pieces):
            if number:
                content.append({"type": "image"})
            if piece.strip():
                content.append({"type": "text", "text": piece.strip()})
        messages.append({"role": role, "content": content})
    return messages


class ConversationDataset(Dataset):
    """Records -> {"id", "image": RGB PIL image, "messages": chat messages}; images decode here, in workers."""

    def __init__(self, records: list[dict]):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict:
        record = self.records[index]
        try:
            with Image.open(record["image"]) as image:
                pixels = image.convert("RGB")
        except (OSError, ValueError, Image.DecompressionBombError) as error:
            raise LauncherError(f"{record['where']}: cannot decode image {record['image']} ({error})") from error
        return {"id": record["id"], "image": pixels, "messages": to_chat_messages(record["conversations"])}


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
    """

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        rendered = [render_with_assistant_spans(self.processor, sample["messages"]) for sample in samples]
        texts, spans = [text for text, _ in rendered], [spans for _, spans in rendered]
        batch = _encode(self.processor, texts, [s["image"] for s in samples], padding_side="right")
        offsets = batch.pop("offset_mapping")
        replacements = batch.pop("text_replacement_offsets")
        token_start, token_end = offsets[..., 0], offsets[..., 1]
        supervised = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for row, (row_spans, row_replacements) in enumerate(zip(spans, replacements, strict=True)):
            for start, end in _expanded_spans(row_spans, row_replacements):
                # Tokens overlapping the span; zero-width entries (padding, an added bos) never do.
                supervised[row] |= (token_start[row] < end) & (token_end[row] > start)
        batch["labels"] = batch["input_ids"].masked_fill(~supervised, IGNORE_INDEX)
        return dict(batch)


def _encode(processor, texts: list[str], images: list, *, padding_side: str):
    batch = processor(
        text=texts,
        images=images,
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


def _expanded_spans(spans: list[tuple[int, int]], replacements: list[dict]) -> list[tuple[int, int]]:
    """Move character spans of the rendered text to the text with image placeholders expanded."""
    placeholder_ends = [r["span"][1] for r in replacements]
    # Characters gained by all expansions up to and including the k-th placeholder.
    gained = [0] + [r["new_span"][1] - r["span"][1] for r in replacements]
    return [tuple(c + gained[bisect_right(placeholder_ends, c)] for c in span) for span in spans]


class PromptCollator:
    """Samples -> (left-padded prompt batch for `generate`, reference answers).

    The prompt is the conversation up to the last assistant turn plus the generation prompt; the
    reference is that turn's text.
    """

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, samples: list[dict]) -> tuple[dict[str, torch.Tensor], list[str]]:
        texts, answers = [], []
        for sample in samples:
            messages = sample["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            texts.append(_render(self.processor, messages[:last], add_generation_prompt=True))
            answers.append(" ".join(p["text"] for p in messages[last]["content"] if p["type"] == "text"))
        batch = self.processor(
            text=texts, images=[s["image"] for s in samples], padding=True, padding_side="left", return_tensors="pt"
        )
        return dict(batch), answers


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
        loader = DataLoader(dataset_or_loader, batch_size=batch_size, collate_fn=PromptCollator(processor))
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


def prepare_data(data: Any, cache: Path) -> tuple[Path, Path | None, Path]:
    """The train file, eval file and image root of the `data` config; the built-in set is generated first."""
    if data.synthetic:
        task = str(data.get("task") or "shape")  # a config saved before data.task existed asks "shape"
        out = cache / "data" / f"{data.name}_{task}_seed{data.seed}_n{data.n_train}_{data.n_eval}_px{data.image_size}"
        train_file, eval_file, image_root = generate_shapes(
            out, seed=data.seed, n_train=data.n_train, n_eval=data.n_eval, image_size=data.image_size, task=task
        )
        return Path(train_file), Path(eval_file), Path(image_root)
    if not data.path:
        raise LauncherError(f"data.path is not set for data={data.name}: give the training JSON file")
    train_file = Path(data.path).expanduser()
    if not train_file.is_file():
        raise LauncherError(f"data.path={data.path}: no such file")
    eval_file = Path(data.eval_path).expanduser() if data.eval_path else None
    if eval_file is not None and not eval_file.is_file():
        raise LauncherError(f"data.eval_path={data.eval_path}: no such file")
    image_root = Path(data.image_root).expanduser() if data.image_root else train_file.parent
    if not image_root.is_dir():
        raise LauncherError(f"data.image_root={image_root}: no such directory")
    return train_file, eval_file, image_root
