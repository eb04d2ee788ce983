"""Shapes generation, collation labels, exact-match evaluation (record formats: test_formats.py)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from launcher.core.errors import LauncherError
from launcher.data.shapes import COLOUR_QUESTION, COLOURS, QUESTION, SHAPES, generate_shapes, prepare_data
from launcher.data.length import IGNORE_INDEX, MIN_ANSWER_TOKENS, LengthLimit, RecordTooLong
from launcher.data.collate import Collator, PromptCollator, estimated_length, fit_records
from launcher.data.records import ConversationDataset, load_records
from launcher.data.accuracy import exact_match_accuracy, normalize_answer
from launcher.model.tiny import TINY_ARCHITECTURES, build_tiny_model_dir
from launcher.model.loading import load_model_and_processor, set_pixel_limits
from tests.conftest import compose_config
from tests.test_models import SIZES

VOCABULARY = [QUESTION] + [f"{c} {s}" for c in COLOURS for s in SHAPES] + ["what colour?", "and the shape?"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> tuple[Path, Path, Path]:
    return generate_shapes(tmp_path_factory.mktemp("data") / "shapes", seed=0, n_train=72, n_eval=36, image_size=32)


@pytest.fixture(scope="module", params=TINY_ARCHITECTURES)
def model_and_processor(request, tmp_path_factory):
    out = build_tiny_model_dir(
        request.param,
        tmp_path_factory.mktemp("model") / request.param,
        VOCABULARY,
        seed=0,
        **SIZES,
    )
    return load_model_and_processor(str(out))


def write_image(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), "blue").save(path)
    return path.name


def record(image: str = "a.png", answer: str = "blue square", **extra) -> dict:
    turns = [{"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": answer}]
    return {"image": image, "conversations": turns, **extra}


MULTI_TURN = {
    "id": "multi",
    "image": "a.png",
    "conversations": [
        {"from": "human", "value": "<image>\nwhat colour?"},
        {"from": "gpt", "value": "blue"},
        {"from": "human", "value": "and the shape?"},
        {"from": "gpt", "value": "square"},
    ],
}


def answer(record: dict) -> str:
    """The text of a record's first assistant turn."""
    return record["messages"][1]["content"][0]["text"]


# ---------------------------------------------------------------------------------------------------
# Shapes


def test_shapes_are_deterministic_balanced_and_disjoint(tmp_path, shapes):
    train_json, eval_json, root = shapes
    again = generate_shapes(tmp_path / "again", seed=0, n_train=72, n_eval=36, image_size=32)
    assert train_json.read_bytes() == again[0].read_bytes() and eval_json.read_bytes() == again[1].read_bytes()
    for name in ("train/00000.png", "eval/00035.png"):
        assert (root / name).read_bytes() == (again[2] / name).read_bytes()
    other = generate_shapes(tmp_path / "other", seed=1, n_train=72, n_eval=36, image_size=32)
    assert (root / "train/00000.png").read_bytes() != (other[2] / "train/00000.png").read_bytes()

    train, _ = load_records(train_json, root)
    held_out, _ = load_records(eval_json, root)
    answers = [answer(r) for r in train]
    assert sorted(set(answers)) == sorted(f"{c} {s}" for c in COLOURS for s in SHAPES)
    assert all(answers.count(a) == 4 for a in set(answers))  # 72 images, 18 answers

    def digests(records):
        return {hashlib.sha1(np.asarray(Image.open(r["images"][0])).tobytes()).hexdigest() for r in records}

    assert len(digests(train)) == 72 and len(digests(held_out)) == 36
    assert not digests(train) & digests(held_out)
    assert Image.open(root / "train/00000.png").size == (32, 32)


def test_shapes_reuse_a_complete_set(tmp_path):
    paths = generate_shapes(tmp_path / "s", seed=3, n_train=4, n_eval=2, image_size=16)
    marker = tmp_path / "s" / "shapes.json"
    stamp = marker.stat().st_mtime_ns
    assert generate_shapes(tmp_path / "s", seed=3, n_train=4, n_eval=2, image_size=16) == paths
    assert marker.stat().st_mtime_ns == stamp
    generate_shapes(tmp_path / "s", seed=3, n_train=5, n_eval=2, image_size=16)
    assert len(json.loads(paths[0].read_text())) == 5
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temp dirs left behind


