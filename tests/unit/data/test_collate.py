"""launcher.data.collate: conversations rendered with the processor's own chat template, labels on the
assistant's tokens only, prompts for generation, the ZeRO-3 guard's dummy image (which changes no loss and
no gradient), and which records fit data.max_length, decided before training."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from PIL import Image

from launcher.core.errors import LauncherError
from launcher.data.collate import (
    Collator,
    PromptCollator,
    add_dummy_image,
    estimated_length,
    fit_records,
    render_with_assistant_spans,
)
from launcher.data.length import IGNORE_INDEX, LengthLimit
from launcher.data.records import ConversationDataset, load_records
from launcher.data.video import takes_videos
from launcher.model.loading import set_pixel_limits
from tests.unit.data.samples import labelled_text, long_records, two_records

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


def test_collator_labels_only_assistant_tokens(tmp_path, model_and_processor):
    model, processor = model_and_processor
    dataset = ConversationDataset(two_records(tmp_path))
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


def test_collator_follows_other_templates_and_adds_a_missing_eos(tmp_path, model_and_processor):
    _, processor = model_and_processor
    processor = copy.copy(processor)
    llava = processor.image_token == "<image>"
    processor.chat_template = LLAVA_15_STYLE if llava else QWEN2_VL_STYLE
    dataset = ConversationDataset(two_records(tmp_path))
    batch = Collator(processor)([dataset[0], dataset[1]])
    eos = processor.tokenizer.eos_token
    assert labelled_text(processor, batch, 0) == f"bluesquare{eos}"
    assert labelled_text(processor, batch, 1) == f"blue{eos}square{eos}"
    # llava-1.5 style: eos appended after each answer; ChatML: its own <|im_end|> ends every turn.
    assert processor.tokenizer.decode(batch["input_ids"][1]).count(eos) == (2 if llava else 5)


def test_a_template_that_does_not_render_prefix_by_prefix_is_refused(model_and_processor):
    """The assistant's tokens are found by rendering the conversation turn by turn: a template whose
    rendering of a longer conversation does not start with that of a shorter one cannot be labelled."""
    _, processor = model_and_processor
    processor = copy.copy(processor)
    processor.chat_template = (
        "{{ messages | length }} turns\n{% for m in messages %}{{ m['role'] }}: "
        "{% for c in m['content'] if c['type'] == 'text' %}{{ c['text'] }}{% endfor %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
    ]
    with pytest.raises(LauncherError, match="its chat template does not render conversations prefix by prefix"):
        render_with_assistant_spans(processor, messages)


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
    dataset = ConversationDataset(two_records(tmp_path))
    batch, answers = PromptCollator(processor)([dataset[0], dataset[1]])
    assert answers == ["blue square", "square"]
    assert batch["attention_mask"][0, 0] == 0 and batch["attention_mask"][0, -1] == 1
    prompt = processor.tokenizer.decode(batch["input_ids"][1], skip_special_tokens=False)
    assert prompt.rstrip().endswith(("ASSISTANT:", "<|im_start|>assistant")) and "blue" in prompt


# ----------------------------------------------------------------------------- the ZeRO-3 guard's dummy image
@pytest.mark.parametrize("videos", [False, True], ids=["image", "image_and_video"])
def test_the_dummy_image_changes_no_loss_and_no_gradient(mixed_records, model_and_processor, videos):
    """A text-only batch with and without the guard's dummy image (and, for a model that takes videos as
    videos, its dummy video too): the same loss, the same gradients, and a zero gradient for the vision
    tower, which did run.

    "The same" up to float32 rounding: the dummy's tokens make the batch wider, and a wider matmul is
    blocked differently on a CPU, which reorders float32 sums; on this machine tiny_llava's loss then
    differs in its last bit (5.970762252807617 vs 5.970761775970459: one ulp, 8e-8 relative). A token
    that the real ones attended to, or a loss taken on one, would move the loss by orders of magnitude more
    than rtol=1e-6 (about 8 float32 epsilons) allows."""
    model, processor = model_and_processor
    if videos and not takes_videos(processor):
        pytest.skip("LLaVA takes a video's frames as images: the dummy image guards them")
    was_training = model.training
    model.eval()  # no dropout
    text_only = [s for s in ConversationDataset(mixed_records) if not s["images"]]
    plain = Collator(processor)(text_only)
    guarded = Collator(processor, image_every_batch=True, video_every_batch=videos)(text_only)
    assert "pixel_values" not in plain and "pixel_values" in guarded
    assert ("pixel_values_videos" in guarded) == videos and "pixel_values_videos" not in plain
    results = []
    try:
        for batch in (plain, guarded):
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    (plain_loss, plain_grads), (guarded_loss, guarded_grads) = results
    torch.testing.assert_close(guarded_loss, plain_loss, rtol=1e-6, atol=0)
    ran = []
    for name, grad in plain_grads.items():
        if grad is None:  # the vision tower did not run: with the dummy it did, and its gradient is zero
            assert guarded_grads[name] is None or not guarded_grads[name].any(), name
            ran += [name] if guarded_grads[name] is not None else []
        else:
            torch.testing.assert_close(guarded_grads[name], grad, rtol=1e-5, atol=1e-7)
    assert len(ran) > 5


def test_a_left_padded_dummy_keeps_prompts_as_they_were(model_and_processor):
    _, processor = model_and_processor
    prompt = processor(text=["hello there", "hi"], padding=True, padding_side="left", return_tensors="pt")
    guarded = add_dummy_image(processor, dict(prompt), padding_side="left")
    width = guarded["input_ids"].shape[1] - prompt["input_ids"].shape[1]
    assert torch.equal(guarded["input_ids"][:, width:], prompt["input_ids"])
    assert not guarded["attention_mask"][:, :width].any()
    assert int((guarded["input_ids"][0] == processor.image_token_id).sum()) > 0


# ----------------------------------------------------------------------------- data.max_length before training
def test_fit_records_decides_before_training_which_records_are_cut_or_skipped(tmp_path, model_and_processor):
    """Without the data cache the same decisions as the collator's, made up front, so that every rank drops
    the same records; lengths estimated from text and image headers alone equal the processor's."""
    _, processor = model_and_processor
    records = long_records(tmp_path)  # short, long answer, long answer before a second image, long prompt
    dataset = ConversationDataset(records)
    where = f"{tmp_path / 'long.json'} record 3"
    lengths = [Collator(processor)([dataset[index]])["input_ids"].shape[1] for index in range(4)]
    assert [estimated_length(processor, r) for r in records] == lengths  # from text and image headers alone

    before = torch.get_rng_state()
    cut = fit_records(records, processor, LengthLimit(64), num_workers=0)
    assert torch.equal(torch.get_rng_state(), before)  # data set-up leaves the random state to training
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
