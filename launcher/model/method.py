"""What a run trains: every weight (`method=full`), or LoRA adapters beside a frozen base (`method=lora`,
`method=qlora`: the base in 4 bits). Built on peft; this module only decides *which* modules.

    method.target_modules [all-linear]   every linear layer of the language model (the output head excluded)
    method.target_modules [q_proj,...]   those layer names, within the language model (and the vision tower
                                         with method.include_vision)
    method.target_regex                  a regular expression over full module names (peft's re.fullmatch)
    method.modules_to_save [projector]   trained in full beside the adapters and saved with them

The freeze flags keep their meaning for what is not adapted: `model.freeze_vision=true` keeps the vision
tower out of the adapters and out of modules_to_save, whatever the method says: a method.target_regex
adapts only what it matches outside the frozen components (and is refused when that is nothing), and a
module named in method.modules_to_save that lies in, or holds, a frozen component is refused.

The choices are turned into one regular expression over module names (peft's `target_modules` as a
string), so the adapter_config.json a run writes names exactly the modules it adapted, and a plain
`peft.PeftModel.from_pretrained` reproduces them. Everything here works on a model built on the meta
device too: the launcher checks the targets and counts the trainable parameters before any rank starts.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from typing import Any

from torch import nn

from launcher.config.schema import TRAINABLE, freeze_flags
from launcher.core.errors import LauncherError
from launcher.model.components import base_model, component_parameter_counts, model_components

ALL_LINEAR = "all-linear"
COMPONENTS = TRAINABLE


def uses_adapters(method: Any) -> bool:
    return str(method.name) in ("lora", "qlora")


def component_paths(model: nn.Module) -> dict[str, str]:
    """The module name of each component: {"vision": "model.vision_tower", "projector": ..., "language": ...}."""
    names = {id(module): name for name, module in model.named_modules()}
    return {component: names[id(modules[0])] for component, modules in model_components(model).items()}


def _linear_names(model: nn.Module, prefix: str, exclude: tuple[str, ...]) -> list[str]:
    """Full names of the linear layers under `prefix` (bitsandbytes' 4-bit layers are nn.Linear too)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and name.startswith(prefix + ".")
        and not any(name == e or name.startswith(e + ".") for e in exclude)
    ]


def target_regex(model: nn.Module, method: Any, model_cfg: Any) -> str:
    """The regular expression (peft `target_modules`) naming every module that gets an adapter.

    Raises LauncherError when it matches no module, naming the keys to change."""
    paths = component_paths(model)
    if method.target_regex:
        pattern = str(method.target_regex)
        try:
            re.compile(pattern)
        except re.error as err:
            raise LauncherError(f"method.target_regex={pattern!r} is not a regular expression ({err})") from None
    else:
        adapted = []
        if not model_cfg.freeze_language:
            adapted.append("language")
        if method.include_vision and not model_cfg.freeze_vision:
            adapted.append("vision")
        # The projector sits inside the vision module of some models (Qwen2-VL's visual.merger) and is
        # trained in full (modules_to_save) or not at all, never adapted.
        names = [name for part in adapted for name in _linear_names(model, paths[part], exclude=(paths["projector"],))]
        wanted = [str(t) for t in method.target_modules]
        if wanted != [ALL_LINEAR]:
            if ALL_LINEAR in wanted:
                raise LauncherError(
                    f"method.target_modules={wanted}: {ALL_LINEAR} stands alone; give it, or layer names"
                )
            names = [n for n in names if any(n == w or n.endswith("." + w) for w in wanted)]
        pattern = _compact_alternation(names, [name for name, _ in model.named_modules()])
    matched = [name for name, module in model.named_modules() if module is not model and re.fullmatch(pattern, name)]
    frozen = {part for part, frozen in freeze_flags(model_cfg).items() if frozen}
    if method.target_regex and matched and frozen:  # the freeze wins: no adapter inside a frozen component
        kept = [name for name in matched if component_of(name, paths) not in frozen]
        if not kept:
            flags = ", ".join(f"model.freeze_{c}=true" for c in sorted(frozen))
            raise LauncherError(
                f"method.target_regex={method.target_regex!r} matches only modules of frozen components ({flags}): "
                "nothing would train; widen the regex or unfreeze"
            )
        if kept != matched:
            pattern, matched = _compact_alternation(kept, [name for name, _ in model.named_modules()]), kept
    if not pattern or not matched:
        given = (
            f"method.target_regex={method.target_regex!r}"
            if method.target_regex
            else (
                f"method.target_modules={list(method.target_modules)}"
                f" (method.include_vision={method.include_vision}, model.freeze_language={model_cfg.freeze_language},"
                f" model.freeze_vision={model_cfg.freeze_vision})"
            )
        )
        example = _linear_names(model, paths["language"], exclude=())[:1]
        raise LauncherError(
            f"{given} matches no module of {type(model).__name__}: name linear layers such as "
            f"{example[0].rsplit('.', 1)[-1] if example else 'q_proj'} (their last name part), or all-linear"
        )
    return pattern


