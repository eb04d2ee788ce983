"""Gradient checkpointing: the same training, fewer activations kept, LoRA gradients, the planner's term.

In-process with a plain torch optimizer on tiny models; bench/gradient_checkpointing.py measures the
same on a bigger model (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from launcher.data.shapes import COLOURS, QUESTION, SHAPES
from launcher.data.collate import Collator
from launcher.model import stats as model_stats
from launcher.model.tiny import TINY_ARCHITECTURES, build_tiny_model_dir
from launcher.model.components import apply_freeze, enable_gradient_checkpointing
from launcher.model.loading import load_model_and_processor
from launcher.plan.memory import Layout, ModelStats, TransformerDims, activation_bytes
from tests.conftest import compose_config, saved_for_backward
from tests.test_plan import tiny_stats

VOCABULARY = [QUESTION] + [f"{c} {s}" for c in COLOURS for s in SHAPES]
SIZES = {
    "hidden_size": 64,
    "num_layers": 3,
    "vision_hidden_size": 32,
    "vision_layers": 3,
    "image_size": 32,
    "patch_size": 8,
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpointing")
    return {arch: build_tiny_model_dir(arch, root / arch, VOCABULARY, seed=0, **SIZES) for arch in TINY_ARCHITECTURES}


def _batch(processor, size: int = 4) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    samples = []
    for index in range(size):
        colour, shape = list(COLOURS)[index % len(COLOURS)], SHAPES[index % len(SHAPES)]
        pixels = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"{colour} {shape}"}]},
        ]
        samples.append({"images": [Image.fromarray(pixels)], "messages": messages})
    return Collator(processor)(samples)


def _load(path: Path, *, language: bool, vision: bool):
    torch.manual_seed(0)
    model, processor = load_model_and_processor(str(path))
    model.config.use_cache = False
    assert enable_gradient_checkpointing(model, language=language, vision=vision) == [
        name for name, on in (("language", language), ("vision", vision)) if on
    ]
    model.train()
    return model, processor


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_loss_curves_are_the_same_with_and_without_checkpointing(model_dirs, arch):
    curves = {}
    for checkpointed in (False, True):
        model, processor = _load(model_dirs[arch], language=checkpointed, vision=checkpointed)
        batch = _batch(processor)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curves[checkpointed] = []
        for _ in range(5):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            curves[checkpointed].append(loss.item())
    assert curves[True] == pytest.approx(curves[False], rel=1e-5)
    assert curves[True][-1] < curves[True][0]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_checkpointing_keeps_fewer_activations_for_backward(model_dirs, arch):
    saved = {}
    for language, vision in ((False, False), (True, False), (True, True)):
        model, processor = _load(model_dirs[arch], language=language, vision=vision)
        layers = model.model.language_model.layers
        assert all(layer.gradient_checkpointing == language for layer in layers)
        saved[language, vision] = saved_for_backward(model, _batch(processor))
    assert saved[True, True] < saved[True, False] < saved[False, False]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_lora_gradients_reach_the_language_model_with_frozen_vision_and_embeddings(model_dirs, arch):
    from peft import LoraConfig, get_peft_model

    grads = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model, processor = load_model_and_processor(str(model_dirs[arch]))
        model.config.use_cache = False
        apply_freeze(model, vision=True, projector=True, language=True)  # embeddings and vision tower too
        lora = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=r".*language_model\.layers\.\d+\.self_attn\.(q_proj|v_proj)",
            init_lora_weights=False,  # B != 0, so that gradients reach A as well
        )
        model = get_peft_model(model, lora)
        if checkpointed:
            enable_gradient_checkpointing(model, language=True, vision=True)
            # No hook makes the frozen embeddings' output require grad: non-reentrant needs none.
            assert not model.get_input_embeddings()._forward_hooks
        model.train()
        model(**_batch(processor)).loss.backward()
        trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
        assert trained and all("lora_" in name and "language_model" in name for name in trained)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained.values())
        grads[checkpointed] = {name: p.grad for name, p in trained.items()}
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7)


def test_checkpointing_only_the_parts_asked_for(model_dirs):
    model, _ = _load(model_dirs["tiny_qwen2_vl"], language=False, vision=True)
    assert not any(layer.gradient_checkpointing for layer in model.model.language_model.layers)
    assert all(block.gradient_checkpointing for block in model.model.visual.blocks)


def _stats(checkpointed: tuple[str, ...]) -> ModelStats:
    """test_plan's hand-made stats, with 3 vision layers so that checkpointing the tower shows."""
    vision = TransformerDims(hidden=2, layers=3, intermediate=4)
    return dataclasses.replace(tiny_stats(), vision=vision, checkpointed=checkpointed)


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

    assert activation_bytes(_stats(()), layout, seq_len=7, images=1) == expected(language, vision)
    assert activation_bytes(_stats(("language",)), layout, seq_len=7, images=1) == expected(
        language_checkpointed, vision
    )
    assert activation_bytes(_stats(("language", "vision")), layout, seq_len=7, images=1) == expected(
        language_checkpointed, vision_checkpointed
    )


def test_the_planner_reads_the_checkpointing_keys():
    layout = Layout(stage=0, dtype="bf16", micro_batch=4)
    overrides = ["model.num_layers=4", "model.vision_layers=4"]
    estimates = {}
    for keys in ([], ["model.gradient_checkpointing=true"], ["model.vision_gradient_checkpointing=true"]):
        stats = model_stats.model_stats(compose_config([*overrides, *keys]))
        estimates[tuple(keys)] = activation_bytes(stats, layout, seq_len=512, images=1)
        assert stats.checkpointed == tuple(
            part
            for part, key in (("language", "model.gradient"), ("vision", "model.vision"))
            if any(k.startswith(key) for k in keys)
        )
    assert estimates[("model.gradient_checkpointing=true",)] < estimates[()]
    assert estimates[("model.vision_gradient_checkpointing=true",)] < estimates[()]
