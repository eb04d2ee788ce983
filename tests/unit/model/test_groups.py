"""launcher.model.groups: which trainable parameter each group holds (Qwen2-VL's projector inside its
vision module, LoRA's adapters, the output head), and the optimizer groups built from them."""

from __future__ import annotations

from launcher.config.groups import GroupSpec
from launcher.model.groups import assign, optimizer_groups
from launcher.model.method import apply_method
from launcher.model.stats import frozen_meta_model
from tests.helpers import compose_typed


def meta(*overrides: str):
    config = compose_typed(list(overrides))
    model = frozen_meta_model(config)
    return apply_method(model, config.method, config.model) if str(config.method.name) == "lora" else model


def test_qwen2_vl_s_projector_is_its_own_part_inside_the_vision_module():
    held = assign(meta("model=tiny_qwen2_vl"), [GroupSpec("vision", lr=0.0), GroupSpec("projector", lr=1.0)])
    assert held["projector"] and all(name.startswith("model.visual.merger.") for name, _ in held["projector"])
    assert held["vision"] and not any(".merger." in name for name, _ in held["vision"])
    assert all("visual" not in name for name, _ in held["default"])


def test_lora_s_adapters_are_a_part_of_their_own_and_the_head_is_the_language_models():
    held = assign(meta("method=lora"), [GroupSpec("adapters", lr=1e-4)])
    assert held["adapters"] and all(".lora_" in name for name, _ in held["adapters"])
    assert all(".lora_" not in name for name, _ in held["default"])  # what LoRA trains in full (the projector)
    held = assign(meta(), [GroupSpec("language", lr=1e-4)])
    assert "lm_head.weight" in [name for name, _ in held["language"]]


def test_biases_and_norm_weights_skip_weight_decay_unless_asked():
    model = meta("model=tiny_qwen2_vl")
    groups, described = optimizer_groups(model, [], lr=1e-3, weight_decay=0.1, decay_norms_and_biases=False)
    assert [(group.name, group.weight_decay) for group in described] == [("default", 0.1), ("default.no_decay", 0.0)]
    undecayed = {id(p) for p in groups[1]["params"]}
    for name, parameter in model.named_parameters():  # Qwen2-VL's 1-D weights are its biases and norms
        assert (id(parameter) in undecayed) == (parameter.dim() == 1), name
    _, described = optimizer_groups(model, [], lr=1e-3, weight_decay=0.1, decay_norms_and_biases=True)
    assert [(group.name, group.weight_decay) for group in described] == [("default", 0.1)]
    _, described = optimizer_groups(model, [], lr=1e-3, weight_decay=None, decay_norms_and_biases=False)
    assert [(group.name, group.weight_decay) for group in described] == [("default", None)]  # the optimizer's own
    assert sum(group.params for group in described) == sum(p.numel() for p in model.parameters())
