"""Records as people have them, read into one form: LLaVA, ShareGPT and OpenAI-style messages.

Files: JSON (a list of records), JSON lines, and Hugging Face `datasets` data (parquet, arrow,
`save_to_disk` folders, hub ids) read through the `datasets` library. Formats, detected per file from
its first record (`data.format=auto`) or named:

    llava     {"image": "a.png" | ["a.png", "b.png"], "conversations": [{"from": "human", "value": "<image>\\n..."},
                                                                        {"from": "gpt", "value": "..."}]}
              (LLaVA-Video: "video": "a.mp4" | [...], "<video>" markers)
    sharegpt  {"images": ["a.png"], "videos": ["a.mp4"], "system": "...",
               "messages": [{"role": "user", "content": "<image><video>..."}, {"role": "assistant", "content": "..."}]}
    messages  {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                         {"type": "video", "video": "a.mp4"},
                                                         {"type": "text", "text": "..."}]}, ...]}
              also LLaMA-Factory's v1 files: parts {"type": "image_url" | "video_url" | "text", "value": ...}

Preference records (a prompt, a "chosen" and a "rejected" answer: LLaMA-Factory's and TRL's layouts, read
under a preference loss, `ReadOptions.pairs`) become two adjacent records each (`pair_records`).

Every record becomes {"id", "where", "file", "index", "images": [absolute path | bytes], "messages":
[{"role", "content": [{"type": "image"} | {"type": "video"} | {"type": "text", "text"}]}]}: chat-template
messages whose image parts take `images` in order ("file" and "index" say where it came from); a record
with videos also holds "videos" (paths or bytes, in the order of its video parts). A record without images
trains as text. In llava and sharegpt records each "<image>" ("<video>") marks where the next image
(video) goes; with no marker at all the images, then the videos, go before the first user text (as LLaVA
does). Roles human/user, gpt/assistant and system map to user, assistant and system.

Images are checked when read (a bad one is a bad record): the path must stay inside the image root,
name a non-empty file that PIL identifies as an image, of at most `max_image_pixels` pixels; with
`decode=True` the whole image is decoded too (a truncated file fails only then). Videos likewise: inside
the image root, a container PyAV opens with a video stream it can decode, with frames, at most
data.video.max_seconds long (launcher/data/video.py); with `decode=True` their sampled frames are decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
import stat
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from launcher.core.errors import LauncherError
from launcher.data.video import VIDEO_PLACEHOLDER, BadVideoError, VideoSampling, check_video, decode_frames

IMAGE_PLACEHOLDER = "<image>"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# Files the `datasets` library reads (anything else that is a file is JSON or JSON lines).
DATASET_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000  # 8000 x 8000: larger is treated as a decompression bomb


class BadRecordError(LauncherError):
    """A record that cannot train; skipped and counted under data.on_bad_record=skip."""


@dataclass(frozen=True)
class ReadOptions:
    """How records of one source are read."""

    format: str = "auto"
    image_root: Path | None = None  # relative image paths resolve against it (default: the file's folder)
    on_bad_record: str = "error"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    # How videos are sampled (data.video): its max_seconds is checked when read; its frames with `decode`.
    video: VideoSampling = field(default_factory=VideoSampling)
    decode: bool = False  # decode every image fully while reading (finds truncated files)
    # Open each image's header (format, pixel limit). Off for the built-in set, whose images this
    # project wrote itself (atomically): 0.4 s of every read of its 4200 images, for nothing.
    check_headers: bool = True
    split: str = "train"  # the split of a `datasets` folder or hub id
    cache_dir: Path | None = None  # where `datasets` keeps its Arrow files
    # Preference records (data.pairs): each becomes two adjacent records, its chosen conversation and its
    # rejected one (`pair_records`).
    pairs: bool = False


def read_records(
    path: str | Path, options: ReadOptions, skip_log: list[dict] | None = None
) -> tuple[list[dict], int, str]:
    """Read and check the records of one file, folder or hub id; return (records, skipped, format).

    on_bad_record="error" raises at the first bad record, naming the file, the record and the fix;
    "skip" skips and counts bad records, and appends each to `skip_log` (when given) as
    {"file", "record", "reason"}: reason is the line "error" would have stopped with. An empty result is
    an error either way. Each record keeps its "file" and "index" (its position in the file).
    """
    if options.on_bad_record not in ("error", "skip"):
        raise LauncherError(f"data.on_bad_record={options.on_bad_record}: choose 'error' or 'skip'")
    if options.format not in ("auto", *FORMATS):
        raise LauncherError(f"data.format={options.format}: choose auto, {', '.join(FORMATS)}")
    source = str(path)
    local = Path(source).expanduser()
    if not local.exists() and not looks_like_hub_id(source):
        raise LauncherError(f"{source}: cannot read the data file (no such file or folder, nor a hub id org/name)")
    image_root = Path(options.image_root or (local if local.is_dir() else local.parent)).expanduser()
    image_root = Path(os.path.abspath(image_root))
    skip = options.on_bad_record == "skip"
    rows = _read_rows(source, options, skip=skip)

    records, skipped, fmt = [], 0, None if options.format == "auto" else options.format
    for index, (where, raw) in enumerate(rows):
        try:
            if isinstance(raw, BadRecordError):  # a malformed JSON line, met under skip
                raise raw
            if options.pairs:
                chosen, rejected = pair_records(raw, where, options.format, image_root, options)
                fmt = fmt or chosen.pop("format")
                records += [{**chosen, "file": source, "index": index}, {**rejected, "file": source, "index": index}]
                continue
            if fmt is None:
                fmt = detect_format(raw, where)
            records.append({**normalize(raw, fmt, where, image_root, options), "file": source, "index": index})
        except BadRecordError as error:
            if not skip:
                raise
            skipped += 1
            if skip_log is not None:
                skip_log.append(skipped_entry(source, index, error))
    if not records:
        reason = f"all {skipped} records are bad and were skipped" if skipped else "it holds no records"
        raise LauncherError(f"{source}: empty data set ({reason})")
    return records, skipped, str(fmt)


def skipped_entry(file: str, index: int, error: BaseException | str, **extra: Any) -> dict[str, Any]:
    """One line of RUN/skipped_records.jsonl: the file, the record's position in it, and why."""
    return {"file": str(file), "record": int(index), **extra, "reason": str(error)}


