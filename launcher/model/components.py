"""A vision-language model's parts (vision tower, projector, language model): found, counted, frozen,
checkpointed. Works on LLaVA's and Qwen2-VL's layouts, on the meta device and under ZeRO-3.
"""

from __future__ import annotations

from torch import nn

from launcher.core.errors import LauncherError


def base_model(model: nn.Module) -> nn.Module:
    """The model itself, under a peft wrapper (whose base holds the injected adapters) or not."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_components(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The model's vision encoder, projector and language model (decoder + lm_head), as module lists.

    LLaVA: model.vision_tower / model.multi_modal_projector / model.language_model + lm_head.
    Qwen2-VL: model.visual (whose `merger` is the projector) / model.language_model + lm_head.
    """
    inner = getattr(model, "model", model)
    vision = _first_attribute(inner, "vision_tower", "visual")
    projector = _first_attribute(inner, "multi_modal_projector") or _first_attribute(vision, "merger")
    language = _first_attribute(inner, "language_model")
    if vision is None or projector is None or language is None:
        raise LauncherError(
            f"{type(model).__name__}: cannot find its vision tower, projector and language model "
            "(known layouts: LLaVA, Qwen2-VL)"
        )
    language_modules = [language]
    if (head := model.get_output_embeddings()) is not None:
        language_modules.append(head)
    return {"vision": [vision], "projector": [projector], "language": language_modules}


def _first_attribute(module: nn.Module | None, *names: str) -> nn.Module | None:
    for name in names:
        if isinstance(found := getattr(module, name, None), nn.Module):
            return found
    return None


# peft keeps a module it trains in full beside LoRA (modules_to_save: the projector) twice: the frozen
# original, which the forward no longer reads, and the trained copy. The model's parameters count the copy
# alone; the memory planner counts both (both are held).
_REPLACED = "original_module."


def _parameters(
    modules: list[nn.Module], exclude: set[int] = frozenset(), *, replaced: bool = True
) -> dict[int, nn.Parameter]:
    return {
        id(p): p
        for module in modules
        for name, p in module.named_parameters()
        if id(p) not in exclude and (replaced or _REPLACED not in name)
    }


def _numel(parameter: nn.Parameter) -> int:
    # Under ZeRO-3 a partitioned parameter is empty locally; DeepSpeed keeps the full size in ds_numel.
    return int(getattr(parameter, "ds_numel", parameter.numel()))


def apply_freeze(
    model: nn.Module, *, vision: bool, projector: bool, language: bool, replaced: bool = True
) -> dict[str, int]:
    """Freeze the chosen components (requires_grad=False) and return parameter counts.

    Returns {"vision", "projector", "language", "trainable", "total"}; a parameter shared between
    components (tied embeddings) is counted once, in the first component that holds it. `replaced`: count
    the frozen originals peft keeps beside a module it trains in full (memory held, not computed with).
    """
    freeze = {"vision": vision, "projector": projector, "language": language}
    counts: dict[str, int] = {}
    seen: set[int] = set()
    # The projector first: for Qwen2-VL it sits inside the vision module and must not count as vision.
    for name, modules in sorted(model_components(model).items(), key=lambda item: item[0] != "projector"):
        parameters = _parameters(modules, exclude=seen, replaced=replaced)
        seen.update(parameters)
        counts[name] = sum(_numel(p) for p in parameters.values())
        if freeze[name]:
            for parameter in parameters.values():
                parameter.requires_grad_(False)
    unique = _parameters([model], replaced=replaced)
    counts["trainable"] = sum(_numel(p) for p in unique.values() if p.requires_grad)
    counts["total"] = sum(_numel(p) for p in unique.values())
    return {key: counts[key] for key in ("vision", "projector", "language", "trainable", "total")}


def component_parameter_counts(model: nn.Module, *, replaced: bool = False) -> dict[str, int]:
    """Parameter counts per component, as `apply_freeze` returns them, without freezing anything."""
    return apply_freeze(model, vision=False, projector=False, language=False, replaced=replaced)


def enable_gradient_checkpointing(model: nn.Module, *, language: bool, vision: bool) -> list[str]:
    """Checkpoint the layers of the language model and/or the vision tower; return the parts enabled.

    Non-reentrant (`use_reentrant=False`): a checkpointed layer keeps only its inputs and recomputes its
    activations in the backward pass. Unlike the reentrant kind, it passes gradients to parameters
    inside a layer whose inputs need none, so frozen embeddings, a frozen vision tower and LoRA
    adapters on a frozen base need no `enable_input_require_grads` hook (transformers adds one for
    the language model; it is removed again). Works on a peft model as on the model it wraps.
    """
    base = base_model(model)
    parts = model_components(base)
    enabled = []
    for name, wanted, key in (
        ("language", language, "model.gradient_checkpointing"),
        ("vision", vision, "model.vision_gradient_checkpointing"),
    ):
        if not wanted:
            continue
        module = parts[name][0]
        if not getattr(module, "supports_gradient_checkpointing", False):
            raise LauncherError(
                f"{key}=true: {type(module).__name__} ({name}) does not support gradient checkpointing; set {key}=false"
            )
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        module.disable_input_require_grads()
        enabled.append(name)
    return enabled


def compile_layers(model: nn.Module) -> list[str]:
    """torch.compile, in place, the MLP and the norms of every transformer layer (language model and vision
    tower; model.compile); return the compiled modules' names.

    What compilation buys is fusion: a gated MLP's activation and product, a norm's reductions and scaling,
    each one kernel instead of several round trips through memory. The attention is left as it is: it is one
    fused kernel already (sdpa, flash, varlen), and its packed path loops over a row's records, which a
    compiled graph would specialise on, compiling again for every packing. Each module is compiled with
    dynamic token counts (`dynamic=None`: automatic after the first shape), and every layer of a stack runs
    the same code, so a stack costs one compilation, paid in the first steps. Works on a peft model as on
    the model it wraps (its adapters inside the MLP are traced with it)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    compiled = []
    for name, module in base_model(model).named_modules():
        if not isinstance(module, GradientCheckpointingLayer):
            continue
        for child_name, child in module.named_children():
            if child_name == "mlp" or "norm" in child_name.lower():
                child.compile()
                compiled.append(f"{name}.{child_name}")
    return compiled
