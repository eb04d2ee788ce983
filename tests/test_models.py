"""Tiny model builds, loading through plain transformers, hidden sizes and freezing."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    Qwen2VLConfig,
)

from launcher.errors import LauncherError
from launcher.models import (
    TINY_ARCHITECTURES,
    apply_freeze,
    build_tiny_model_dir,
    component_parameter_counts,
    load_model_and_processor,
    text_hidden_size,
)

VOCABULARY = ["<image>\nwhat is in the image?", "red circle", "blue square", "green triangle"]
SIZES = {
    "hidden_size": 64,
    "num_layers": 1,
    "vision_hidden_size": 32,
    "vision_layers": 1,
    "image_size": 32,
    "patch_size": 8,
}
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


def build(arch: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    return build_tiny_model_dir(arch, out_dir, VOCABULARY, seed=seed, **{**SIZES, **overrides})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build(arch, root / arch) for arch in TINY_ARCHITECTURES}


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_tiny_build_loads_with_plain_transformers(model_dirs, arch):
    model = AutoModelForImageTextToText.from_pretrained(model_dirs[arch])
    expected = {"tiny_llava": "LlavaForConditionalGeneration", "tiny_qwen2_vl": "Qwen2VLForConditionalGeneration"}
    assert type(model).__name__ == expected[arch]
    assert model.config.get_text_config().hidden_size == SIZES["hidden_size"]
    # transformers 5.24 builds Qwen2-VL's processor only with a video processor, which needs torchvision.
    if arch == "tiny_llava" or HAS_TORCHVISION:
        processor = AutoProcessor.from_pretrained(model_dirs[arch])
    else:
        _, processor = load_model_and_processor(str(model_dirs[arch]))
    assert type(processor).__name__ == {"tiny_llava": "LlavaProcessor", "tiny_qwen2_vl": "Qwen2VLProcessor"}[arch]
    rendered = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert processor.image_token in rendered
    assert processor.tokenizer.tokenize(" red circle") == ["Ġred", "Ġcircle"]  # one token per word


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


def test_build_is_deterministic_and_seeded(tmp_path):
    first, second, other = build("tiny_llava", tmp_path / "a"), build("tiny_llava", tmp_path / "b"), None
    for name in ("model.safetensors", "tokenizer.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    other = build("tiny_llava", tmp_path / "c", seed=1)
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_build_reuses_a_complete_dir_and_replaces_others(tmp_path):
    out = build("tiny_llava", tmp_path / "m")
    marker = out / "tiny_build.json"
    stamp = marker.stat().st_mtime_ns
    assert build("tiny_llava", out) == out and marker.stat().st_mtime_ns == stamp

    build("tiny_llava", out, hidden_size=32)  # other arguments: rebuilt in place
    assert json.loads(marker.read_text())["hidden_size"] == 32

    half = tmp_path / "half"  # a crash left files but no marker
    half.mkdir()
    (half / "config.json").write_text("{")
    build("tiny_qwen2_vl", half)
    assert json.loads((half / "config.json").read_text())["model_type"] == "qwen2_vl"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(LauncherError, match="tiny_gpt"):
        build("tiny_gpt", tmp_path / "x")
    with pytest.raises(LauncherError, match="multiple of patch_size"):
        build("tiny_llava", tmp_path / "x", patch_size=5)


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


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_freeze_counts_and_requires_grad(model_dirs, arch):
    model, _ = load_model_and_processor(str(model_dirs[arch]))
    counts = component_parameter_counts(model)
    assert counts["vision"] + counts["projector"] + counts["language"] == counts["total"]
    assert counts["trainable"] == counts["total"] == sum(p.numel() for p in model.parameters())
    assert min(counts.values()) > 0

    frozen = apply_freeze(model, vision=True, projector=False, language=False)
    assert {k: frozen[k] for k in ("vision", "projector", "language", "total")} == {
        k: counts[k] for k in ("vision", "projector", "language", "total")
    }
    assert frozen["trainable"] == counts["total"] - counts["vision"]
    assert frozen["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    vision = model.model.vision_tower if arch == "tiny_llava" else model.model.visual
    projector = model.model.multi_modal_projector if arch == "tiny_llava" else model.model.visual.merger
    assert all(p.requires_grad for p in projector.parameters())  # Qwen2-VL's merger is the projector
    assert not any(p.requires_grad for n, p in vision.named_parameters() if not n.startswith("merger."))

    everything = apply_freeze(model, vision=True, projector=True, language=True)
    assert everything["trainable"] == 0
    assert not model.lm_head.weight.requires_grad


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
