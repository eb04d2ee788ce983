"""launcher.model.method: which modules get LoRA adapters, what trains in full, what the planner counts, and
where method=qlora cannot run.

Checked on the real tiny models built on the meta device (the same build the launcher checks before any
rank starts) and with peft itself: no training here (the LoRA end-to-end tests train)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from launcher.config.ranges import check_config
from launcher.core.errors import LauncherError
from launcher.model.method import (
    _compact_alternation,
    apply_method,
    check_method,
    modules_to_save,
    qlora_problem,
    target_regex,
    trainable_components,
)
from launcher.model.stats import frozen_meta_model as meta_model
from launcher.model.stats import model_stats
from tests.helpers import compose_typed


def matched(model: nn.Module, pattern: str) -> list[str]:
    return [name for name, _ in model.named_modules() if name and re.fullmatch(pattern, name)]


@pytest.fixture(scope="module")
def llava_cfg():
    return compose_typed(["method=lora"])


@pytest.fixture(scope="module")
def llava(llava_cfg):
    return meta_model(llava_cfg)


def test_all_linear_adapts_every_language_linear_layer_and_nothing_else(llava, llava_cfg):
    names = matched(llava, target_regex(llava, llava_cfg.method, llava_cfg.model))
    language_linears = [
        name
        for name, module in llava.named_modules()
        if isinstance(module, nn.Linear) and name.startswith("model.language_model.")
    ]
    assert names == language_linears
    assert len(names) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
    assert not any("lm_head" in n or "vision" in n or "projector" in n for n in names)


def test_include_vision_adds_the_vision_tower_but_never_the_projector():
    for model_name, projector in (("tiny_llava", "multi_modal_projector"), ("tiny_qwen2_vl", "merger")):
        cfg = compose_typed(["method=lora", f"model={model_name}", "method.include_vision=true"])
        model = meta_model(cfg)
        names = matched(model, target_regex(model, cfg.method, cfg.model))
        assert any(".vision_tower." in n or ".visual." in n for n in names), model_name
        assert not any(projector in n for n in names), model_name


def test_layer_names_and_regex_forms(llava, llava_cfg):
    cfg = compose_typed(["method=lora", "method.target_modules=[q_proj,v_proj]"])
    names = matched(llava, target_regex(llava, cfg.method, cfg.model))
    assert len(names) == 4 and all(n.endswith(("q_proj", "v_proj")) for n in names)
    cfg = compose_typed(["method=lora", r"method.target_regex=.*layers\.1\.mlp\.down_proj"])
    assert matched(llava, target_regex(llava, cfg.method, cfg.model)) == ["model.language_model.layers.1.mlp.down_proj"]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["method.target_modules=[qproj]"], "method.target_modules=['qproj']"),
        (["method.target_regex=nothing.here"], "method.target_regex='nothing.here'"),
        (["model.freeze_language=true"], "model.freeze_language=True"),
        (["method.target_modules=[all-linear,q_proj]"], "all-linear stands alone"),
    ],
)
def test_targets_that_match_nothing_are_one_line_naming_the_key(llava, overrides, named):
    cfg = compose_typed(["method=lora", *overrides])
    with pytest.raises(LauncherError) as err:
        target_regex(llava, cfg.method, cfg.model)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_modules_to_save_resolves_aliases_and_freezing_wins(llava):
    cfg = compose_typed(["method=lora"])
    assert modules_to_save(llava, cfg.method, cfg.model) == ["model.multi_modal_projector"]
    cfg = compose_typed(["method=lora", "model.freeze_projector=true"])
    assert modules_to_save(llava, cfg.method, cfg.model) == []
    cfg = compose_typed(["method=lora", "method.modules_to_save=[lm_head]"])
    assert modules_to_save(llava, cfg.method, cfg.model) == ["lm_head"]
    cfg = compose_typed(["method=lora", "method.modules_to_save=[no_such_module]"])
    with pytest.raises(LauncherError, match=re.escape("method.modules_to_save: 'no_such_module' is no module")):
        modules_to_save(llava, cfg.method, cfg.model)


def test_peft_model_trains_adapters_and_the_projector_only(llava_cfg):
    model = meta_model(llava_cfg)
    peft_model = apply_method(model, llava_cfg.method, llava_cfg.model)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("multi_modal_projector.modules_to_save" in n for n in trainable)
    assert trainable_components(peft_model) == {"language", "projector"}
    assert apply_method(model, compose_typed([]).method, llava_cfg.model) is model  # method=full


def test_compact_alternation_folds_layer_indices_only_when_exact():
    names = [f"m.layers.{i}.q_proj" for i in range(3)]
    assert _compact_alternation(names, names) == r"m\.layers\.\d+\.q_proj"
    assert _compact_alternation(names[:2], names) == r"m\.layers\.0\.q_proj|m\.layers\.1\.q_proj"


def test_qlora_needs_cuda_and_says_so_before_anything_starts():
    assert "needs a CUDA device" in qlora_problem("cpu")
    with pytest.raises(LauncherError, match="method=qlora cannot run here: 4-bit quantisation"):
        check_method(compose_typed(["method=qlora"]), "cpu")
    check_method(compose_typed(["method=qlora"]), "cpu", launching=False)  # a dry run plans for elsewhere


@pytest.mark.parametrize(
    ("override", "message"),
    [("method.r=0", "method.r=0"), ("method.alpha=0", "method.alpha=0"), ("method.dropout=1.0", "method.dropout=1.0")],
)
def test_lora_knobs_out_of_range(override, message):
    """The ranges of the LoRA knobs are launcher.config.ranges' now (check_method kept only qlora's device
    check): the same one line, from the one table of ranges; and only where adapters are used."""
    with pytest.raises(LauncherError, match=re.escape(message)):
        check_config(compose_typed(["method=lora", override]))
    check_method(compose_typed(["method=lora", override]), "cpu")  # not check_method's to refuse
    check_config(compose_typed(["method=full", override]))  # method=full has no adapters to range-check


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qlora_loads_a_4bit_base_stored_in_the_training_dtype(tmp_path):
    pytest.importorskip("bitsandbytes")
    from launcher.model.loading import load_model_and_processor
    from launcher.model.method import quantization_config
    from launcher.model.tiny import resolve_model_path

    cfg = compose_typed(["method=qlora", "precision=bf16"])
    words = [{"messages": [{"role": "assistant", "content": [{"type": "text", "text": "red circle"}]}]}]
    path = resolve_model_path(cfg.model, 0, tmp_path, words)
    model, _ = load_model_and_processor(
        path, quantization_config=quantization_config(cfg.method, "bf16"), device_map={"": 0}
    )
    peft_model = apply_method(model, cfg.method, cfg.model)
    quantized = [m for m in peft_model.modules() if type(m).__name__ == "Linear4bit"]
    assert quantized and all(m.weight.dtype == torch.bfloat16 for m in quantized)


def test_the_plan_drops_deepspeeds_full_finetune_estimate_for_adapters():
    """DeepSpeed's estimators assume every parameter trains: with LoRA they would mislead, so none is shown."""
    from launcher.plan.memory import layout_from_ds_config
    from launcher.plan.report import deepspeed_reference

    layout = layout_from_ds_config(
        {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1},
        world_size=1,
        ranks_per_node=1,
    )
    assert deepspeed_reference(model_stats(compose_typed(["method=lora", "precision=bf16"])), layout) is None
    assert deepspeed_reference(model_stats(compose_typed(["precision=bf16"])), layout) is not None  # method=full


