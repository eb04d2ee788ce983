"""liger-kernel's fused Triton kernels in training (model.kernels=liger).

What they replace, and why each pays on a GPU:
  - the loss: the output layer and the cross-entropy in one pass over chunks of positions, each chunk's
    logits made, reduced and turned into gradients at once (liger's fused linear cross-entropy). The torch
    path (launcher.model.logps) keeps at most one chunk's logits too, but makes them twice (forward, then
    the backward's recomputation) and writes them out in fp32 between separate kernels;
  - the language model's RMSNorms, its gated MLPs' SiLU-and-product, and the rotary embedding: one kernel
    each instead of several round trips through memory;
  - the vision tower's LayerNorms (Qwen2-VL's blocks, CLIP's layers), or its RMSNorms and gated MLPs
    (Qwen2.5-VL's).
The attention is not liger's concern: model.attn_implementation picks its kernel.

Modules are patched in place, their parameters untouched (what liger's own `apply_liger_kernel_to_*` do to
a loaded model, without their model-wide forwards: liger-kernel 0.8.5's Qwen2-VL patch imports an output
class transformers 5.24 no longer has, and its rotary patch targets a function 5.24 no longer calls). The
rotary embedding is the one module-level function: `apply_rotary_pos_emb` of the language model's module,
for every model of that family the process builds afterwards (a rank builds one).

Where each runs: the layer kernels on CUDA only. The fused loss on CUDA, and under Triton's interpreter
(TRITON_INTERPRET=1) on a CPU, which is how the tests check it here against the torch path; liger's layer
kernels do not run in the interpreter (it leaves their float arguments Python floats). The fused loss reads
the output layer's weight outside the layer's forward: at ZeRO-3 that weight is registered as an external
parameter of the model, so DeepSpeed gathers it for the model's forward and backward passes; LoRA on the
output layer would be bypassed, so there the loss stays the torch path and the summary says so.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import torch
from torch import nn

from launcher.core.errors import LauncherError
from launcher.model.components import base_model, model_components

INSTALL = "pip install 'liger-kernel==0.8.5' (or the project's extra: pip install -e '.[liger]')"
# Set on the model (before peft and DeepSpeed wrap it) when the answers' log-probs go through liger's loss.
FUSED_LOSS = "_liger_fused_loss"


def triton_interpreted() -> bool:
    """Triton runs its kernels in its interpreter, on the CPU (TRITON_INTERPRET=1): slow, for tests."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def kernels_problem(device_kind: str) -> str | None:
    """Why model.kernels=liger cannot run on this machine; None when it can."""
    if importlib.util.find_spec("liger_kernel") is None:
        return f"needs the liger-kernel package, which is not installed ({INSTALL})"
    if device_kind != "cuda" and not triton_interpreted():
        return f"runs Triton kernels, which need a CUDA device (this job runs on {device_kind})"
    return None


def check_kernels(model_cfg: Any, device_kind: str, *, launching: bool) -> None:
    """model.kernels=liger where it can run, and not with model.compile (both replace the same MLPs and norms;
    compiling around liger's kernels would trace into its autograd functions)."""
    if str(model_cfg.kernels) != "liger":
        return
    if model_cfg.compile:
        raise LauncherError(
            "model.compile=true and model.kernels=liger both fuse each layer's MLP and norms; choose one: "
            "model.compile=false (liger's kernels) or model.kernels=torch (compiled torch)"
        )
    if launching and (problem := kernels_problem(device_kind)):
        raise LauncherError(f"model.kernels=liger {problem}: use model.kernels=torch")


def apply_liger_layers(model: nn.Module, device_kind: str) -> dict[str, int]:
    """Patch, in place, the norms, gated MLPs and rotary embedding of `model` (a transformers model, before
    peft wraps it) with liger's kernels; the count of each part patched. Nothing on a device other than CUDA."""
    if device_kind != "cuda":
        return {}
    from liger_kernel.transformers.monkey_patch import (
        _patch_layer_norm_module,
        _patch_rms_norm_module,
        _patch_swiglu_module,
    )
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    parts = model_components(base_model(model))
    counts = {"rms_norm": 0, "swiglu": 0, "layer_norm": 0, "rope": 0}
    language, vision = parts["language"][0], parts["vision"][0]
    for part in (language, vision):  # Qwen2.5-VL's vision tower has RMSNorms and gated MLPs too
        for module in part.modules():
            if type(module).__name__.endswith("RMSNorm"):
                _patch_rms_norm_module(module, eps=_epsilon(module))
                counts["rms_norm"] += 1
            elif isinstance(module, nn.LayerNorm) and module.elementwise_affine and module.bias is not None:
                _patch_layer_norm_module(module, eps=module.eps)
                counts["layer_norm"] += 1
            elif _is_silu_gated_mlp(module, part.config):
                _patch_swiglu_module(module, LigerSwiGLUMLP)
                counts["swiglu"] += 1
    family = sys.modules[type(language).__module__]
    if getattr(family, "apply_rotary_pos_emb", None) is not None:
        family.apply_rotary_pos_emb = liger_rotary_pos_emb
        counts["rope"] = 1
    return counts