@dataclass
class SkipTally:
    """Records left out (bad, or over data.max_length) and cut: the summary's counts and the lines of
    RUN/skipped_records.jsonl. `on_change(tally, new_entries)`, when set, hears of each change as it
    happens (a stream meets its bad records while training)."""

    bad: int = 0
    too_long: int = 0
    truncated: int = 0
    entries: list[dict[str, Any]] = field(default_factory=list)
    on_change: Callable[[SkipTally, list[dict[str, Any]]], None] | None = None
    _reported: tuple[int, int, int, int] = (0, 0, 0, 0)  # the counts on_change last heard of

    def add(self, entry: dict[str, Any], *, too_long: bool) -> None:
        if too_long:
            self.too_long += 1
        else:
            self.bad += 1
        self.entries.append(entry)

    def merge(self, other: SkipTally) -> None:
        """Count `other`'s records too (one split's, into the run's)."""
        self.bad += other.bad
        self.too_long += other.too_long
        self.truncated += other.truncated
        self.entries += other.entries

    def watch(self, on_change: Callable[[SkipTally, list[dict[str, Any]]], None]) -> None:
        """From now on `on_change` hears of every change (not of what the tally holds already)."""
        self.on_change = on_change
        self._reported = (self.bad, self.too_long, self.truncated, len(self.entries))

    def changed(self) -> None:
        now = (self.bad, self.too_long, self.truncated, len(self.entries))
        if self.on_change is not None and now != self._reported:
            new = self.entries[self._reported[3] :]
            self._reported = now
            self.on_change(self, new)


# ----------------------------------------------------------------------------- reading rows
def _read_rows(source: str, options: ReadOptions, *, skip: bool) -> Iterator[tuple[str, Any]]:
    local = Path(source).expanduser()
    if local.is_dir() or local.suffix in DATASET_SUFFIXES or not local.exists():
        return _dataset_rows(source, options)
    return _json_rows(local, skip=skip)


