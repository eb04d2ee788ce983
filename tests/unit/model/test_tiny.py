"""launcher.model.tiny: tiny models built from code load through plain transformers, deterministically,
once per (architecture, dimensions, seed, vocabulary), and where a job's config says."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoModelForImageTextToText, AutoProcessor

from launcher.core.errors import LauncherError
from launcher.model.loading import load_model_and_processor
from launcher.model.tiny import TINY_ARCHITECTURES, resolve_model_path
from tests.helpers import compose_typed
from tests.unit.model.tiny_sizes import SIZES, build

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


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


def test_build_is_deterministic_and_seeded(tmp_path):
    first, second = build("tiny_llava", tmp_path / "a"), build("tiny_llava", tmp_path / "b")
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


def test_a_tiny_build_whose_weights_changed_is_built_again_with_the_seeds_weights(tmp_path):
    """A byte flipped in the cached weights would have the job start from other weights, silently (issue 42):
    the build's record holds every file's checksum, and the same seed makes the same weights again."""
    out = build("tiny_llava", tmp_path / "m")
    weights = out / "model.safetensors"
    intact = weights.read_bytes()
    damaged = bytearray(intact)
    damaged[-100] ^= 0x01  # in the tensor data, past the header: loads fine, and trains from another weight
    weights.write_bytes(bytes(damaged))
    assert build("tiny_llava", out) == out
    assert weights.read_bytes() == intact


def test_build_rejects_bad_arguments(tmp_path):
    with pytest.raises(LauncherError, match="tiny_gpt"):
        build("tiny_gpt", tmp_path / "x")
    with pytest.raises(LauncherError, match="multiple of patch_size"):
        build("tiny_llava", tmp_path / "x", patch_size=5)
    with pytest.raises(LauncherError, match=r"tiny_qwen2_vl merges 2x2 patches: image_size/patch_size=3 must be even"):
        build("tiny_qwen2_vl", tmp_path / "x", image_size=24)
    assert not (tmp_path / "x").exists()


def test_resolve_model_path_builds_a_tiny_model_per_vocabulary_and_seed(tmp_path):
    """A tiny model is built under cache/models from the records' words, once; the config's dimensions
    and train.seed make it; other words or another seed make another build."""
    model = dataclasses.replace(compose_typed(["model=tiny_llava"]).model, num_layers=1, vision_layers=1)
    turns = [{"role": "assistant", "content": [{"type": "text", "text": "red circle"}]}]
    records = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}]}, *turns]}]
    path = Path(resolve_model_path(model, 0, tmp_path, records))
    assert path.parent == tmp_path / "models" and path.name.startswith("tiny_llava-")
    built = json.loads((path / "tiny_build.json").read_text())
    assert (built["arch"], built["seed"], built["num_layers"], built["hidden_size"]) == ("tiny_llava", 0, 1, 64)
    _, processor = load_model_and_processor(str(path))
    assert processor.tokenizer.tokenize(" red circle") == ["Ġred", "Ġcircle"]
    assert resolve_model_path(model, 0, tmp_path, records) == str(path)
    assert resolve_model_path(model, 1, tmp_path, records) != str(path)
    assert resolve_model_path(model, 0, tmp_path, records * 3) == str(path)  # the same words: the same build
    other_words = [{"messages": [turns[0], {"role": "user", "content": [{"type": "text", "text": "blue"}]}]}]
    assert resolve_model_path(model, 0, tmp_path, other_words) != str(path)


def test_resolve_model_path_of_a_pretrained_model(tmp_path, monkeypatch):
    """A local directory is made absolute (adapters and checkpoints name it as their base); a hub id stays."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    local = dataclasses.replace(compose_typed(["model=llava_1_5_7b"]).model, path="models/mine")
    assert resolve_model_path(local, 0, Path("unused"), []) == str(tmp_path / "models" / "mine")
    hub = compose_typed(["model=llava_1_5_7b"]).model
    assert resolve_model_path(hub, 0, Path("unused"), []) == hub.path == "llava-hf/llava-1.5-7b-hf"


def test_a_very_long_word_is_cut_before_the_tokenizer_trains_on_it():
    """One record's 200,000-character answer cost the tokenizer's trainer 26 s, in Rust, deaf to SIGTERM
    (issue 42): runs of non-space characters reach it cut to MAX_WORD_CHARS, the rest of the text as it is."""
    from launcher.model.tiny import MAX_WORD_CHARS, tokenizer_corpus

    corpus = tokenizer_corpus(["<image>\nwhat colour?\n\nred", "x" * 200_000 + " and more"], ["USER:"])
    assert max(len(word) for piece in corpus for word in piece.split()) == MAX_WORD_CHARS
    assert "x" * MAX_WORD_CHARS + " and more" in corpus and " red" in corpus and " USER:" in corpus
    assert " \nwhat colour?\n\nred" in corpus  # whitespace, newlines included, stays as the texts have it


def test_the_tiny_llava_sees_the_built_in_clips_at_64_px_a_frame():
    """model.image_size's default for tiny_llava: the built-in images' 32 px, or on the motion task a
    data.video.grid x grid tile of 64 px frames; a given model.image_size wins; the tiny Qwen2-VL (which takes
    videos as videos) keeps 32."""
    side = {
        "": 32, "data.task=motion": 128, "data.task=motion data.video.grid=1": 64,
        "data.task=motion data.video.grid=3": 192, "data.task=motion model.image_size=64": 64,
        "data.task=motion model=tiny_qwen2_vl": 32, "data=llava_json data.path=x.json": 32,
    }  # fmt: skip
    for overrides, expected in side.items():
        assert compose_typed(overrides.split()).model.image_size == expected, overrides