def test_the_colour_task_asks_about_the_same_images(tmp_path, shapes):
    train_json, eval_json, root = shapes
    colour = generate_shapes(tmp_path / "colour", seed=0, n_train=72, n_eval=36, image_size=32, task="colour")
    for name in ("train/00000.png", "train/00071.png", "eval/00035.png"):
        assert (root / name).read_bytes() == (colour[2] / name).read_bytes()
    for shape_file, colour_file in ((train_json, colour[0]), (eval_json, colour[1])):
        for asked_shape, asked_colour in zip(
            json.loads(shape_file.read_text()), json.loads(colour_file.read_text()), strict=True
        ):
            assert asked_colour["image"] == asked_shape["image"]
            assert asked_colour["conversations"][0]["value"] == f"<image>\n{COLOUR_QUESTION}"
            assert asked_colour["conversations"][1]["value"] == asked_shape["conversations"][1]["value"].split()[0]
    answers = [answer(r) for r in load_records(colour[0], colour[2])[0]]
    assert sorted(set(answers)) == sorted(COLOURS)
    assert all(answers.count(a) == 12 for a in COLOURS)  # 72 images, 6 answers
    with pytest.raises(LauncherError, match=r"data\.task=size is not a task of the built-in set"):
        generate_shapes(tmp_path / "size", seed=0, n_train=4, n_eval=2, image_size=16, task="size")


def test_both_tasks_coexist_in_the_cache(tmp_path):
    cache = tmp_path / "cache"
    shapes = compose_config(["data=shapes", "data.n_train=18", "data.n_eval=6"]).data
    colour = compose_config(["data=shapes", "data.n_train=18", "data.n_eval=6", "data.task=colour"]).data
    shape_files = prepare_data(shapes, cache)
    marker = shape_files[0].parent / "shapes.json"
    stamp = marker.stat().st_mtime_ns
    colour_files = prepare_data(colour, cache)
    assert shape_files[0].parent != colour_files[0].parent
    assert json.loads(marker.read_text())["task"] == "shape"
    assert json.loads((colour_files[0].parent / "shapes.json").read_text())["task"] == "colour"
    assert prepare_data(shapes, cache) == shape_files and marker.stat().st_mtime_ns == stamp  # reused, not redrawn
    assert json.loads(colour_files[0].read_text())[0]["conversations"][1]["value"] in COLOURS


# ---------------------------------------------------------------------------------------------------
# Collation and evaluation


def labelled_text(processor, batch, row: int) -> str:
    ids = batch["input_ids"][row][batch["labels"][row] != IGNORE_INDEX]
    return "".join(processor.tokenizer.decode(ids).split())


def test_collator_labels_only_assistant_tokens(tmp_path, model_and_processor):
    model, processor = model_and_processor
    write_image(tmp_path / "a.png")
    path = tmp_path / "data.json"
    path.write_text(json.dumps([record(), MULTI_TURN]))
    dataset = ConversationDataset(load_records(path, tmp_path)[0])
    batch = Collator(processor)([dataset[0], dataset[1]])

    eos = processor.tokenizer.eos_token
    assert labelled_text(processor, batch, 0) == f"bluesquare{eos}"
    assert labelled_text(processor, batch, 1) == f"blue{eos}square{eos}"
    # Right padding: the shorter row ends in padding, which is never labelled.
    assert batch["attention_mask"][0, -1] == 0 and batch["attention_mask"][0, 0] == 1
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    image_token = batch["input_ids"] == processor.image_token_id
    assert image_token.any() and (batch["labels"][image_token] == IGNORE_INDEX).all()

    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)