def _json_rows(path: Path, *, skip: bool) -> Iterator[tuple[str, Any]]:
    """(where, parsed record, or the BadRecordError of a malformed line under skip) of a JSON list or
    JSON lines file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise LauncherError(f"{path}: cannot read the data file ({error.strerror or error})") from error
    except UnicodeDecodeError as error:
        raise LauncherError(
            f"{path}: not UTF-8 text (byte {error.object[error.start]:#04x} at offset {error.start}); "
            "the data file must be JSON: a list of records, or one record per line"
        ) from None
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise LauncherError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from error
        return ((f"{path} record {index}", raw) for index, raw in enumerate(data))
    _refuse_wrapped_records(path, text)
    return _json_lines(path, text, skip=skip)


def _json_lines(path: Path, text: str, *, skip: bool) -> Iterator[tuple[str, Any]]:
    index = 0
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number} (record {index})"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            malformed = BadRecordError(f"{path}:{line_number}: malformed JSON in record {index} ({error.msg})")
            if not skip:
                raise malformed from error
            raw = malformed  # read_records skips and logs it
        yield where, raw
        index += 1


def _refuse_wrapped_records(path: Path, text: str) -> None:
    """A file holding one JSON object that is not a record (`{"data": [...]}`) is neither format."""
    if not text.lstrip().startswith("{"):
        return
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return  # JSON lines: each line is parsed, and reported, on its own
    if isinstance(whole, dict) and not {"conversations", "messages"} & set(whole):
        keys = ", ".join(repr(key) for key in list(whole)[:5])
        raise LauncherError(
            f"{path}: the file is one JSON object (keys {keys}), not records: give a JSON list of records, "
            "or one record per line (JSON lines)"
        )


def _dataset_rows(source: str, options: ReadOptions) -> Iterator[tuple[str, Any]]:
    """Rows of a parquet or arrow file, a `save_to_disk` folder or a hub id, through `datasets`.

    Image columns are read undecoded ({"bytes", "path"}): images are checked, and decoded, like files."""
    try:
        import datasets
    except ImportError as error:  # a dependency; only a broken install lacks it
        raise LauncherError(f"{source}: reading it needs the `datasets` library (pip install datasets)") from error
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    local = Path(source).expanduser()
    if local.is_dir() and not any((local / name).is_file() for name in ("state.json", "dataset_dict.json")):
        raise LauncherError(
            f"{source} is a folder, but not one `datasets` saved (no state.json or dataset_dict.json): give a data "
            "file (JSON, JSON lines, parquet, arrow) or a folder written by save_to_disk"
        )
    cache_dir = str(options.cache_dir) if options.cache_dir else None
    try:
        if local.suffix in DATASET_SUFFIXES and local.is_file():
            data = datasets.load_dataset(
                DATASET_SUFFIXES[local.suffix], data_files=str(local), split="train", cache_dir=cache_dir
            )
        elif local.is_dir():
            data = datasets.load_from_disk(str(local))
        else:
            data = datasets.load_dataset(source, split=options.split, cache_dir=cache_dir)
    except FileNotFoundError as error:
        raise LauncherError(f"{source}: no such file, folder or reachable hub data set ({error})") from None
    except (OSError, ValueError, datasets.exceptions.DatasetsError) as error:
        raise LauncherError(f"{source}: `datasets` cannot read it ({type(error).__name__}: {error})") from None
    if isinstance(data, datasets.DatasetDict):
        if options.split not in data:
            raise LauncherError(f"{source}: no split {options.split!r} (data.split); it has {', '.join(data)}")
        data = data[options.split]
    for name, feature in data.features.items():  # keep images and videos as bytes/paths, decoded where checked
        for kind in (datasets.Image, datasets.Video):
            if isinstance(feature, kind):
                data = data.cast_column(name, kind(decode=False))
            elif isinstance(getattr(feature, "feature", None), kind):
                data = data.cast_column(name, datasets.List(kind(decode=False)))
    return ((f"{source} row {index}", row) for index, row in enumerate(data))


def looks_like_hub_id(path: str) -> bool:
    """Whether `datasets` should look `path` up on the hub ("org/name"). Not when offline
    (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), nor when "org" is a local folder or the name ends like a data
    file: a mistyped local path must be "no such file", not a wait on the network."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    parts = path.split("/")
    if len(parts) != 2 or not re.fullmatch(r"[\w.-]+/[\w.-]+", path) or path.startswith((".", "~")):
        return False
    data_file = Path(path).suffix.lower() in {".json", ".jsonl", *DATASET_SUFFIXES}
    return not data_file and not Path(parts[0]).is_dir()


