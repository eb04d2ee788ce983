"""launcher.model.stats: what the memory planner knows of a model, read from its config on the meta device
(counts per component, freezing and LoRA, shapes, image tokens, checkpointing), equal to the real model's;
and the sequence a job plans for."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image

from launcher.core.errors import LauncherError
from launcher.model import stats as model_stats
from launcher.model.components import component_parameter_counts
from launcher.model.loading import load_model_and_processor
from launcher.model.stats import ModelStats, TransformerDims, fewest_image_tokens, meta_model, model_dir, sequence
from launcher.plan.memory import Layout, activation_bytes
from tests.helpers import compose_typed


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_the_stats_of_a_tiny_model_are_those_of_the_model_it_trains(arch):
    """Counted on the meta device from the config; checked against the real model the job loads, and the
    image tokens against what its processor and vision tower make of an image."""
    cfg = compose_typed([f"model={arch}"])
    stats = model_stats.model_stats(cfg)
    model, processor = load_model_and_processor(model_dir(cfg))
    counts = component_parameter_counts(model)
    assert stats.total == counts["total"] == stats.trainable == sum(p.numel() for p in model.parameters())
    assert dict(stats.components) == {key: counts[key] for key in ("vision", "projector", "language")}
    assert sorted(stats.param_sizes) == sorted(p.numel() for p in model.parameters())
    assert stats.largest_layer == max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    text = model.config.get_text_config()
    assert (stats.text.hidden, stats.text.layers, stats.vocab_size) == (64, 2, text.vocab_size)
    assert stats.text.gated and (stats.frozen, stats.checkpointed, stats.method) == ((), (), "full")

    text_prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    batch = processor(text=[text_prompt], images=[Image.new("RGB", (32, 32), "red")], return_tensors="pt")
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == stats.image_tokens
    with torch.no_grad():
        if arch == "tiny_llava":  # CLIP's class token runs through the tower, then the default strategy drops it
            tower = model.model.vision_tower(batch["pixel_values"]).last_hidden_state.shape[1]
        else:  # Qwen2-VL: one row of pixel_values per patch; the merger makes 2x2 patches one token
            tower = batch["pixel_values"].shape[0]
    assert stats.vision_tokens == tower


def test_the_freeze_flags_and_lora_decide_what_is_trainable():
    path = model_dir(compose_typed([]))  # neither freezing nor the method changes the model: read it once
    full = model_stats.model_stats(compose_typed([]), path=path)
    frozen = model_stats.model_stats(compose_typed(["model.freeze_vision=true"]), path=path)
    assert frozen.frozen == ("vision",) and frozen.total == full.total
    assert frozen.trainable == full.total - full.components["vision"]
    lora = model_stats.model_stats(compose_typed(["method=lora"]), path=path)
    assert full.trainable == full.total
    assert 0 < lora.trainable <= 0.1 * lora.total
    assert lora.frozen == ("vision",)  # the vision tower keeps no activations for backward
    assert lora.method == "lora"
    wider = model_stats.model_stats(compose_typed(["method=lora", "method.r=16"]), path=path)
    assert wider.trainable > lora.trainable


def test_the_planner_reads_the_checkpointing_keys():
    layout = Layout(stage=0, dtype="bf16", micro_batch=4)
    overrides = ["model.num_layers=4", "model.vision_layers=4"]
    estimates = {}
    path = model_dir(compose_typed(overrides))  # checkpointing does not change the model: read it once
    for keys in ([], ["model.gradient_checkpointing=true"], ["model.vision_gradient_checkpointing=true"]):
        stats = model_stats.model_stats(compose_typed([*overrides, *keys]), path=path)
        estimates[tuple(keys)] = activation_bytes(stats, layout, seq_len=512, images=1)
        assert stats.checkpointed == tuple(
            part
            for part, key in (("language", "model.gradient"), ("vision", "model.vision"))
            if any(k.startswith(key) for k in keys)
        )
    assert estimates[("model.gradient_checkpointing=true",)] < estimates[()]
    assert estimates[("model.vision_gradient_checkpointing=true",)] < estimates[()]


def hand_made_stats(checkpointed: tuple[str, ...] = ()) -> ModelStats:
    """Stats small enough to work the activation formula by hand (3 vision layers, so that checkpointing
    the tower shows)."""
    return ModelStats(
        name="hand",
        total=100,
        trainable=100,
        components={"vision": 10, "projector": 10, "language": 80},
        frozen=(),
        largest_layer=40,
        param_sizes=(40, 30, 20, 5, 5),
        text=TransformerDims(hidden=4, layers=2, intermediate=8, kv_width=4, gated=True),
        vocab_size=10,
        vision=TransformerDims(hidden=2, layers=3, intermediate=4),
        vision_tokens=5,
        image_tokens=4,
        projector_width=6,
        checkpointed=checkpointed,
    )


def test_the_planner_activation_term_follows_checkpointing():
    layout = Layout(stage=0, dtype="bf16", micro_batch=3)
    # language: 7 tokens x (2 layers x A + final norm 3*4), A = 10*4 + 2*4 + 4*8 = 80; checkpointed:
    # 7 x (2 layers x h + one A + 3*4). vision: 5 tokens x (3 layers x A_v), A_v = 12*2 + 2*4 = 32;
    # checkpointed: 5 x (3 x 2 + 32). projector 4 x 6; logits 7 x 10 x (2*2 + 8) bytes.
    language, language_checkpointed = 7 * (2 * 80 + 12), 7 * (2 * 4 + 80 + 12)
    vision, vision_checkpointed = 5 * 3 * 32, 5 * (3 * 2 + 32)
    rest = 2 * 24 + 840

    def expected(text: int, image: int) -> int:
        return 3 * (2 * (text + image) + rest)

    assert activation_bytes(hand_made_stats(()), layout, seq_len=7, images=1) == expected(language, vision)
    assert activation_bytes(hand_made_stats(("language",)), layout, seq_len=7, images=1) == expected(
        language_checkpointed, vision
    )
    assert activation_bytes(hand_made_stats(("language", "vision")), layout, seq_len=7, images=1) == expected(
        language_checkpointed, vision_checkpointed
    )


def test_the_chunked_loss_plans_one_chunk_of_logits_for_the_micro_batch():
    """loss.chunk_tokens = c: c x V x (2 e + 8) bytes for the whole micro batch (never more than its tokens),
    instead of every token's; a preference loss doubles the rows, not the chunk."""
    layout = Layout(stage=0, dtype="bf16", micro_batch=3)
    whole = activation_bytes(hand_made_stats(), layout, seq_len=7, images=1)
    kept = whole - 3 * 7 * 10 * 12  # without the logits
    for chunk, tokens in ((4, 4), (1024, 3 * 7)):
        stats = dataclasses.replace(hand_made_stats(), loss_chunk=chunk)
        assert activation_bytes(stats, layout, seq_len=7, images=1) == kept + tokens * 10 * 12
    stats = dataclasses.replace(hand_made_stats(), loss_chunk=4)
    assert activation_bytes(stats, layout, seq_len=7, images=1, rows=2) == 2 * kept + 4 * 10 * 12
    assert model_stats.model_stats(compose_typed(["loss.chunk_tokens=256"])).loss_chunk == 256


