"""launcher.model.kernels (model.kernels=liger): liger-kernel's fused linear cross-entropy, run here by Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA), gives transformers' own
loss and gradients to 1e-5 relative (fp32) on both tiny families, padded and packed, the total (SFT) and each
row's (DPO); keeps no logits for the backward pass; at ZeRO-3 the output layer becomes the model's external
parameter. Its layer kernels (CUDA only) are found and patched on both families; tests/gpu/test_cuda.py checks
what they compute. Where it cannot run it says why."""

from __future__ import annotations

import sys

import pytest
import torch
from omegaconf import OmegaConf
from peft import LoraConfig, get_peft_model

from launcher.core.errors import LauncherError
from launcher.data.length import IGNORE_INDEX, pad_rows
from launcher.data.packing import PackedCollator
from launcher.model import kernels
from launcher.model.kernels import (
    apply_liger_layers,
    check_kernels,
    enable_fused_loss,
    fused_loss_installed,
    fused_loss_problem,
    kernels_used,
    use_fused_loss,
)
from launcher.model.logps import answer_logps
from launcher.model.packing import packed_inputs, use_packed_attention
from launcher.train.losses import row_logps
from tests.unit.model.test_logps import ARCHES, assert_same, largest_saved_with_last_dim, loaded, loss_and_grads

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or kernels.triton_interpreted()), reason="Triton has no device here"
)


def fused(model):
    """The same model, its answers' loss through liger's kernel from now on."""
    use_fused_loss(model)
    assert fused_loss_installed(model)
    return model


@pytest.mark.parametrize("arch", ARCHES)
def test_fused_loss_and_gradients_equal_transformers_own(model_dirs, arch):
    model, processor, tensors = loaded(model_dirs, arch)
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    plain = loss_and_grads(model, batch, 0)
    assert_same(plain, loss_and_grads(fused(model), batch, 1024))


@pytest.mark.parametrize("arch", ARCHES)
def test_fused_loss_of_packed_rows_equals_transformers_own(model_dirs, arch):
    model, processor, tensors = loaded(model_dirs, arch)
    use_packed_attention(model)
    batch = packed_inputs(model, PackedCollator(processor)([[{"tensors": t} for t in tensors]]))
    plain = loss_and_grads(model, batch, 0)
    assert_same(plain, loss_and_grads(fused(model), batch, 1024))