# ----------------------------------------------------------------------------- preference pairs
REJECTED_SUFFIX = "#rejected"  # a pair's rejected record's id: its chosen record's id and this
V1_PAIR = ("chosen_messages", "rejected_messages")  # LLaMA-Factory v1: each side a whole conversation


def pair_records(raw: Any, where: str, fmt: str, image_root: Path, options: ReadOptions) -> tuple[dict, dict]:
    """A preference record -> (its chosen record, its rejected record): the common records of the prompt
    followed by each answer. The chosen one also holds "format", the format its conversation was read as.

        LLaMA-Factory  {"conversations" | "messages": [...the prompt's turns], "images": [...],
                        "chosen": {"from": "gpt", "value": ...} | {"role": "assistant", "content": ...} | "...",
                        "rejected": the same}
        TRL            {"prompt": "..." | [messages], "chosen": "..." | [messages], "rejected": the same,
                        "images": [...]}
        LLaMA-Factory v1  {"chosen_messages": [the whole conversation, its parts {"type": ..., "value": ...}],
                           "rejected_messages": the same}

    Text-only records (no images) and several images per record read as in the other formats."""
    if not isinstance(raw, dict):
        raise BadRecordError(f"{where}: a record must be a JSON object, not {type(raw).__name__}")
    keys = V1_PAIR if any(key in raw for key in V1_PAIR) else ("chosen", "rejected")
    for key in keys:
        if raw.get(key) in (None, "", []):
            raise BadRecordError(
                f"{where}: a preference record needs a '{keys[0]}' and a '{keys[1]}' answer (loss={{dpo,ipo}}); "
                f"this one has no '{key}': give both, or train it with loss=sft"
            )
    conversations = []
    for key in keys:
        if keys == V1_PAIR:
            conversation = {**{k: v for k, v in raw.items() if k not in V1_PAIR}, "messages": raw[key]}
        else:
            conversation = _with_answer(raw, raw[key], where)
        if fmt == "auto":
            fmt = detect_format(conversation, where)
        conversations.append(normalize(conversation, fmt, where, image_root, options))
    chosen, rejected = conversations
    if chosen["messages"] == rejected["messages"]:
        raise BadRecordError(f"{where}: its chosen and rejected answers are the same: nothing to prefer; fix it")
    rejected["id"] += REJECTED_SUFFIX
    return {**chosen, "format": fmt}, rejected


def _with_answer(raw: dict, answer: Any, where: str) -> dict:
    """The record's prompt followed by one answer, as a record of the format its prompt is written in."""
    record = {key: value for key, value in raw.items() if key not in ("chosen", "rejected", "prompt")}
    if "prompt" in raw:  # TRL: a string, or a list of messages; an answer likewise
        prompt = raw["prompt"]
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(turns, list):
            raise BadRecordError(f"{where}: 'prompt' must be a string or a list of messages")
        answers = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else answer
        answers = [answers] if isinstance(answers, dict) else answers
        return {**record, "messages": [*turns, *answers]}
    key = "conversations" if "conversations" in raw else "messages"
    turns = raw.get(key)
    if not isinstance(turns, list):
        raise BadRecordError(
            f"{where}: a preference record needs its prompt: 'conversations' or 'messages' (LLaMA-Factory) or "
            "'prompt' (TRL)"
        )
    if isinstance(answer, str):
        turn = {"from": "gpt", "value": answer}
        answer = turn if key == "conversations" else {"role": "assistant", "content": answer}
    if not isinstance(answer, dict):
        raise BadRecordError(f"{where}: 'chosen' and 'rejected' must each be one turn or a string")
    return {**record, key: [*turns, answer]}


