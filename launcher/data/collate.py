"""Samples into batches: each conversation rendered with the processor's own chat template and tokenized by
the processor (image tokens expanded), labels on the assistant's tokens only.

The same code serves tiny builds and real llava-1.5 / Qwen2-VL processors. `fit_records` finds, before
training, which records train as they are, cut to data.max_length, or not at all.
"""

from __future__ import annotations

import io
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from launcher.core.children import helper_process
from launcher.core.errors import LauncherError
from launcher.data.formats import BadRecordError
from launcher.data.length import IGNORE_INDEX, LengthLimit, RecordTooLong, fit_to_length, one_row, pad_rows, unchanged
from launcher.data.records import ConversationDataset
from launcher.data.video import VideoSampling, as_model_takes, frames_metadata


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
    pixel_values, and for Qwen2-VL image_grid_thw, mm_token_type_ids and a video's pixel_values_videos and
    video_grid_thw) plus `labels`. A sample's videos go in as the model takes them
    (launcher.data.video.as_model_takes). For tokens/s
    count non-pad tokens as `int(batch["attention_mask"].sum())`.

    `image_every_batch`: a batch without images gets a dummy one (see `add_dummy_image`), so that the
    vision tower runs on every batch: under ZeRO-3 with several ranks every rank must gather the same
    parameters in the same order, or the collectives wait forever. `video_every_batch`: likewise a dummy
    video, for a model that takes videos as videos (its tower runs once more for them).

    `limit` (data.max_length): a batch with a longer sample is made again from each sample cut alone
    (`fit_to_length`) and padded as `CachedCollator` pads, so it is the batch the data cache gives.
    Samples that cannot be cut are found before training (`fit_records`); meeting one here is an error.
    """

    def __init__(
        self,
        processor,
        *,
        image_every_batch: bool = False,
        video_every_batch: bool = False,
        limit: LengthLimit | None = None,
    ):
        self.processor = processor
        self.image_every_batch = image_every_batch
        self.video_every_batch = video_every_batch
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
        return add_dummy_media(
            self.processor, batch, "right", image=self.image_every_batch, video=self.video_every_batch
        )

    def labelled(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        """The processor's batch of the samples, whole, with `labels`."""
        samples = [as_model_takes(sample, self.processor) for sample in samples]
        rendered = [render_with_assistant_spans(self.processor, sample["messages"]) for sample in samples]
        texts, spans = [text for text, _ in rendered], [spans for _, spans in rendered]
        batch = _encode(self.processor, texts, samples, padding_side="right")
        offsets = batch.pop("offset_mapping")
        replacements = batch.pop("text_replacement_offsets")
        token_start, token_end = offsets[..., 0], offsets[..., 1]
        supervised = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for row, (row_spans, row_replacements) in enumerate(zip(spans, replacements, strict=True)):
            for start, end in _expanded_spans(row_spans, row_replacements):
                # Tokens overlapping the span; zero-width entries (padding, an added bos) never do.
                supervised[row] |= (token_start[row] < end) & (token_end[row] > start)
        batch["labels"] = batch["input_ids"].masked_fill(~supervised, IGNORE_INDEX)
        return batch


def _encode(processor, texts: list[str], samples: list[dict], *, padding_side: str, offsets: bool = True) -> dict:
    """The processor's batch of rendered texts with the samples' images, and their videos for a model that
    takes videos as videos (launcher.data.video.as_model_takes); with the token offsets and the text
    replacements made (`offsets`), which locate the assistant's tokens."""
    images = [sample["images"] for sample in samples]
    videos = [frames for sample in samples for frames in sample.get("videos", ())]
    asked = {"return_offsets_mapping": True, "return_text_replacement_offsets": True} if offsets else {}
    if videos:  # sampled already: the processor samples none, and knows each video's rate (`frames_metadata`)
        rates = [rate for sample in samples for rate in _video_fps(sample)]
        asked |= {"video_metadata": frames_metadata(videos, rates), "do_sample_frames": False}
    batch = processor(
        text=texts,
        images=images if any(images) else None,
        videos=videos or None,
        padding=True,
        padding_side=padding_side,
        return_tensors="pt",
        **asked,
    )
    if offsets and ("offset_mapping" not in batch or "text_replacement_offsets" not in batch):
        raise LauncherError(
            f"{type(processor).__name__} does not report token offsets (it needs a fast tokenizer), "
            "so assistant tokens cannot be labelled"
        )
    return dict(batch)


def _video_fps(sample: dict) -> list[float]:
    """The sample's videos' frames per second of video (ConversationDataset's "video_fps"); a sample made
    without (the guard's blank video) at data.video's default rate."""
    return sample.get("video_fps") or [VideoSampling().fps] * len(sample.get("videos", ()))


def add_dummy_media(
    processor, batch: dict[str, torch.Tensor], padding_side: str, *, image: bool, video: bool = False
) -> dict[str, torch.Tensor]:
    """The batch with a blank image added where it has none (`image`), and a blank video where it has none
    (`video`): the ZeRO-3 modality guard (see `add_dummy_image`)."""
    if image and "pixel_values" not in batch:
        batch = _with_blank(processor, batch, padding_side, video=False)
    if video and "pixel_values_videos" not in batch:
        batch = _with_blank(processor, batch, padding_side, video=True)
    return batch