def _compact_alternation(names: list[str], all_names: list[str]) -> str:
    """A regular expression matching exactly `names` among `all_names`: layer indices folded into one
    digit class where that matches the same set (a 7B model's 224 names become one short line)."""
    exact = "|".join(re.escape(n) for n in names)
    folded = "|".join(dict.fromkeys(re.sub(r"\\\.\d+\\\.", lambda _: r"\.\d+\.", re.escape(n)) for n in names))
    if [n for n in all_names if re.fullmatch(folded, n)] == [n for n in all_names if re.fullmatch(exact, n)]:
        return folded
    return exact


def modules_to_save(model: nn.Module, method: Any, model_cfg: Any) -> list[str]:
    """Full names of the modules trained in full beside the adapters (component aliases resolved)."""
    paths = component_paths(model)
    frozen = {part for part, frozen in freeze_flags(model_cfg).items() if frozen}
    names = {name for name, _ in model.named_modules()}
    saved = []
    for entry in (str(m) for m in method.modules_to_save):
        if entry in COMPONENTS:
            if entry not in frozen:
                saved.append(paths[entry])
            continue
        found = [n for n in names if n == entry or n.endswith("." + entry)]
        if not found:
            raise LauncherError(
                f"method.modules_to_save: {entry!r} is no module of {type(model).__name__}; give projector, "
                "vision, language, or a module name"
            )
        # Trained in full, a module in (or holding) a frozen component would train it: the freeze wins, and
        # a name that says otherwise is refused (a component's own name is dropped above, as documented).
        touched = {c for c in frozen for n in found if paths[c] == n or paths[c].startswith(n + ".")}
        touched |= {component_of(n, paths) for n in found} & frozen
        if touched:
            first = sorted(touched)[0]
            raise LauncherError(
                f"method.modules_to_save: {entry!r} would train the frozen {first} in full "
                f"(model.freeze_{first}=true): drop it, or set model.freeze_{first}=false"
            )
        saved.append(entry)
    return saved


def component_of(name: str, paths: dict[str, str]) -> str | None:
    """The component a module belongs to: the one whose path is the longest prefix of its name (Qwen2-VL's
    projector, visual.merger, lies inside its vision module, visual); None for a module outside all."""
    owners = [c for c, path in paths.items() if name == path or name.startswith(path + ".")]
    return max(owners, key=lambda c: len(paths[c]), default=None)


def lora_config(model: nn.Module, method: Any, model_cfg: Any):
    from peft import LoraConfig

    return LoraConfig(
        r=int(method.r),
        lora_alpha=float(method.alpha),
        lora_dropout=float(method.dropout),
        target_modules=target_regex(model, method, model_cfg),
        modules_to_save=modules_to_save(model, method, model_cfg) or None,
        bias="none",
    )


def apply_method(model: nn.Module, method: Any, model_cfg: Any) -> nn.Module:
    """The model to train: `model` itself for method=full, a peft model with LoRA adapters otherwise.

    The freeze flags were applied to `model` before; peft freezes the rest of the base."""
    if not uses_adapters(method):
        return model
    from peft import get_peft_model

    config = lora_config(model, method, model_cfg)
    if str(method.name) == "qlora":
        from peft import prepare_model_for_kbit_training

        # Casts norms to fp32 for stability; gradient checkpointing is the launcher's own switch.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5.24 a deprecated question (is_gradient_checkpointing): not the user's concern.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def tiny_base_task(cfg: Any) -> str | None:
    """The built-in task a tiny model is pretrained on before the job trains it (model.tiny_base), or None:
    its random weights. auto pretrains for adapters on the built-in data, on the set's other question (a
    shape job's base answers colours; a colour job's, shapes), so `python train.py method=lora` shows
    what LoRA is for: a trained model learning a second task. A base pretrained on the job's own question
    would know the answer before the first step; one for other data would not know its words."""
    model = cfg.model
    choice = str(model.tiny_base)
    if str(model.source) != "tiny" or choice == "random":
        return None
    if choice != "auto":
        return choice
    if not uses_adapters(cfg.method) or not cfg.data.synthetic:
        return None
    return "colour" if str(cfg.data.task) == "shape" else "shape"


def adapters_on_random_base(cfg: Any) -> str | None:
    """The warning for adapters on a base with random weights (a tiny build not pretrained, a random build):
    they can only learn around noise, and the run looks broken (issue 44: `python train.py method=lora`,
    exact match 0.42)."""
    source = str(cfg.model.source)
    if not uses_adapters(cfg.method) or source == "pretrained" or tiny_base_task(cfg) is not None:
        return None
    return (
        f"method={cfg.method.name} on model.source={source}: the base's weights are random, so the adapters learn "
        "around noise; train a base first (python train.py), then give it: method=lora model.source=pretrained "
        "model.path=RUN_DIR/model (docs/models.md: a second task)"
    )