# ----------------------------------------------------------------------------- formats
def refuse_pair(raw: dict, where: str) -> None:
    """A preference record read for a supervised loss: one line naming the loss that trains it."""
    if any(key in raw for key in ("chosen", "rejected", *V1_PAIR)):
        raise BadRecordError(
            f"{where}: a preference record ('chosen'/'rejected' answers): train it with a preference loss "
            "(loss=dpo or loss=ipo)"
        )


def detect_format(raw: Any, where: str) -> str:
    """The format of a file, from its first record: the one format (FORMATS) that recognises it."""
    if isinstance(raw, dict):
        refuse_pair(raw, where)
        for fmt in FORMATS.values():
            if fmt.recognises(raw):
                return fmt.name
    keys = ", ".join(repr(k) for k in list(raw)[:6]) if isinstance(raw, dict) else type(raw).__name__
    by_key: dict[str, list[str]] = {}
    for fmt in FORMATS.values():
        by_key.setdefault(fmt.key, []).append(fmt.name)
    needs = " or ".join(f"'{key}' ({', '.join(names)})" for key, names in by_key.items())
    raise BadRecordError(
        f"{where}: not a record of a known format (found {keys}): a record needs {needs}; set data.format to say which"
    )


def normalize(raw: Any, fmt: str, where: str, image_root: Path, options: ReadOptions) -> dict:
    """One record of format `fmt` -> the common record (see the module docstring); BadRecordError if unusable."""
    if not isinstance(raw, dict):
        raise BadRecordError(f"{where}: a record must be a JSON object, not {type(raw).__name__}")
    if not options.pairs:
        refuse_pair(raw, where)
    messages, sources, video_sources = FORMATS[fmt].read(raw, where)
    _check_conversation(messages, where, fmt)
    images = [check_image(source, where, image_root, options) for source in sources]
    videos = [check_video_source(source, where, image_root, options) for source in video_sources]
    record_id = raw.get("id")
    record_id = where if record_id is None else str(record_id)
    record = {"id": record_id, "where": where, "images": images, "messages": messages}
    if videos:  # only then: an image-only record is what it was before videos were read
        record["videos"] = videos
    return record


def _has_typed_content(raw: dict) -> bool:
    messages = raw.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages
    )


def _image_list(raw: dict, where: str, *keys: str, kind: str = "image") -> list[Any]:
    """The record's images (or videos) under the first of `keys` present: one source or a list of them."""
    for key in keys:
        value = raw.get(key)
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str | dict | bytes) for v in values):
            raise BadRecordError(f"{where}: '{key}' must be a {kind} path or a list of {kind} paths")
        return values
    return []


def _video_list(raw: dict, where: str, *keys: str) -> list[Any]:
    return _image_list(raw, where, *keys, kind="video")


def _llava(raw: dict, where: str) -> tuple[list[dict], list[Any], list[Any]]:
    turns = raw.get("conversations")
    if not isinstance(turns, list) or not turns:
        raise BadRecordError(f"{where}: 'conversations' must be a non-empty list of turns (llava format)")
    texts = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise BadRecordError(f"{where}: every turn needs 'from' and a string 'value' (llava format)")
        texts.append((_role(turn.get("from"), where, "from"), turn["value"]))
    images = _image_list(raw, where, "image", "images")
    videos = _video_list(raw, where, "video", "videos")
    return _place_images(texts, len(images), where, videos=len(videos)), images, videos


def _sharegpt(raw: dict, where: str) -> tuple[list[dict], list[Any], list[Any]]:
    turns = raw.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRecordError(f"{where}: 'messages' must be a non-empty list (sharegpt format)")
    texts = []
    if isinstance(raw.get("system"), str) and raw["system"].strip():
        texts.append(("system", raw["system"]))
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            raise BadRecordError(f"{where}: every message needs 'role' and a string 'content' (sharegpt format)")
        texts.append((_role(turn.get("role"), where, "role"), turn["content"]))
    images = _image_list(raw, where, "images", "image")
    videos = _video_list(raw, where, "videos", "video")
    return _place_images(texts, len(images), where, videos=len(videos)), images, videos


