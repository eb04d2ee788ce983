"""model.source=random (launcher.model.tiny.build_random_model_dir): a real preset's architecture with random
weights and a local tokenizer, without a download. The real presets' builds have the released checkpoints'
parameter counts, vocabulary widths and image tokens (on the meta device: nothing is allocated); a build of
a small architecture of the same family loads with weights drawn from its seed and trains in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from launcher.core.errors import LauncherError
from launcher.model.loading import PRESET_CONFIGS, load_model_and_processor, load_processor, random_build
from launcher.model.stats import meta_model
from launcher.model.tiny import build_random_model_dir
from tests.helpers import compose_typed
from tests.unit.model.tiny_sizes import VOCABULARY

# The released checkpoints' parameter counts (their model.safetensors.index.json's total_size / 2 bytes,
# bf16 and fp16 alike) and vocabulary widths.
RELEASED = {
    "qwen2_vl_2b": (2_208_985_600, 151_936, 256),
    "qwen2_5_vl_7b": (8_292_166_656, 152_064, 256),
    "llava_1_5_7b": (7_063_427_072, 32_064, 576),
}


def one_image_conversation(processor, size: int = 448) -> torch.Tensor:
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in the image?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "red circle"}]},
    ]
    text = processor.apply_chat_template(messages)
    return processor(text=[text], images=[Image.new("RGB", (size, size), "red")], return_tensors="pt")["input_ids"][0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache_dir for the presets' builds: the built-in data set is generated once."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("preset", sorted(RELEASED))
def test_a_random_build_of_a_real_preset_has_the_released_shape(preset, cache):
    """Parameters, vocabulary, and the language tokens of a 448 x 448 image (Qwen2-VL: 32 x 32 patches of 14
    pixels merged 2 x 2; LLaVA-1.5: 24 x 24 patches of its 336-pixel tower), with the image token the
    local tokenizer's."""
    params, vocabulary, image_tokens = RELEASED[preset]
    cfg = compose_typed([f"model={preset}", "model.source=random", f"cache_dir={cache}", "data.n_train=64"])
    config, model = meta_model(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    assert config.get_text_config().vocab_size == vocabulary == model.get_output_embeddings().weight.shape[0]
    (path,) = (cache / "models").glob(cfg.model.path.replace("/", "--") + "-random-*")
    assert random_build(str(path))["from"] == cfg.model.path
    assert not list(path.glob("*.safetensors"))  # no weights are written: the ranks make them
    processor = load_processor(str(path))
    image_token = processor.tokenizer.convert_tokens_to_ids(
        "<image>" if preset.startswith("llava") else "<|image_pad|>"
    )
    assert image_token == getattr(config, "image_token_id", None) or image_token == config.image_token_index
    assert len(processor.tokenizer) < vocabulary
    assert int((one_image_conversation(processor) == image_token).sum()) == image_tokens


def small_qwen2_vl_dir(where: Path) -> Path:
    """Qwen2-VL-2B's config with every width shrunk but the vocabulary (151,936) and the patch layout."""
    config = json.loads((PRESET_CONFIGS / "Qwen--Qwen2-VL-2B-Instruct" / "config.json").read_text())
    config.update(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    config["vision_config"].update(depth=1, embed_dim=32, num_heads=2, hidden_size=64)
    config["rope_scaling"]["mrope_section"] = [4, 6, 6]
    where.mkdir()
    (where / "config.json").write_text(json.dumps(config))
    return where


def test_the_weights_come_from_the_seed_and_are_made_where_asked(tmp_path):
    source = small_qwen2_vl_dir(tmp_path / "small")
    loads = []
    for seed in (0, 0, 1):
        path = build_random_model_dir(str(source), tmp_path / f"build-{seed}", VOCABULARY, seed=seed)
        model, _ = load_model_and_processor(str(path), torch_dtype=torch.float32, device_map={"": "cpu"})
        loads.append(model.get_output_embeddings().weight.detach())
        assert model.get_output_embeddings().weight.shape == (151_936, 64)
    assert torch.equal(loads[0], loads[1]) and not torch.equal(loads[0], loads[2])


def test_qlora_on_a_random_build_is_refused_before_any_rank_starts():
    from launcher.model.method import check_method

    cfg = compose_typed(["model=qwen2_vl_2b", "model.source=random", "method=qlora"])
    with pytest.raises(LauncherError, match=r"method=qlora with model\.source=random.*use method=lora"):
        check_method(cfg, "cuda")


def test_a_random_build_trains_here(train_in_process, tmp_path):
    """The whole path: built from the data's words, weights from train.seed, the real vocabulary width through
    the chunked loss, a step and a held-out evaluation."""
    source = small_qwen2_vl_dir(tmp_path / "small")
    ran = train_in_process(
        "model=tiny_qwen2_vl", "model.source=random", f"model.path={source}", "model.arch=null",
        "train.max_steps=3", "train.eval_every=3", "data.n_train=32", "data.n_eval=8", "data.image_size=56",
        "train.micro_batch_size=2", "train.global_batch_size=2", "logger=none",
    )  # fmt: skip
    summary = ran.summary()
    assert summary["status"] == "completed", ran.error
    assert summary["params_total"] > 151_936 * 64  # the real vocabulary's embedding alone
    assert summary["loss_logits"] == "chunks of 1024 answer tokens"