def check_method(cfg: Any, device_kind: str, *, launching: bool = True) -> None:
    """Refuse, before any rank starts, 4-bit loading where bitsandbytes cannot run (not for a dry run,
    which may plan for another machine). The LoRA knobs' ranges are launcher.config.ranges'."""
    method = cfg.method
    if launching and str(method.name) == "qlora" and (problem := qlora_problem(device_kind)):
        raise LauncherError(f"method=qlora cannot run here: {problem}; use method=lora (the same adapters)")
    if launching and str(method.name) == "qlora" and str(cfg.model.source) == "random":
        raise LauncherError(
            "method=qlora with model.source=random: 4-bit loading quantises a checkpoint's weights, and a random "
            "build has none; use method=lora (the same adapters) or a checkpoint (model.source=pretrained)"
        )


def check_adapter_targets(model: nn.Module, cfg: Any) -> None:
    """The adapter targets and modules_to_save name modules of `model` (built on the meta device)."""
    target_regex(model, cfg.method, cfg.model)
    modules_to_save(model, cfg.method, cfg.model)


def parameter_counts(model: nn.Module, *, held: bool = False) -> dict[str, int]:
    """Parameters per component, trainable and total, of a plain or a peft model (adapters included; `held`:
    peft's frozen original of a module it trains in full too, which memory holds but the forward skips)."""
    return component_parameter_counts(base_model(model), replaced=held)


def trainable_components(model: nn.Module) -> set[str]:
    """The components (vision, projector, language) holding a trainable parameter (an adapter counts)."""
    model = base_model(model)
    paths = component_paths(model)
    # The projector first: Qwen2-VL's sits inside its vision module. What lies under no component's
    # module (the output head) belongs to the language model.
    order = sorted(paths, key=lambda c: c != "projector")
    return {
        next((c for c in order if name.startswith(paths[c] + ".")), "language")
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    }


# bitsandbytes' first release whose 4-bit layers run on a CPU as well as on CUDA.
BNB_CPU_VERSION = (0, 48)


def qlora_problem(device_kind: str) -> str | None:
    """Why 4-bit loading cannot run here (None when it can): bitsandbytes' 4-bit layers run on CUDA, and on
    a CPU from bitsandbytes 0.48 on."""
    if device_kind not in ("cuda", "cpu"):
        return f"4-bit quantisation (bitsandbytes) needs a CUDA device or a CPU, and this machine has {device_kind}"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "the bitsandbytes package is not installed (pip install bitsandbytes)"
    if device_kind == "cpu":
        from importlib.metadata import version

        found = version("bitsandbytes")
        if tuple(int(part) for part in re.findall(r"\d+", found)[:2]) < BNB_CPU_VERSION:
            return f"bitsandbytes {found} runs 4-bit layers on CUDA only (0.48 and later run them on a CPU too)"
    return None


def kept_unquantized(model: nn.Module, method: Any, model_cfg: Any) -> list[str]:
    """Module names the 4-bit load leaves in the training dtype: what trains in full beside the adapters
    (modules_to_save), and transformers' own choices (the output head, tied weights).

    A module trained in full cannot be 4-bit: bitsandbytes' 4-bit matmul gives its weight no gradient, so
    peft's trainable copy of a quantised projector never learned at ZeRO 0 and broke ZeRO 2 and 3, whose
    gradient hooks found no gradient to reduce. `model`: the model to load, built on the meta device."""
    from transformers.quantizers.base import get_keys_to_not_convert

    return sorted(set(modules_to_save(model, method, model_cfg)) | set(get_keys_to_not_convert(model)))


def keep_4bit_layout(model: nn.Module) -> None:
    """Stop bitsandbytes repacking 4-bit weights for its CPU inference kernel (used where the CPU has
    AVX512-BF16): it rewrites `weight.data` in place at the first evaluation, and a ZeRO-3 parameter, whose
    data DeepSpeed swaps between its partition and the gathered whole, then fails at the next save."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def quantization_config(method: Any, precision: str, *, keep: list[str]):
    """bitsandbytes' 4-bit config for method=qlora, storing the packed weights in the training dtype and
    leaving the modules `keep` names (kept_unquantized) as they are.

    ZeRO-3 partitions parameters of a floating dtype only: packed uint8 storage would leave the base
    whole on every rank, so the storage dtype is the one the run trains in (bf16, else fp32/fp16)."""
    import torch
    from transformers import BitsAndBytesConfig

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=str(method.quant_type),
        bnb_4bit_use_double_quant=bool(method.double_quant),
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
        llm_int8_skip_modules=keep,  # despite its name, the 4-bit load's list of modules left alone too
    )