def _typed_messages(raw: dict, where: str) -> tuple[list[dict], list[Any], list[Any]]:
    turns = raw.get("messages")
    if not isinstance(turns, list) or not turns:
        raise BadRecordError(f"{where}: 'messages' must be a non-empty list (messages format)")
    # For image (video) parts that name no file.
    listed = {
        "image": iter(_image_list(raw, where, "images", "image")),
        "video": iter(_video_list(raw, where, "videos", "video")),
    }
    found: dict[str, list[Any]] = {"image": [], "video": []}
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadRecordError(f"{where}: every message must be an object with 'role' and 'content'")
        role, content = _role(turn.get("role"), where, "role"), turn.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise BadRecordError(f"{where}: a message's 'content' must be a string or a list of parts")
        parts: list[dict] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            text = _part_text(part) if kind == "text" else None
            if text is not None:
                for marker, marked in _MARKER_KINDS.items():
                    if marker in text:
                        raise BadRecordError(
                            f"{where}: '{marker}' in a text part; with typed content give each {marked} as "
                            f"{'an' if marked == 'image' else 'a'} {marked} part ({{'type': '{marked}', ...}})"
                        )
                if text.strip():  # an answer as written; a prompt's text without the spaces around it
                    parts.append({"type": "text", "text": text if role == "assistant" else text.strip()})
            elif kind in ("image", "image_url", "video", "video_url"):
                media = kind.removesuffix("_url")
                source = _part_image(part, media)
                if source is None:  # the next of the record's list
                    source = next(listed[media], None)
                    if source is None:
                        raise BadRecordError(f"{where}: more {media} parts than {media}s in '{media}s'")
                parts.append({"type": media})
                found[media].append(source)
            elif kind in ("audio", "audio_url", "input_audio"):
                raise BadRecordError(f"{where}: a {kind} part: only text, image and video parts train here")
            else:
                raise BadRecordError(
                    f"{where}: content part {part!r:.60} is not {{'type': 'text', 'text': ...}}, an image or a video "
                    "part"
                )
        messages.append({"role": role, "content": parts})
    for media, left in listed.items():
        if next(left, None) is not None:
            raise BadRecordError(f"{where}: '{media}s' lists more {media}s than the messages have {media} parts")
    return messages, found["image"], found["video"]


def _chat(raw: dict, where: str) -> tuple[list[dict], list[Any], list[Any]]:
    """sharegpt and messages records alike: string contents with "<image>" markers are sharegpt's way, typed
    parts (a string content among them is one text part) the messages format's; one file may mix both."""
    return _typed_messages(raw, where) if _has_typed_content(raw) else _sharegpt(raw, where)


@dataclass(frozen=True)
class Format:
    """One record format: the key its records hold, how its first record is recognised (no two formats
    recognise one record), and how a record becomes chat messages, image sources and video sources."""

    name: str
    key: str
    recognises: Callable[[dict], bool]
    read: Callable[[dict, str], tuple[list[dict], list[Any], list[Any]]]


# Every format the launcher reads, by the name data.format gives it (config.schema.DataFormat lists the same
# names; a test keeps them equal): a new format is one entry here.
FORMATS: dict[str, Format] = {
    fmt.name: fmt
    for fmt in (
        Format("llava", "conversations", lambda raw: "conversations" in raw, _llava),
        Format("sharegpt", "messages", lambda raw: _has_messages(raw) and not _has_typed_content(raw), _chat),
        Format("messages", "messages", lambda raw: _has_messages(raw) and _has_typed_content(raw), _chat),
    )
}


def _has_messages(raw: dict) -> bool:
    return isinstance(raw.get("messages"), list)


def _part_text(part: dict) -> str | None:
    """A text part's text: {"text": ...} (OpenAI, transformers' chat templates) or {"value": ...}
    (LLaMA-Factory's v1 data files)."""
    for key in ("text", "value"):
        if isinstance(part.get(key), str):
            return part[key]
    return None


def _part_image(part: dict, kind: str = "image") -> Any:
    """The image (video) a content part names itself, or None: {"image": src} ({"video": src}), {"path"},
    {"url"}, {"value"} (LLaMA-Factory's v1 files), {"image_url": ...} ({"video_url": ...})."""
    for key in (kind, "path", "url", "value"):
        if isinstance(part.get(key), str | bytes | dict):
            return part[key]
    url = part.get(f"{kind}_url")
    if isinstance(url, dict):
        url = url.get("url")
    return url if isinstance(url, str) else None