# Templates written in the manner of the real presets' (not copied): llava-1.5 renders images first,
# ends each turn with a space and puts no eos after the assistant; Qwen2-VL adds a default system turn.
LLAVA_15_STYLE = (
    "{% for m in messages %}{{ m['role'].upper() + ': ' }}"
    "{% for c in m['content'] if c['type'] == 'image' %}{{ '<image>\\n' }}{% endfor %}"
    "{% for c in m['content'] if c['type'] == 'text' %}{{ c['text'] + ' ' }}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
QWEN2_VL_STYLE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe helpful.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_collator_follows_other_templates_and_adds_a_missing_eos(tmp_path, model_and_processor):
    _, processor = model_and_processor
    processor = copy.copy(processor)
    llava = processor.image_token == "<image>"
    processor.chat_template = LLAVA_15_STYLE if llava else QWEN2_VL_STYLE
    write_image(tmp_path / "a.png")
    path = tmp_path / "data.json"
    path.write_text(json.dumps([record(), MULTI_TURN]))
    dataset = ConversationDataset(load_records(path, tmp_path)[0])
    batch = Collator(processor)([dataset[0], dataset[1]])
    eos = processor.tokenizer.eos_token
    assert labelled_text(processor, batch, 0) == f"bluesquare{eos}"
    assert labelled_text(processor, batch, 1) == f"blue{eos}square{eos}"
    # llava-1.5 style: eos appended after each answer; ChatML: its own <|im_end|> ends every turn.
    assert processor.tokenizer.decode(batch["input_ids"][1]).count(eos) == (2 if llava else 5)


def test_collated_shapes_batch_trains_both_archs(shapes, model_and_processor):
    model, processor = model_and_processor
    train_json, _, root = shapes
    dataset = ConversationDataset(load_records(train_json, root)[0])
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, collate_fn=Collator(processor))
    batch = next(iter(loader))
    assert set(batch) >= {"input_ids", "attention_mask", "pixel_values", "labels"}
    answers = [s["messages"][1]["content"][0]["text"] for s in (dataset[i] for i in range(8))]
    eos = processor.tokenizer.eos_token
    assert [labelled_text(processor, batch, i) for i in range(8)] == [a.replace(" ", "") + eos for a in answers]
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    model.zero_grad(set_to_none=True)


def test_prompt_collator_left_pads_up_to_the_assistant_turn(tmp_path, model_and_processor):
    _, processor = model_and_processor
    write_image(tmp_path / "a.png")
    path = tmp_path / "data.json"
    path.write_text(json.dumps([record(), MULTI_TURN]))
    dataset = ConversationDataset(load_records(path, tmp_path)[0])
    batch, answers = PromptCollator(processor)([dataset[0], dataset[1]])
    assert answers == ["blue square", "square"]
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    prompt = processor.tokenizer.decode(batch["input_ids"][1], skip_special_tokens=False)
    assert prompt.rstrip().endswith(("ASSISTANT:", "<|im_start|>assistant")) and "blue" in prompt


def test_exact_match_accuracy_runs(shapes, model_and_processor):
    model, processor = model_and_processor
    _, eval_json, root = shapes
    dataset = ConversationDataset(load_records(eval_json, root)[0])
    model.train()
    correct, total = exact_match_accuracy(model, processor, dataset, max_new_tokens=4, synced_gpus=False)
    assert total == 36 and 0 <= correct <= total
    assert model.training  # mode restored

    loader = torch.utils.data.DataLoader(dataset, batch_size=12, collate_fn=PromptCollator(processor))
    assert exact_match_accuracy(model, processor, loader, max_new_tokens=4, synced_gpus=False) == (correct, total)


# ---------------------------------------------------------------------------------------------------
# Sequence length: data.max_length, data.truncation

LONG_ANSWER = " ".join(["blue square"] * 60)  # about 120 tokens


def long_records(root: Path) -> list[dict]:
    """A short record; a long answer; a long answer before a turn with a second image; a long prompt."""
    write_image(root / "a.png")
    Image.new("RGB", (64, 48), "red").save(root / "b.png")
    second_image = [
        {"from": "human", "value": "<image>\nwhat colour?"},
        {"from": "gpt", "value": LONG_ANSWER},
        {"from": "human", "value": "<image>\nand the shape?"},
        {"from": "gpt", "value": "square"},
    ]
    long_prompt = [{"from": "human", "value": "<image>\n" + "what colour? " * 80}, {"from": "gpt", "value": "blue"}]
    rows = [
        record(id="short"),
        record(answer=LONG_ANSWER, id="long_answer"),
        {"id": "second_image", "image": ["a.png", "b.png"], "conversations": second_image},
        {"id": "long_prompt", "image": "a.png", "conversations": long_prompt},
    ]
    path = root / "long.json"
    path.write_text(json.dumps(rows))
    return load_records(path, root)[0]


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
    records = long_records(tmp_path)
    dataset = ConversationDataset(records)
    where = f"{tmp_path / 'long.json'} record 3"
    with pytest.raises(RecordTooLong, match=rf"^{where}: \d+ tokens, over data.max_length=64, and \d+ of them "):
        Collator(processor, limit=LengthLimit(64))([dataset[0], dataset[3]])
    with pytest.raises(RecordTooLong, match=r"record 1: \d+ tokens, over data.max_length=64 \(data.truncation=skip\)"):
        Collator(processor, limit=LengthLimit(64, "skip"))([dataset[1]])
    lengths = [Collator(processor)([dataset[index]])["input_ids"].shape[1] for index in range(4)]
    assert [estimated_length(processor, r) for r in records] == lengths  # from text and image headers alone

    # Before training without the data cache: the same decisions, so every rank drops the same records.
    cut = fit_records(records, processor, LengthLimit(64), num_workers=0)
    assert (cut.kept, cut.cut, [index for index, _ in cut.skipped]) == ([0, 1, 2], 2, [3])
    assert cut.skipped[0][1].startswith(f"{where}: {lengths[3]:,} tokens, over data.max_length=64")
    skip = fit_records(records, processor, LengthLimit(64, "skip"), num_workers=0)
    assert (skip.kept, skip.cut, [index for index, _ in skip.skipped]) == ([0], 0, [1, 2, 3])
    assert fit_records(records, processor, LengthLimit(None), num_workers=0).kept == [0, 1, 2, 3]
    roomy = fit_records(records, processor, LengthLimit(max(lengths)), num_workers=0)
    assert (roomy.kept, roomy.cut, roomy.skipped) == ([0, 1, 2, 3], 0, [])
    nothing = rf"^data: none of the 1 records fits data.max_length=64 \(1 too long, 0 bad\), e.g. {where}: "
    with pytest.raises(LauncherError, match=nothing):
        fit_records(records[3:], processor, LengthLimit(64), num_workers=0)


