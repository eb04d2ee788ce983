"""launcher.model.components: a model's vision tower, projector and language model found, counted and
frozen; gradient checkpointing of each part (the same training, fewer activations kept, LoRA gradients
through frozen parts).

In-process with a plain torch optimizer on tiny models; bench/gradient_checkpointing.py measures the
same on a bigger model (BENCHMARKS.md). The planner's side of checkpointing: test_stats.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM

from launcher.core.errors import LauncherError
from launcher.data.collate import Collator
from launcher.data.shapes import COLOURS, QUESTION, SHAPES
from launcher.model.components import (
    apply_freeze,
    compile_layers,
    component_parameter_counts,
    enable_gradient_checkpointing,
    model_components,
)
from launcher.model.loading import load_model_and_processor
from launcher.model.tiny import TINY_ARCHITECTURES, build_tiny_model_dir
from tests.helpers import saved_for_backward

VOCABULARY = [QUESTION] + [f"{c} {s}" for c in COLOURS for s in SHAPES]
# Three layers each side: checkpointing a part shows in what its layers keep for backward.
DEEP_SIZES = {
    "hidden_size": 64,
    "num_layers": 3,
    "vision_hidden_size": 32,
    "vision_layers": 3,
    "image_size": 32,
    "patch_size": 8,
}


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


@pytest.fixture(scope="module")
def deep_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpointing")
    return {
        arch: build_tiny_model_dir(arch, root / arch, VOCABULARY, seed=0, **DEEP_SIZES) for arch in TINY_ARCHITECTURES
    }


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
def test_loss_curves_are_the_same_with_and_without_checkpointing(deep_model_dirs, arch):
    curves = {}
    for checkpointed in (False, True):
        model, processor = _load(deep_model_dirs[arch], language=checkpointed, vision=checkpointed)
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


# What compile_layers compiles of a layer, by the names the families give them.
COMPILED_PARTS = {"mlp", "norm1", "norm2", "input_layernorm", "post_attention_layernorm", "layer_norm1", "layer_norm2"}


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_compiled_layers_train_as_the_eager_ones_with_checkpointing_and_another_batch_shape(model_dirs, arch):
    """model.compile: each layer's MLP and norms compiled (torch.compile, inductor on this CPU), under
    checkpointing: the same losses and gradients as eager over three steps, a batch of another length
    between them (dynamic token counts), and the attention left as it is."""
    results = {}
    for compiled in (False, True):
        model, processor = _load(model_dirs[arch], language=True, vision=True)
        graphs = counters["stats"]["unique_graphs"]
        names = compile_layers(model) if compiled else []
        if compiled:  # one language layer and one vision layer in these tiny models: MLP and two norms each
            assert len(names) == 6 and {name.rsplit(".", 1)[1] for name in names} <= COMPILED_PARTS, names
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, grads = [], []
        for size in (4, 2, 4):
            loss = model(**_batch(processor, size)).loss
            loss.backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[compiled] = losses, grads
        assert (counters["stats"]["unique_graphs"] > graphs) == compiled  # dynamo did trace them
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    for compiled_grad, eager_grad in zip(results[True][1], results[False][1], strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_checkpointing_keeps_fewer_activations_for_backward(deep_model_dirs, arch):
    saved = {}
    for language, vision in ((False, False), (True, False), (True, True)):
        model, processor = _load(deep_model_dirs[arch], language=language, vision=vision)
        layers = model.model.language_model.layers
        assert all(layer.gradient_checkpointing == language for layer in layers)
        saved[language, vision] = saved_for_backward(model, _batch(processor))
    assert saved[True, True] < saved[True, False] < saved[False, False]


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_lora_gradients_reach_the_language_model_with_frozen_vision_and_embeddings(deep_model_dirs, arch):
    from peft import LoraConfig, get_peft_model

    grads = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model, processor = load_model_and_processor(str(deep_model_dirs[arch]))
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


def test_checkpointing_only_the_parts_asked_for(deep_model_dirs):
    model, _ = _load(deep_model_dirs["tiny_qwen2_vl"], language=False, vision=True)
    assert not any(layer.gradient_checkpointing for layer in model.model.language_model.layers)
    assert all(block.gradient_checkpointing for block in model.model.visual.blocks)


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_components_are_found_in_both_layouts(model_dirs, arch):
    model, _ = load_model_and_processor(str(model_dirs[arch]))
    parts = model_components(model)
    if arch == "tiny_llava":
        assert parts == {
            "vision": [model.model.vision_tower],
            "projector": [model.model.multi_modal_projector],
            "language": [model.model.language_model, model.lm_head],
        }
    else:  # Qwen2-VL's projector (the merger) sits inside its vision module
        assert parts == {
            "vision": [model.model.visual],
            "projector": [model.model.visual.merger],
            "language": [model.model.language_model, model.lm_head],
        }


def test_a_model_without_a_vision_tower_is_refused():
    text_only = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    message = r"^LlamaForCausalLM: cannot find its vision tower, projector and language model \(known layouts: LLaVA"
    with pytest.raises(LauncherError, match=message):
        model_components(text_only)
    with pytest.raises(LauncherError, match=message):
        enable_gradient_checkpointing(text_only, language=True, vision=False)
