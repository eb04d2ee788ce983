"""launcher.data.length: a sample over data.max_length is cut on its answer side (the prompt and each kept
image whole) or skipped saying why; samples are padded into a batch as the processor pads them."""

from __future__ import annotations

import pytest
import torch

from launcher.data.collate import Collator
from launcher.data.length import (
    IGNORE_INDEX,
    MIN_ANSWER_TOKENS,
    LengthLimit,
    RecordTooLong,
    fit_to_length,
    one_row,
    pad_rows,
)
from launcher.data.records import ConversationDataset
from tests.helpers import compose_typed
from tests.unit.data.samples import long_records


def test_the_limit_is_read_from_the_typed_data_config():
    assert LengthLimit.of(compose_typed(["data=llava_json"]).data) == LengthLimit(2048, "truncate")
    assert LengthLimit.of(compose_typed(["data.max_length=64", "data.truncation=skip"]).data) == LengthLimit(64, "skip")
    assert LengthLimit.of(compose_typed(["data=shapes"]).data) == LengthLimit(None, "truncate")


def test_a_long_answer_is_cut_keeping_the_prompt_and_each_kept_image_whole(tmp_path, model_and_processor):
    model, processor = model_and_processor
    dataset = ConversationDataset(long_records(tmp_path))
    samples = [dataset[index] for index in range(3)]
    whole = [Collator(processor)([sample]) for sample in samples]
    batch = Collator(processor, limit=LengthLimit(64))(samples)
    image = processor.image_token_id
    one_image = int((whole[0]["input_ids"] == image).sum())
    assert batch["input_ids"].shape[1] == 64 and int((whole[2]["input_ids"] == image).sum()) > one_image
    for row, full in enumerate(whole):
        kept = int(batch["attention_mask"][row].sum())
        answer = (full["labels"][0] != IGNORE_INDEX).nonzero().flatten()
        # The whole sample's first tokens: the prompt as it was, the answer side cut from the end, ending
        # on an answer token, with at least MIN_ANSWER_TOKENS of the answer (a short sample: untouched).
        assert torch.equal(batch["input_ids"][row, :kept], full["input_ids"][0, :kept])
        assert torch.equal(batch["labels"][row, :kept], full["labels"][0, :kept])
        assert (answer < kept).sum() >= min(MIN_ANSWER_TOKENS, len(answer))
        assert kept == (full["input_ids"].shape[1] if row == 0 else 64)
        assert row == 0 or batch["labels"][row, kept - 1] != IGNORE_INDEX
        # Each row's first image whole; the second image of row 2 lay past the cut and left with its pixels.
        assert int((batch["input_ids"][row] == image).sum()) == one_image
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    images = batch["image_grid_thw"] if "image_grid_thw" in batch else batch["pixel_values"]
    assert len(images) == 3
    assert torch.equal(batch["pixel_values"][: len(batch["pixel_values"]) // 3], whole[0]["pixel_values"])
    loss = model(**batch).loss  # the model's check that image tokens and image features agree passes
    assert torch.isfinite(loss)


def test_a_record_that_cannot_be_cut_is_skipped_saying_why(tmp_path, model_and_processor):
    _, processor = model_and_processor
    dataset = ConversationDataset(long_records(tmp_path))
    where = f"{tmp_path / 'long.json'} record 3"
    with pytest.raises(
        RecordTooLong, match=rf"^{where}: \d+ tokens, over data.max_length=64, and \d+ of them "
    ) as info:
        Collator(processor, limit=LengthLimit(64))([dataset[0], dataset[3]])
    # Qwen2-VL: an image's tokens follow its pixels, so fewer pixels is a fix too.
    qwen = "image_grid_thw" in Collator(processor)([dataset[0]])
    assert ("lower model.max_pixels" in str(info.value)) == qwen
    with pytest.raises(RecordTooLong, match=r"record 1: \d+ tokens, over data.max_length=64 \(data.truncation=skip\)"):
        Collator(processor, limit=LengthLimit(64, "skip"))([dataset[1]])


def test_a_sample_within_the_limit_is_left_as_it_is(tmp_path, model_and_processor):
    _, processor = model_and_processor
    sample = ConversationDataset(long_records(tmp_path))[1]  # the long answer
    row = one_row(Collator(processor).labelled([sample]))
    length = len(row["input_ids"])
    assert "attention_mask" not in row and row["input_ids"].dim() == 1
    for limit in (LengthLimit(None), LengthLimit(length), LengthLimit(length, "skip")):
        kept, cut = fit_to_length(row, limit, processor)
        assert kept is row and not cut
    shorter, cut = fit_to_length(row, LengthLimit(length - 1), processor)
    assert cut and len(shorter["input_ids"]) <= length - 1 and shorter["labels"][-1] != IGNORE_INDEX
    assert torch.equal(shorter["pixel_values"], row["pixel_values"])  # its one image kept whole


def test_pad_rows_right_pads_tokens_and_concatenates_images():
    pixels = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3)
    rows = [
        {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7]), "pixel_values": pixels[:1]},
        {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])},  # text only
        {"input_ids": torch.tensor([1, 2]), "labels": torch.tensor([-100, 2]), "pixel_values": pixels[1:]},
    ]
    batch = pad_rows(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [1, 2, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX], [-100, 2, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch["attention_mask"].dtype == torch.int64 and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["pixel_values"], pixels)
    text_only = pad_rows([rows[1], {**rows[1], "pixel_values": pixels[:0]}], pad_token_id=0)
    assert sorted(text_only) == ["attention_mask", "input_ids", "labels"]  # as the processor leaves them out