def _epsilon(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6)


def _is_silu_gated_mlp(module: nn.Module, config: Any) -> bool:
    """A gated MLP (gate, up and down projections) whose activation is SiLU: what LigerSwiGLUMLP computes."""
    names = ("gate_proj", "up_proj", "down_proj")
    projections = all(isinstance(getattr(module, name, None), nn.Module) for name in names)
    return projections and str(getattr(config, "hidden_act", "")) in ("silu", "swish")


def fused_loss_problem(model: nn.Module) -> str | None:
    """Why the answers' loss cannot go through liger's fused linear cross-entropy for this model as it trains
    (after peft); None when it can."""
    head = base_model(model).get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return f"the output layer is a {type(head).__name__}, not a plain linear layer (adapters on it, or a bias)"
    return None


def use_fused_loss(model: nn.Module) -> None:
    base_model(model).__dict__[FUSED_LOSS] = True


def fused_loss_installed(model: nn.Module) -> bool:
    return bool(getattr(model, FUSED_LOSS, False))


def fused_answer_logps(
    head: nn.Linear, picked: torch.Tensor, wanted: torch.Tensor, rows: torch.Tensor, n_rows: int, *, total: bool
) -> torch.Tensor:
    """The answers' log-probabilities through liger's fused linear cross-entropy, in fp32: each row's sum
    [n_rows], or (`total`) their sum [1]. `picked` [n, width]: the hidden states of positions whose next token
    is labelled; `wanted` [n]: those tokens; `rows` [n]: the row of each.

    The total (SFT) is liger's fast path ("sum"): the gradients are made in the forward, chunk by chunk, so no
    logits are kept or made again. Per row (the preference losses) it is "none", whose backward makes each
    chunk's logits again to fold in every token's own gradient. The output layer's gradient is summed over
    the chunks in fp32 (accum_dtype), then cast to the weight's dtype."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    if len(wanted) == 0:  # liger divides by the token count; zeros that still reach the model's graph
        nothing = (picked.sum() + head.weight.sum()).float() * 0.0
        return nothing.reshape(1) if total else nothing.expand(n_rows).clone()
    if total:
        summed = liger_fused_linear_cross_entropy(
            picked, head.weight, wanted, reduction="sum", accum_dtype=torch.float32
        )
        return -summed.float().reshape(1)
    losses = liger_fused_linear_cross_entropy(picked, head.weight, wanted, reduction="none", accum_dtype=torch.float32)
    token_logps = -losses.float()
    return torch.zeros(n_rows, dtype=token_logps.dtype, device=token_logps.device).index_add(
        0, rows.to(token_logps.device), token_logps
    )


def enable_fused_loss(model: nn.Module, *, zero_stage: int) -> str | None:
    """Switch the answers' loss of `model` (as it trains, after peft) to liger's fused linear cross-entropy where
    it can read the output layer; why not, else None. At ZeRO-3 the layer's weight becomes the model's external
    parameter, so DeepSpeed gathers it for the model's own forward and backward passes, where the loss reads it."""
    if problem := fused_loss_problem(model):
        return problem
    if zero_stage == 3:
        import deepspeed

        base = base_model(model)
        deepspeed.zero.register_external_parameter(base, base.get_output_embeddings().weight)
    use_fused_loss(model)
    return None


def kernels_used(model_cfg: Any, layers: dict[str, int], loss_problem: str | None) -> str:
    """What model.kernels gave the model as it trains, in words for the summary and the log: the layers
    patched (`apply_liger_layers`) and where the loss went (`enable_fused_loss`'s answer)."""
    if str(model_cfg.kernels) != "liger":
        return "torch"
    patched = ", ".join(f"{part} x{count}" for part, count in layers.items() if count)
    layer_words = f"layers: {patched}" if patched else "layers: torch (liger's layer kernels run on CUDA only)"
    if loss_problem:
        return f"liger ({layer_words}; loss: torch, chunked: {loss_problem})"
    return f"liger ({layer_words}; loss: fused linear cross-entropy)"
