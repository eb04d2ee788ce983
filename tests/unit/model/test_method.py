"""launcher.model.method: which modules get LoRA adapters, what trains in full, what the planner counts,
where method=qlora cannot run, and what its 4-bit load leaves unquantised.

Checked on the real tiny models built on the meta device (the same build the launcher checks before any
rank starts) and with peft itself; QLoRA's 4-bit load and one backward pass on the CPU (bitsandbytes); no
training here (the LoRA and QLoRA end-to-end tests train)."""

from __future__ import annotations

import re

import pytest
import torch
from PIL import Image
from torch import nn
from transformers import AutoModelForImageTextToText

from launcher.config.ranges import check_config
from launcher.core.errors import LauncherError
from launcher.model.method import (
    _compact_alternation,
    apply_method,
    check_method,
    modules_to_save,
    parameter_counts,
    qlora_problem,
    target_regex,
    tiny_base_task,
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
    before = parameter_counts(model)  # peft injects the adapters into `model` itself
    peft_model = apply_method(model, llava_cfg.method, llava_cfg.model)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or "modules_to_save" in n for n in trainable)
    assert any("multi_modal_projector.modules_to_save" in n for n in trainable)
    assert trainable_components(peft_model) == {"language", "projector"}
    # The projector counts once: its trained copy, not also peft's frozen original beside it (issue 44).
    after = parameter_counts(peft_model)
    assert after["projector"] == before["projector"] and after["vision"] == before["vision"]
    adapters = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    assert after["total"] == before["total"] + adapters
    assert after["trainable"] == adapters + before["projector"]
    assert apply_method(model, compose_typed([]).method, llava_cfg.model) is model  # method=full


def test_compact_alternation_folds_layer_indices_only_when_exact():
    names = [f"m.layers.{i}.q_proj" for i in range(3)]
    assert _compact_alternation(names, names) == r"m\.layers\.\d+\.q_proj"
    assert _compact_alternation(names[:2], names) == r"m\.layers\.0\.q_proj|m\.layers\.1\.q_proj"


def test_qlora_runs_where_bitsandbytes_has_4bit_layers_and_says_so_before_anything_starts(monkeypatch):
    pytest.importorskip("bitsandbytes")  # a dev install has it (pyproject's qlora extra)
    assert qlora_problem("cpu") is None and qlora_problem("cuda") is None  # bitsandbytes >= 0.48 on a CPU too
    assert "needs a CUDA device or a CPU, and this machine has mps" in qlora_problem("mps")
    with pytest.raises(LauncherError, match="method=qlora cannot run here: 4-bit quantisation"):
        check_method(compose_typed(["method=qlora"]), "mps")
    check_method(compose_typed(["method=qlora"]), "mps", launching=False)  # a dry run plans for elsewhere
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.47.0")
    assert "bitsandbytes 0.47.0 runs 4-bit layers on CUDA only" in qlora_problem("cpu")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # an install without the qlora extra
    assert "the bitsandbytes package is not installed" in qlora_problem("cuda")


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


def qlora_model(arch: str, tmp_path, keep: list[str] | None):
    """A tiny model of `arch` loaded in 4 bits as a QLoRA run loads it (bf16 storage), on the CPU, with
    peft's adapters and the projector's trainable copy; and its processor."""
    from launcher.model.loading import load_model_and_processor, read_config
    from launcher.model.method import keep_4bit_layout, kept_unquantized, quantization_config
    from launcher.model.tiny import resolve_model_path

    cfg = compose_typed(["method=qlora", "precision=bf16", f"model.arch={arch}"])
    words = [{"messages": [{"role": "assistant", "content": [{"type": "text", "text": "red circle"}]}]}]
    path = resolve_model_path(cfg.model, 0, tmp_path, words)
    if keep is None:
        with torch.device("meta"):
            keep = kept_unquantized(AutoModelForImageTextToText.from_config(read_config(path)), cfg.method, cfg.model)
    config = quantization_config(cfg.method, "bf16", keep=keep)
    model, processor = load_model_and_processor(path, quantization_config=config, device_map={"": "cpu"})
    keep_4bit_layout(model)
    return apply_method(model, cfg.method, cfg.model), processor, keep


def backward_once(model, processor) -> None:
    """One loss on one image and its answer, backwards."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "red circle"}]}]
    batch = processor(
        text=[processor.apply_chat_template(messages)], images=[Image.new("RGB", (32, 32), "red")], return_tensors="pt"
    )
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
    model(**batch, labels=batch["input_ids"]).loss.backward()


@pytest.mark.parametrize(("arch", "projector"), [("tiny_llava", "multi_modal_projector"), ("tiny_qwen2_vl", "merger")])
def test_qlora_quantises_the_frozen_base_only_and_every_trainable_weight_gets_a_gradient(arch, projector, tmp_path):
    """The cause of QLoRA's failure at ZeRO 2 and 3 on a GPU (DeepSpeed's gradient hooks found no gradient):
    the projector trained in full (method.modules_to_save) was loaded in 4 bits, and bitsandbytes' 4-bit
    matmul gives its weight no gradient; at ZeRO 0 it silently never learned. Now it loads unquantised.
    Runs on the CPU with bitsandbytes >= 0.48; the GPU suite trains it at ZeRO 2 and 3 on CUDA too."""
    pytest.importorskip("bitsandbytes")
    model, processor, keep = qlora_model(arch, tmp_path / "now", keep=None)
    assert any(name.endswith(projector) for name in keep) and "lm_head" in keep
    quantised = {name: m for name, m in model.named_modules() if type(m).__name__ == "Linear4bit"}
    assert quantised and all(m.weight.dtype == torch.bfloat16 for m in quantised.values())  # ZeRO-3 can partition
    assert not any(projector in name or "lm_head" in name for name in quantised)
    backward_once(model, processor)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert any(projector in name and "modules_to_save" in name for name in trainable)
    assert [name for name, p in trainable.items() if p.grad is None] == []

    # transformers' own choice of what to leave alone (the output head) quantises the projector: the defect.
    before, processor, _ = qlora_model(arch, tmp_path / "before", keep=["lm_head"])
    backward_once(before, processor)
    starved = [name for name, p in before.named_parameters() if p.requires_grad and p.grad is None]
    assert starved and all(projector in name and name.endswith(".weight") for name in starved), starved


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


@pytest.mark.parametrize(
    "overrides, task",
    [
        (["method=lora"], "colour"),  # the built-in data's shape question: the base knows colours
        (["method=qlora", "data.task=colour"], "shape"),
        (["method=lora", "loss=dpo", "data.pairs=true"], "colour"),
        (["method=full"], None),  # a full fine-tune trains the tiny model from its random weights
        (["method=lora", "model.tiny_base=random"], None),
        (["method=lora", "model.tiny_base=shape"], "shape"),  # asked for: even the job's own question
        (["method=full", "model.tiny_base=colour"], "colour"),
        (["method=lora", "data=llava_json", "data.path=x.json"], None),  # other data: other words
        (["method=lora", "model=qwen2_vl_2b"], None),  # not a tiny model
    ],
)
def test_a_tiny_base_is_pretrained_for_adapters_on_the_built_in_data_on_its_other_question(overrides, task):
    assert tiny_base_task(compose_typed(overrides)) == task


def test_a_tiny_base_for_a_model_that_is_not_tiny_is_refused_naming_the_key():
    with pytest.raises(LauncherError, match=r"model.tiny_base=shape sets a tiny model's starting weights"):
        check_config(compose_typed(["model=qwen2_vl_2b", "model.tiny_base=shape"]))