def _role(name: Any, where: str, key: str) -> str:
    if not isinstance(name, str) or name not in ROLES:
        raise BadRecordError(f"{where}: unknown {key} {name!r} (use one of {', '.join(ROLES)})")
    return ROLES[name]


_MARKER_KINDS = {IMAGE_PLACEHOLDER: "image", VIDEO_PLACEHOLDER: "video"}
_MARKERS = re.compile("(" + "|".join(re.escape(marker) for marker in _MARKER_KINDS) + ")")


def _place_images(turns: list[tuple[str, str]], count: int, where: str, *, videos: int = 0) -> list[dict]:
    """Text turns with "<image>" and "<video>" markers -> typed messages, an image (video) part per marker
    (or, where a record has no marker at all, its images then its videos before the first user text)."""
    given = {"image": count, "video": videos}
    marked = {kind: sum(text.count(marker) for _, text in turns) for marker, kind in _MARKER_KINDS.items()}
    for kind in given:
        if any(marked.values()) and marked[kind] != given[kind]:
            raise BadRecordError(
                f"{where}: {marked[kind]} '<{kind}>' marker(s) but {given[kind]} {kind}(s): give one marker per "
                f"{kind} (or no marker at all, to put every image and video before the first question)"
            )
    messages, placed = [], any(marked.values())
    for role, text in turns:
        content: list[dict] = []
        if role == "user" and not placed:
            content += [{"type": "image"}] * count + [{"type": "video"}] * videos
            placed = True
        for piece in _MARKERS.split(text):
            if piece in _MARKER_KINDS:
                content.append({"type": _MARKER_KINDS[piece]})
            elif piece.strip():  # an answer as written (code keeps its indentation); a prompt's text stripped
                content.append({"type": "text", "text": piece if role == "assistant" else piece.strip()})
        messages.append({"role": role, "content": content})
    return messages


def _check_conversation(messages: list[dict], where: str, fmt: str) -> None:
    roles = [m["role"] for m in messages]
    if "assistant" not in roles:
        raise BadRecordError(f"{where}: no assistant turn to learn from ({fmt} format)")
    if "user" not in roles[: roles.index("assistant")]:
        raise BadRecordError(f"{where}: the first assistant turn must follow a user turn")
    if "system" in roles[1:]:
        raise BadRecordError(f"{where}: a system turn may only come first")
    for number, message in enumerate(messages, start=1):
        media = sorted({p["type"] for p in message["content"]} & {"image", "video"})
        if message["role"] != "user" and media:
            raise BadRecordError(f"{where}: {media[0]}s may only be in user turns, not in a {message['role']} turn")
        if message["role"] == "assistant" and not message["content"]:
            raise BadRecordError(
                f"{where}: turn {number} is an empty answer (no text, or only spaces): nothing to learn; "
                "give the answer or drop the turn"
            )


def record_texts(record: dict) -> list[str]:
    """Each turn's text with "<image>" ("<video>") where its images (videos) go (a tiny model's tokenizer
    learns from these)."""
    marker = {kind: text for text, kind in _MARKER_KINDS.items()}
    return [
        "\n".join(marker[p["type"]] if p["type"] in marker else p["text"] for p in message["content"])
        for message in record["messages"]
    ]


