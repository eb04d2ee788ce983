"""launcher.model.flops: the step's FLOPs counted per part (vision tower per patch, projector per image row,
language model per token) agree with torch.utils.flop_counter's count of what the forward and backward
ran, within 5%, on both tiny families (a video in the batch too): everything training, the vision tower
frozen, and LoRA."""

from __future__ import annotations

import pytest
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from launcher.data.collate import Collator
from launcher.model.components import apply_freeze
from launcher.model.flops import FlopModel
from launcher.model.loading import load_model_and_processor
from launcher.model.method import apply_method
from tests.helpers import compose_typed

PROMPT = "what is in the image?"


def sample(images: list[Image.Image], answer: str) -> dict:
    question = [{"type": "image"} for _ in images] + [{"type": "text", "text": PROMPT}]
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    return {"id": answer, "where": answer, "images": images, "messages": messages, "source": 0}


def video_sample(frames: list[Image.Image], answer: str) -> dict:
    question = [{"type": "video"}, {"type": "text", "text": "which way?"}]
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]
    return {"id": answer, "where": answer, "images": [], "videos": [frames], "messages": messages, "source": 0}


def counted(model, batch: dict) -> int:
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
@pytest.mark.parametrize("what", ["full", "frozen_vision", "lora"])
def test_the_step_flops_agree_with_torchs_flop_counter(model_dirs, arch, what):
    # Eager attention: its matmuls are what the counter sees (it has no formula for the CPU sdpa kernel).
    model, processor = load_model_and_processor(str(model_dirs[arch]), attn_implementation="eager")
    if what == "frozen_vision":
        apply_freeze(model, vision=True, projector=False, language=False)
    if what == "lora":
        config = compose_typed(["method=lora", f"model={arch}", "method.dropout=0"])
        model = apply_method(model, config.method, config.model)
    red, blue = Image.new("RGB", (32, 32), "red"), Image.new("RGB", (48, 32), "blue")
    frames = [Image.new("RGB", (32, 32), (60 * t, 0, 0)) for t in range(4)]
    # One image, two images of two sizes, no image, a video (4 frames: Qwen2-VL takes it as a video of two
    # temporal patches, LLaVA as 4 images): samples of different lengths (padded, as a batch is).
    samples = [sample([red], "red circle"), sample([red, blue], "blue square"), sample([], "hi")]
    batch = Collator(processor)([*samples, video_sample(frames, "left")])
    flops = FlopModel.of(model)
    rows = batch["input_ids"].shape[0]
    padded = [int(batch["input_ids"].shape[1])] * rows  # what runs: padding included
    expected = counted(model, batch)
    ours = flops.step_flops(padded, flops.image_rows(batch))
    assert abs(ours - expected) / expected < 0.05, (ours, expected)
    real = batch["attention_mask"].sum(dim=1).tolist()  # the useful work counts real tokens only
    assert flops.step_flops(real, flops.image_rows(batch)) < ours
    if what != "full":  # a frozen vision tower (or frozen weights) costs less than training it
        assert ours < FlopModel.of(_all_trainable(model)).step_flops(padded, flops.image_rows(batch))


def _all_trainable(model):
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model