def test_estimated_lengths_follow_the_pixel_limits_of_qwen2_vl(tmp_path, model_and_processor):
    """Records far under data.max_length are not encoded before an uncached run: their estimate (text
    tokens, image tokens from each image's size) must be what the processor makes, at any pixel limits."""
    _, processor = model_and_processor
    if processor.image_token == "<image>":
        pytest.skip("LLaVA gives every image the same tokens")
    rows = []
    for index, (width, height) in enumerate([(32, 32), (100, 60), (300, 200), (17, 90)]):
        Image.new("RGB", (width, height), "red").save(tmp_path / f"{index}.png")
        turns = [{"from": "human", "value": "<image>\n<image>\nwhat colour?"}, {"from": "gpt", "value": "red"}]
        rows.append({"image": [f"{index}.png", f"{(index + 1) % 4}.png"], "conversations": turns})
    (tmp_path / "sizes.json").write_text(json.dumps(rows))
    records = load_records(tmp_path / "sizes.json", tmp_path)[0]
    processor = copy.deepcopy(processor)
    for low, high in ((None, None), (16 * 16, 64 * 64), (64 * 64, 256 * 256)):
        set_pixel_limits(processor, min_pixels=low, max_pixels=high)
        dataset = ConversationDataset(records)
        lengths = [Collator(processor)([dataset[index]])["input_ids"].shape[1] for index in range(4)]
        assert [estimated_length(processor, r) for r in records] == lengths, (low, high)


def test_normalize_answer():
    assert normalize_answer("  Red   Circle\n") == normalize_answer("red circle") == "red circle"


@pytest.mark.slow
def test_tiny_llava_learns_colours_within_a_few_hundred_steps(tmp_path):
    """End to end through labels, generate and exact match: colours come first (shapes take ~1000 steps)."""
    torch.manual_seed(0)
    train_json, eval_json, root = generate_shapes(tmp_path / "s", seed=0, n_train=720, n_eval=72, image_size=32)
    train, _ = load_records(train_json, root)
    out = build_tiny_model_dir(
        "tiny_llava",
        tmp_path / "m",
        [QUESTION] + [f"{c} {s}" for c in COLOURS for s in SHAPES],
        seed=0,
        hidden_size=64,
        num_layers=2,
        vision_hidden_size=64,
        vision_layers=2,
        image_size=32,
        patch_size=8,
    )
    model, processor = load_model_and_processor(str(out))
    eval_set = ConversationDataset(load_records(eval_json, root)[0])
    assert exact_match_accuracy(model, processor, eval_set, max_new_tokens=4)[0] == 0
    loader = torch.utils.data.DataLoader(
        ConversationDataset(train),
        batch_size=32,
        shuffle=True,
        drop_last=True,
        collate_fn=Collator(processor),
        generator=torch.Generator().manual_seed(0),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _epoch in range(7):  # 154 steps
        for batch in loader:
            model(**batch).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    correct, total = exact_match_accuracy(model, processor, eval_set, max_new_tokens=4)
    assert correct / total > 0.2  # right colour, shape still near chance (1/3)
