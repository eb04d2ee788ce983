"""launcher.model.loading: models and processors load as a real preset loads (one line when they cannot),
configs read from a directory, a shipped preset or the hub, the pixel limits of dynamic-resolution models,
and the attention kernel a job loads with."""

from __future__ import annotations

import importlib.util
import pickle
import shutil

import pytest
import torch
from transformers import (
    AutoModelForImageTextToText,
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    Qwen2VLConfig,
)

from launcher.core.errors import LauncherError
from launcher.model import loading
from launcher.model.loading import load_model_and_processor, text_hidden_size
from launcher.model.tiny import TINY_ARCHITECTURES


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_loaded_model_and_processor_agree_on_image_tokens(model_dirs, arch):
    from PIL import Image

    model, processor = load_model_and_processor(str(model_dirs[arch]))
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    batch = processor(text=[text], images=[Image.new("RGB", (32, 32), "red")], return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits  # raises if image tokens and image features disagree
    assert logits.shape[:2] == batch["input_ids"].shape


def test_text_hidden_size_reads_the_text_config():
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=48, intermediate_size=96, num_attention_heads=2),
        text_config=LlamaConfig(hidden_size=96, intermediate_size=192, num_attention_heads=2),
    )
    assert text_hidden_size(config) == 96
    qwen = Qwen2VLConfig(
        text_config={"hidden_size": 80, "num_attention_heads": 2, "num_key_value_heads": 2},
        vision_config={"embed_dim": 32, "hidden_size": 80, "num_heads": 2},
    )
    assert text_hidden_size(qwen) == 80
    assert text_hidden_size(LlamaConfig(hidden_size=72, num_attention_heads=2)) == 72


def test_load_errors_are_one_line(tmp_path):
    with pytest.raises(LauncherError, match="not found locally and could not be fetched") as info:
        load_model_and_processor(str(tmp_path / "no-such-model"))
    assert "\n" not in str(info.value)

    text_only = tmp_path / "llama"
    LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    ).save_pretrained(text_only)
    with pytest.raises(LauncherError, match="is a llama model, not an image-text-to-text model"):
        load_model_and_processor(str(text_only))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LauncherError, match="cannot read its config there"):
        load_model_and_processor(str(empty))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_processor_pickles_for_spawned_workers(model_dirs, arch):
    _, processor = load_model_and_processor(str(model_dirs[arch]))
    clone = pickle.loads(pickle.dumps(processor))
    assert type(clone) is type(processor) and clone.image_token_id == processor.image_token_id