def blank_media(processor, *, video: bool = False) -> dict[str, torch.Tensor]:
    """The processor's one-row batch of a blank 32 x 32 image alone, or of a blank video of two such frames."""
    blank = Image.new("RGB", (32, 32))
    if not video:
        return dict(processor(text=[processor.image_token], images=[blank], return_tensors="pt"))
    sample = {"images": [], "videos": [[blank, blank]]}
    return _encode(processor, [processor.video_token], [sample], padding_side="right", offsets=False)


def add_dummy_image(processor, batch: dict[str, torch.Tensor], *, padding_side: str) -> dict[str, torch.Tensor]:
    """The batch with a blank image's tokens added to row 0, where nothing sees them.

    The image's tokens go after the padding (right-padded batches) or before it (left-padded) with
    attention mask 0 and label IGNORE_INDEX: no real token attends to them, no loss is taken on them,
    so the loss, and every gradient, is what it was (the vision tower's gradient from them is zero),
    while the forward runs the vision tower as for any batch with images. A blank video goes in alike
    (`add_dummy_media`)."""
    return _with_blank(processor, batch, padding_side, video=False)


def _with_blank(processor, batch: dict[str, torch.Tensor], padding_side: str, *, video: bool) -> dict:
    dummy = blank_media(processor, video=video)
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
        if key not in batch:  # pixel_values, image_grid_thw (pixel_values_videos, video_grid_thw)
            out[key] = value
    return out


def _expanded_spans(spans: list[tuple[int, int]], replacements: list[dict]) -> list[tuple[int, int]]:
    """Move character spans of the rendered text to the text with image and video placeholders expanded."""
    placeholder_ends = [r["span"][1] for r in replacements]
    # Characters gained by all expansions up to and including the k-th placeholder.
    gained = [0] + [r["new_span"][1] - r["span"][1] for r in replacements]
    return [tuple(c + gained[bisect_right(placeholder_ends, c)] for c in span) for span in spans]


class PromptCollator:
    """Samples -> (left-padded prompt batch for `generate`, reference answers).

    The prompt is the conversation up to the last assistant turn plus the generation prompt; the
    reference is that turn's text. `image_every_batch` as for `Collator`.
    """

    def __init__(self, processor, *, image_every_batch: bool = False, video_every_batch: bool = False):
        self.processor = processor
        self.image_every_batch = image_every_batch
        self.video_every_batch = video_every_batch

    def __call__(self, samples: list[dict]) -> tuple[dict[str, torch.Tensor], list[str]]:
        texts, answers, prompts = [], [], []
        for sample in samples:
            sample = as_model_takes(sample, self.processor)
            messages = sample["messages"]
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            texts.append(_render(self.processor, messages[:last], add_generation_prompt=True))
            answers.append(" ".join(p["text"] for p in messages[last]["content"] if p["type"] == "text"))
            prompts.append(sample)
        batch = _encode(self.processor, texts, prompts, padding_side="left", offsets=False)
        guarded = add_dummy_media(
            self.processor, batch, "left", image=self.image_every_batch, video=self.video_every_batch
        )
        return guarded, answers


# Records estimated at least this far under the limit are not encoded before training (`fit_records`).
ESTIMATE_MARGIN = 8


@dataclass
class FitReport:
    """What data.max_length does to a list of records (`fit_records`)."""

    kept: list[int]  # positions of the records that train (as they are, or cut)
    cut: int  # how many of them are cut
    skipped: list[tuple[int, str]]  # (position, reason with the record's place) of those that do not


def fit_records(
    records: list[dict], processor, limit: LengthLimit, *, num_workers: int, video: VideoSampling | None = None
) -> FitReport:
    """Which records train as they are, cut, or not at all under `limit`: found before training when there
    is no data cache (building the cache finds them itself), so every rank drops the same records.

    Each record's length is estimated from its rendered text and its images' sizes (read from their
    headers, no pixels); only records estimated within ESTIMATE_MARGIN of the limit or over it are
    encoded (images decoded; videos' frames sampled as `video` says) and cut as `Collator` cuts them. In
    `num_workers` processes."""
    if limit.max_length is None:
        return FitReport(list(range(len(records))), 0, [])
    loader = DataLoader(
        _Fitted(records, processor, limit, video or VideoSampling()),
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=8 if num_workers else None,
        collate_fn=unchanged,
        generator=torch.Generator(),  # not the global one: building the data must not move the random state
        worker_init_fn=helper_process,
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

    def __init__(self, records: list[dict], processor, limit: LengthLimit, video: VideoSampling):
        self.records, self.processor, self.limit, self.video = records, processor, limit, video

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
            sample = ConversationDataset(self.records, self.video)[index]
            row = one_row(Collator(self.processor).labelled([sample]))
            return index, fit_to_length(row, self.limit, self.processor)[1]
        except RecordTooLong as error:
            return index, RecordTooLong(f"{record['where']}: {error}")
        except BadRecordError as error:
            return index, error


def estimated_length(processor, record: dict) -> int | None:
    """A record's tokens as the processor makes them, from its rendered text and its images' sizes (their
    headers): the text's tokens, each image placeholder counted as the tokens its image takes. None when
    the processor cannot say how many tokens an image of a given size takes, or the record has videos (their
    frames' sizes are known once decoded)."""
    if record.get("videos"):
        return None
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