# ----------------------------------------------------------------------------- images
def check_image(source: Any, where: str, image_root: Path, options: ReadOptions) -> str | bytes:
    """An image reference -> an absolute path, or the image's bytes; BadRecordError when it cannot train."""
    data: bytes | None = None
    if isinstance(source, dict):  # a `datasets` Image column read undecoded
        data, source = source.get("bytes"), source.get("path")
    elif isinstance(source, bytes):
        data, source = source, None
    elif isinstance(source, str) and source.startswith("data:"):
        try:
            data = base64.b64decode(source.split(",", 1)[1], validate=True)
        except (IndexError, ValueError, binascii.Error):
            raise BadRecordError(f"{where}: image data URL is not valid base64") from None
    if data is not None:
        _check_pixels(io.BytesIO(data), "embedded image", where, options)
        return data
    if not isinstance(source, str) or not source:
        raise BadRecordError(f"{where}: an image must be a path (relative to data.image_root) or embedded bytes")
    if source.startswith(("http://", "https://")):
        raise BadRecordError(f"{where}: image {source} is a URL; images are not downloaded: fetch them, give paths")
    path = _inside_root(source.removeprefix("file://"), image_root, where)
    try:
        info = path.stat()
    except FileNotFoundError:
        raise BadRecordError(f"{where}: image file {path} does not exist") from None
    except (OSError, ValueError) as error:  # a symlink loop, a name too long, no permission, a NUL byte
        reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        raise BadRecordError(f"{where}: image path {path} cannot be read ({reason})") from None
    if stat.S_ISDIR(info.st_mode):
        raise BadRecordError(f"{where}: image {path} is a directory, not an image file")
    if info.st_size == 0:
        raise BadRecordError(f"{where}: image file {path} is empty (0 bytes)")
    if options.check_headers or options.decode:
        _check_pixels(path, f"image file {path}", where, options)
    return str(path)


def check_video_source(source: Any, where: str, image_root: Path, options: ReadOptions) -> str | bytes:
    """A video reference -> an absolute path, or the video's bytes; BadRecordError when it cannot train
    (launcher.data.video.check_video; with options.decode, its sampled frames decoded too)."""
    if isinstance(source, dict):  # a `datasets` Video column read undecoded
        source = source.get("bytes") or source.get("path")
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        raise BadRecordError(f"{where}: video {source} is a URL; videos are not downloaded: fetch them, give paths")
    if isinstance(source, str) and source:
        source = str(_inside_root(source.removeprefix("file://"), image_root, where, kind="video"))
    elif not isinstance(source, bytes):
        raise BadRecordError(f"{where}: a video must be a path (relative to data.image_root) or embedded bytes")
    try:
        if options.check_headers or options.decode:
            check_video(source, options.video)
        elif isinstance(source, str) and not Path(source).is_file():
            raise BadVideoError(f"video {source} does not exist")
        if options.decode:
            decode_frames(source, options.video)
    except BadVideoError as error:
        raise BadRecordError(f"{where}: {error}") from None
    return source


def _inside_root(name: str, image_root: Path, where: str, kind: str = "image") -> Path:
    """The path `name` names under the root, refused when it leaves the root ("../", an absolute path
    elsewhere). Checked on the path as written: a symlinked image folder inside the root is fine."""
    path = Path(os.path.normpath(image_root / name))
    if path != image_root and image_root not in path.parents:
        raise BadRecordError(
            f"{where}: {kind} path {name!r} leaves the image root {image_root}: give paths inside data.image_root "
            f"(or set data.image_root to a folder that holds the {kind}s)"
        )
    return path


def _check_pixels(file: Path | io.BytesIO, what: str, where: str, options: ReadOptions) -> None:
    """PIL identifies the image from its header; the size is checked before any pixel is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(file) as image:
                width, height = image.size
                if width * height > options.max_image_pixels:
                    raise BadRecordError(
                        f"{where}: {what} is {width}x{height} = {width * height} pixels, over "
                        f"data.max_image_pixels={options.max_image_pixels} (a decompression bomb?); "
                        "shrink it or raise the limit"
                    )
                if options.decode:
                    image.load()
    except Image.DecompressionBombError as error:
        raise BadRecordError(f"{where}: {what} is too large to open ({error}); shrink it") from None
    except (OSError, ValueError, SyntaxError) as error:  # UnidentifiedImageError is an OSError
        raise BadRecordError(f"{where}: {what} cannot be decoded as an image ({error})") from None


def open_image(image: str | bytes, where: str) -> Image.Image:
    """Decode a record's image to RGB (paths and bytes alike); BadRecordError naming the record otherwise."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as opened:
                return opened.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        what = "embedded image" if isinstance(image, bytes) else f"image {image}"
        fix = "fix or remove it, or set data.on_bad_record=skip"
        raise BadRecordError(f"{where}: cannot decode {what} ({error}); {fix}") from error