@pytest.mark.slow  # not training, but the report composes and estimates every preset variant (~21 compositions)
def test_the_plan_names_the_method():
    from launcher.plan.report import report

    overrides = ["method=lora", "deepspeed=z3", "precision=bf16"]
    first = report(compose_typed(overrides), overrides).splitlines()[0]
    assert first.startswith("model tiny_llava: ") and first.endswith("M trainable (method=lora)")


def test_a_target_regex_that_does_not_compile_is_one_line(llava):
    cfg = compose_typed(["method=lora"])
    cfg.method.target_regex = "layers.(0"
    with pytest.raises(LauncherError, match=re.escape("method.target_regex='layers.(0' is not a regular expression")):
        target_regex(llava, cfg.method, cfg.model)


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_a_freeze_flag_wins_over_a_target_regex_and_modules_to_save(arch):
    """model.freeze_vision=true: a regex matching q_proj/v_proj everywhere adapts only the language model's;
    a regex matching only the vision tower, or modules_to_save naming it or a layer in it, is refused."""
    frozen = ["method=lora", f"model.arch={arch}", "model.freeze_vision=true"]
    model = meta_model(compose_typed([f"model.arch={arch}", "method=lora"]))
    regex = r"method.target_regex='.*\.(q_proj|v_proj|qkv)'"  # quoted: Hydra's grammar reads ( and |
    loose = compose_typed(["method=lora", f"model.arch={arch}", regex])
    vision_path = "model.vision_tower" if arch == "tiny_llava" else "model.visual"
    assert any(n.startswith(vision_path + ".") for n in matched(model, target_regex(model, loose.method, loose.model)))
    cfg = compose_typed([*frozen, regex])
    names = matched(model, target_regex(model, cfg.method, cfg.model))
    assert names and all(n.startswith("model.language_model.") for n in names), names
    blocks = re.escape(vision_path + ("" if arch == "tiny_llava" else ".blocks"))  # Qwen2-VL's merger: the projector
    only_vision = compose_typed([*frozen, rf"method.target_regex='{blocks}\..*'"])
    with pytest.raises(LauncherError, match=r"matches only modules of frozen components \(model.freeze_vision=true\)"):
        target_regex(model, only_vision.method, only_vision.model)
    tower = vision_path.rsplit(".", 1)[1]
    layer = next(n for n, m in model.named_modules() if n.startswith(vision_path + ".") and isinstance(m, nn.Linear))
    for entry in (tower, layer):
        cfg = compose_typed([*frozen, f"method.modules_to_save=[{entry}]"])
        with pytest.raises(LauncherError, match=r"would train the frozen vision in full \(model.freeze_vision=true\)"):
            modules_to_save(model, cfg.method, cfg.model)
    # the projector stays trainable beside a frozen tower (Qwen2-VL's merger lies inside model.visual)
    default = compose_typed(frozen)
    assert modules_to_save(model, default.method, default.model) == [
        "model.multi_modal_projector" if arch == "tiny_llava" else "model.visual.merger"
    ]