def _image_tokens(model, processor, image) -> int:
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    batch = processor(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        model(**batch)  # raises if image tokens and image features disagree
    return int((batch["input_ids"] == processor.image_token_id).sum())


@pytest.mark.parametrize(
    ("side", "min_pixels", "max_pixels", "tokens"),
    [
        (32, None, None, 4),  # the tiny processor's own: image_size^2 pixels, 8 px patches merged 2x2
        (32, None, 16 * 16, 1),
        (32, 64 * 64, None, 16),
        (64, 16 * 16, 64 * 64, 16),
        (64, 16 * 16, 32 * 32, 4),
        (96, None, 48 * 48, 9),
    ],
)
def test_pixel_limits_set_the_image_tokens_of_qwen2_vl(model_dirs, side, min_pixels, max_pixels, tokens):
    from PIL import Image

    model, processor = load_model_and_processor(
        str(model_dirs["tiny_qwen2_vl"]), min_pixels=min_pixels, max_pixels=max_pixels
    )
    assert _image_tokens(model, processor, Image.new("RGB", (side, side), "red")) == tokens


def test_pixel_limits_are_refused_for_llava(model_dirs, tmp_path):
    with pytest.raises(LauncherError, match="vision tower's image_size") as info:
        load_model_and_processor(str(model_dirs["tiny_llava"]), max_pixels=64 * 64)
    message = str(info.value)
    assert message.startswith("model.max_pixels=4096: only dynamic-resolution models (the Qwen2-VL family)")
    assert "(32 px): set model.image_size instead" in message and "\n" not in message
    # A pretrained LLaVA (no tiny build marker) is told to leave the keys unset.
    pretrained = tmp_path / "llava"
    AutoModelForImageTextToText.from_pretrained(model_dirs["tiny_llava"]).save_pretrained(pretrained)
    with pytest.raises(LauncherError, match=r"model.min_pixels=1 model.max_pixels=2: .*: leave model.min_pixels"):
        load_model_and_processor(str(pretrained), min_pixels=1, max_pixels=2)


@pytest.mark.parametrize(
    ("requested", "device", "precision", "flash_attn", "expected"),
    [
        ("auto", "cuda", "bf16", True, "flash_attention_2"),
        ("auto", "cuda", "fp16", True, "flash_attention_2"),
        ("auto", "cuda", "fp32", True, "sdpa"),
        ("auto", "cuda", "bf16", False, "sdpa"),
        ("auto", "cpu", "bf16", True, "sdpa"),
        ("eager", "cpu", "fp32", False, "eager"),
        ("sdpa", "cuda", "fp32", False, "sdpa"),
        ("flash_attention_2", "cuda", "bf16", True, "flash_attention_2"),
        ("flash_attention_2", "cpu", "bf16", True, "needs a CUDA device (this job runs on cpu)"),
        ("flash_attention_2", "cuda", "bf16", False, "needs the flash-attn package, which is not installed"),
        ("flash_attention_2", "cuda", "fp32", True, "runs in bf16 or fp16 only (this job trains in fp32"),
    ],
)
def test_resolve_attn_implementation(monkeypatch, requested, device, precision, flash_attn, expected):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        loading.importlib.util,
        "find_spec",
        lambda name, *args: (object() if flash_attn else None) if name == "flash_attn" else real(name, *args),
    )
    if " " not in expected:
        assert loading.resolve_attn_implementation(requested, device_kind=device, precision=precision) == expected
        return
    with pytest.raises(LauncherError) as info:
        loading.resolve_attn_implementation(requested, device_kind=device, precision=precision)
    message = str(info.value)
    assert message.startswith(f"model.attn_implementation=flash_attention_2 {expected}")
    assert message.endswith(
        ": use model.attn_implementation=sdpa (or auto, which picks flash_attention_2 where it can run)"
    )


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_eager_and_sdpa_both_train_the_tiny_models(model_dirs, arch):
    from PIL import Image

    from launcher.data.collate import Collator

    images = [Image.new("RGB", (32, 32), colour) for colour in ("red", "blue", "green", "red")]
    answers = ["red circle", "blue square", "green triangle", "red circle"]
    losses = {}
    for attn in ("eager", "sdpa"):
        torch.manual_seed(0)
        model, processor = load_model_and_processor(str(model_dirs[arch]), attn_implementation=attn)
        assert model.config._attn_implementation == attn
        assert model.config.get_text_config()._attn_implementation == attn
        assert model.config.vision_config._attn_implementation == attn
        samples = [
            {
                "images": [image],
                "messages": [
                    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ],
            }
            for image, answer in zip(images, answers, strict=True)
        ]
        batch = Collator(processor)(samples)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        losses[attn] = []
        for _ in range(4):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[attn].append(loss.item())
        assert losses[attn][-1] < losses[attn][0]
    assert losses["eager"] == pytest.approx(losses["sdpa"], rel=1e-4)


def test_an_unknown_attention_kernel_is_refused():
    with pytest.raises(LauncherError, match=r"^model.attn_implementation=flex is unknown: use auto, eager, sdpa"):
        loading.resolve_attn_implementation("flex", device_kind="cpu", precision="fp32")


def test_damaged_weights_are_one_line(model_dirs, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(model_dirs["tiny_llava"], damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a copy cut short
    with pytest.raises(
        LauncherError, match=r"cannot load its weights \(.*\); copy the complete model directory"
    ) as info:
        load_model_and_processor(str(damaged))
    assert str(info.value).startswith(f"model.path={damaged}: ") and "\n" not in str(info.value)