@pytest.mark.parametrize("arch", ARCHES)
def test_each_rows_fused_log_probability_and_its_gradient_equal_the_whole_logits(model_dirs, arch):
    """What DPO reads: one sum per row. Weighted differently per row, so each token's own gradient counts
    (liger's per-token path, which makes the gradients in the backward pass)."""
    model, processor, tensors = loaded(model_dirs, arch)
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    weights = torch.tensor([1.0, -2.0, 0.5])

    def rows_and_grads(chunk):
        model.zero_grad()
        logps = row_logps(model, inputs, batch["labels"], chunk)
        (logps * weights).sum().backward()
        return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = rows_and_grads(0)
    with torch.no_grad():
        assert torch.equal(whole, answer_logps(model(**inputs).logits, batch["labels"]))
    fused(model)
    rows, grads = rows_and_grads(1024)
    assert rows.tolist() == pytest.approx(whole.tolist(), rel=1e-5)
    assert grads.keys() == whole_grads.keys()
    # 1e-5 of each gradient's largest element, or fp32 noise of the model's largest for one that is zero in exact
    # arithmetic (the key projections' biases: softmax does not see them)
    noise = 1e-7 * max(float(grad.abs().max()) for grad in whole_grads.values())
    for name, grad in whole_grads.items():
        assert float((grads[name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + noise, name


@pytest.mark.parametrize("arch", ARCHES)
def test_the_fused_loss_keeps_no_logits_for_the_backward_pass(model_dirs, arch):
    model, processor, tensors = loaded(model_dirs, arch)
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    vocabulary = model.get_output_embeddings().weight.shape[0]
    assert largest_saved_with_last_dim(fused(model), batch, 1024, vocabulary) == 0


def test_a_micro_batch_without_answers_backpropagates_zeros_through_the_fused_loss(model_dirs):
    model, processor, tensors = loaded(model_dirs, "tiny_qwen2_vl")
    batch = pad_rows(tensors[:2], processor.tokenizer.pad_token_id)
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    loss, grads = loss_and_grads(fused(model), batch, 1024)
    assert loss == 0.0
    assert grads and all(float(grad.abs().max()) == 0.0 for grad in grads.values())
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    assert row_logps(model, inputs, batch["labels"], 1024).tolist() == [0.0, 0.0]


def test_the_fused_loss_stays_off_where_it_cannot_read_the_output_layer(model_dirs):
    model, _, _ = loaded(model_dirs, "tiny_llava")
    assert fused_loss_problem(model) is None
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head"]))
    assert "not a plain linear layer" in fused_loss_problem(adapted)
    liger = OmegaConf.create({"kernels": "liger"})
    assert kernels_used(liger, {}, enable_fused_loss(adapted, zero_stage=0)) == (
        "liger (layers: torch (liger's layer kernels run on CUDA only); loss: torch, chunked: the output layer is "
        "a Linear, not a plain linear layer (adapters on it, or a bias))"
    )
    assert not fused_loss_installed(adapted.get_base_model())
    assert kernels_used(OmegaConf.create({"kernels": "torch"}), {}, None) == "torch"


def test_at_zero_3_the_output_layer_is_gathered_for_the_models_own_passes(model_dirs):
    """The fused loss reads the output layer's weight in the model's forward (launcher.model.logps), not the
    layer's: ZeRO-3 gathers it there once it is the model's external parameter (the whole job: test_trainer)."""
    model, _, _ = loaded(model_dirs, "tiny_qwen2_vl")
    liger = OmegaConf.create({"kernels": "liger"})
    assert kernels_used(liger, {}, enable_fused_loss(model, zero_stage=2)).endswith("loss: fused linear cross-entropy)")
    assert not getattr(model, "_external_params", None)
    assert kernels_used(liger, {}, enable_fused_loss(model, zero_stage=3)).endswith("loss: fused linear cross-entropy)")
    assert list(model._external_params.values()) == [model.get_output_embeddings().weight]


@pytest.mark.parametrize("arch", ARCHES)
def test_the_layer_kernels_patch_every_norm_mlp_and_the_rotary_embedding(model_dirs, arch, monkeypatch):
    """On CUDA (named here; nothing runs): each RMSNorm and SiLU-gated MLP of the language model, each LayerNorm
    of the vision tower, and the family's rotary function. Their forwards are liger's from then on; the
    parameters are the same objects."""
    model, _, _ = loaded(model_dirs, arch)
    language = model.model.language_model
    family = sys.modules[type(language).__module__]
    monkeypatch.setattr(family, "apply_rotary_pos_emb", family.apply_rotary_pos_emb)  # restored after the test
    before = {name: id(p) for name, p in model.named_parameters()}
    layers = language.config.num_hidden_layers
    vision = model.model.vision_tower if arch == "tiny_llava" else model.model.visual
    layer_norms = sum(isinstance(m, torch.nn.LayerNorm) for m in vision.modules())
    assert layer_norms >= 2

    counts = apply_liger_layers(model, "cuda")
    assert counts == {"rms_norm": 2 * layers + 1, "swiglu": layers, "layer_norm": layer_norms, "rope": 1}
    assert type(language.layers[0].mlp.forward.__self__) is type(language.layers[0].mlp)
    assert language.layers[0].mlp._get_name() == "LigerSwiGLUMLP"
    assert language.norm.forward.__func__.__qualname__ == "LigerRMSNorm.forward"
    assert family.apply_rotary_pos_emb.__module__ == "liger_kernel.transformers.rope"
    assert {name: id(p) for name, p in model.named_parameters()} == before
    assert apply_liger_layers(model, "cpu") == {}


def test_liger_where_it_cannot_run_is_refused_in_one_line(monkeypatch):
    liger = OmegaConf.create({"kernels": "liger", "compile": False})
    check_kernels(liger, "cpu", launching=True)  # Triton's interpreter (this test machine)
    check_kernels(liger, "cpu", launching=False)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(LauncherError, match=r"^model.kernels=liger runs Triton kernels, which need a CUDA device "
                       r"\(this job runs on cpu\): use model.kernels=torch$"):  # fmt: skip
        check_kernels(liger, "cpu", launching=True)
    check_kernels(liger, "cpu", launching=False)  # a dry run plans for another machine
    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: None)  # as where it is not installed
    with pytest.raises(LauncherError, match=r"needs the liger-kernel package, which is not installed \(pip install"):
        check_kernels(liger, "cuda", launching=True)
    with pytest.raises(LauncherError, match=r"model\.compile=true and model\.kernels=liger both fuse"):
        check_kernels(OmegaConf.create({"kernels": "liger", "compile": True}), "cuda", launching=False)
    check_kernels(OmegaConf.create({"kernels": "torch", "compile": True}), "cpu", launching=True)


@pytest.mark.parametrize(
    ("hub_id", "expected"),
    [
        # 28 language layers (2 RMSNorms each, + the final one; 28 gated MLPs); 32 vision blocks of 2 LayerNorms,
        # + the merger's
        ("Qwen/Qwen2-VL-2B-Instruct", {"rms_norm": 57, "swiglu": 28, "layer_norm": 65, "rope": 1}),
        # 28 language layers; 32 vision blocks of 2 RMSNorms and a gated MLP, + the merger's RMSNorm
        ("Qwen/Qwen2.5-VL-7B-Instruct", {"rms_norm": 122, "swiglu": 60, "layer_norm": 0, "rope": 1}),
        # 32 language layers; CLIP-L's 24 layers of 2 LayerNorms, + its pre- and post-LayerNorm
        ("llava-hf/llava-1.5-7b-hf", {"rms_norm": 65, "swiglu": 32, "layer_norm": 50, "rope": 1}),
    ],
)
def test_the_real_presets_get_every_layer_kernel(hub_id, expected, monkeypatch):
    """The released architectures (their shipped configs, on the meta device: nothing allocated)."""
    from transformers import AutoModelForImageTextToText

    from launcher.model.loading import read_config

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(read_config(hub_id))
    family = sys.modules[type(model.model.language_model).__module__]
    monkeypatch.setattr(family, "apply_rotary_pos_emb", family.apply_rotary_pos_emb)  # restored after the test
    assert apply_liger_layers(model, "cuda") == expected