def test_the_sequence_planned_per_sample():
    """plan.seq_len when given; else data.max_length (a batch is padded to its longest sample); else the
    text tokens (32 for tiny models, 512 otherwise) plus each image's tokens, up to data.max_length."""
    stats = dataclasses.replace(hand_made_stats(), image_tokens=16)
    shapes, user = compose_typed(["data=shapes"]), compose_typed(["data=llava_json"])

    def with_plan(cfg, **fields):
        return dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, **fields))

    assert sequence(with_plan(user, seq_len=100, images_per_sample=2), stats) == (100, 2)
    assert sequence(user, stats) == (2048, 1) and model_stats.planned_at_max_length(user)
    assert sequence(shapes, stats) == (32 + 16, 1)  # the built-in set: no limit, text + image tokens
    assert not model_stats.planned_at_max_length(shapes)
    capped = with_plan(dataclasses.replace(user, data=dataclasses.replace(user.data, max_length=40)), text_tokens=30)
    assert sequence(capped, stats) == (40, 1) and not model_stats.planned_at_max_length(capped)
    assert sequence(with_plan(capped, text_tokens=20), stats) == (36, 1)
    pretrained = dataclasses.replace(shapes, model=compose_typed(["model=llava_1_5_7b"]).model)
    assert sequence(with_plan(pretrained, images_per_sample=2), stats) == (512 + 2 * 16, 2)
    # A packed row: its length, and the images of the records it holds (rows of 4,096 tokens hold 7 records of
    # 512 text tokens and an image of 16 each, whatever data.max_length says of one record).
    packed = dataclasses.replace(pretrained, data=dataclasses.replace(user.data, packing=True, pack_length=4096))
    assert sequence(packed, stats) == (4096, 4096 // (512 + 16))
    assert sequence(with_plan(packed, images_per_sample=2, text_tokens=100), stats) == (4096, 2 * (4096 // 132))
    assert sequence(with_plan(packed, text_tokens=8000), stats) == (4096, 1)  # one record fills the row
    # A video: data.video.max_frames frames, each planned as an image where a model of images takes a frame
    # an image (data.video.grid=1); tiled 2 x 2, an image per 4 frames; for a model that pairs frames in its
    # patches (the Qwen2-VL family), an image per pair (7 frames: 4 pairs, the last filled).
    video = dataclasses.replace(pretrained.data, video=dataclasses.replace(pretrained.data.video, max_frames=8))
    clips = with_plan(dataclasses.replace(pretrained, data=video), images_per_sample=1, videos_per_sample=2)
    assert sequence(clips, stats) == (512 + 17 * 16, 17)
    assert sequence(clips, dataclasses.replace(stats, frames_per_image=4)) == (512 + 5 * 16, 5)
    paired = dataclasses.replace(stats, frames_per_image=2)
    assert sequence(clips, paired) == (512 + 9 * 16, 9)
    odd = dataclasses.replace(video, video=dataclasses.replace(video.video, max_frames=7))
    assert sequence(dataclasses.replace(clips, data=odd), paired) == (512 + 9 * 16, 9)


def test_the_planner_reads_how_many_frames_an_image_holds():
    """Qwen2-VL: its temporal patch (2), whatever data.video.grid says; LLaVA: the grid's frames per image."""
    stats_of = model_stats.model_stats
    assert stats_of(compose_typed(["model=qwen2_vl_2b", "data.video.grid=3"])).frames_per_image == 2
    assert stats_of(compose_typed(["model=llava_1_5_7b"])).frames_per_image == 4  # data.video.grid's default, 2
    assert stats_of(compose_typed(["model=llava_1_5_7b", "data.video.grid=1"])).frames_per_image == 1


def test_the_fewest_tokens_an_image_takes():
    assert fewest_image_tokens(compose_typed(["model=tiny_llava"])) == (16, "tiny_llava at model.image_size=32")
    assert fewest_image_tokens(compose_typed(["model=tiny_qwen2_vl"])) == (4, "tiny_qwen2_vl at model.image_size=32")
    # The shipped presets' configs, no weights and no hub: LLaVA-1.5's 24 x 24 patches for every image;
    # Qwen2-VL's image brought up to model.min_pixels (default 56 x 56: 2 x 2 merged patches of 28 px).
    assert fewest_image_tokens(compose_typed(["model=llava_1_5_7b"])) == (576, "llava, every image")
    assert fewest_image_tokens(compose_typed(["model=qwen2_vl_2b"])) == (
        4,
        "qwen2_vl, an image of model.min_pixels=3136",
    )
    assert fewest_image_tokens(compose_typed(["model=qwen2_vl_2b", "model.min_pixels=200704"]))[0] == 256


def test_a_model_that_cannot_be_planned_is_one_line(tmp_path):
    cfg = compose_typed(["model=llava_1_5_7b"])
    cfg.model.path = ""
    with pytest.raises(LauncherError, match=r"^model.path is empty for model=llava_1_5_7b: give a hub id or a local"):
        model_dir(cfg)
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "llama"
    )
    with pytest.raises(LauncherError, match=rf"^model.path={tmp_path / 'llama'}: not an image-text-to-text model \("):
        meta_model(cfg, str(tmp_path / "llama"))
