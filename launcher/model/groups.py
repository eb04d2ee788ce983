"""Parameter groups on the model: which trainable parameter each configured group holds, and the groups
handed to `deepspeed.initialize(model_parameters=...)`, so the optimizer DeepSpeed steps has them at
every ZeRO stage, with CPU offload (DeepSpeedCPUAdam) and with a user's optimizer block alike.

The trap this avoids (LLaVA-NeXT#492): a vision-tower rate set in a recipe that never reached the
optimizer, because it was built from a flat parameter list. Each optimizer group carries its `name`, so
the rates DeepSpeed uses can be read back from `engine.optimizer.param_groups` (the tests do).
Biases and norm weights get no weight decay unless train.decay_norms_and_biases (the HF Trainer's rule).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from launcher.config.groups import DEFAULT_GROUP, GroupSpec
from launcher.config.stages import Stage
from launcher.core.errors import LauncherError
from launcher.model.components import base_model
from launcher.model.method import component_of, component_paths

NO_DECAY = ".no_decay"  # the suffix of a group's biases and norm weights


@dataclass(frozen=True)
class OptimizerGroup:
    """One group of the optimizer, as built: its name, rate and decay, and its parameters' count."""

    name: str
    lr: float
    weight_decay: float | None  # None: the optimizer's own default (a user's block that sets none)
    params: int  # elements (a ZeRO-3 partitioned parameter counts its full size)

    @property
    def group(self) -> str:
        """The configured group it belongs to (its no-decay half included)."""
        return self.name.removesuffix(NO_DECAY)


def part_of(name: str, paths: dict[str, str]) -> str:
    """The part a parameter belongs to: `adapters` for LoRA's weights, else the component whose module holds
    it (the output head, outside every component's module, is the language model's)."""
    if ".lora_" in name:
        return "adapters"
    return component_of(name.rsplit(".", 1)[0], paths) or "language"


def _no_decay_names(model: nn.Module) -> set[str]:
    """Biases and the weights of norm layers (LayerNorm, RMSNorm, ...): the parameters left undecayed."""
    names = set()
    for module_name, module in model.named_modules():
        is_norm = "Norm" in type(module).__name__
        for parameter_name, _ in module.named_parameters(recurse=False):
            if is_norm or parameter_name == "bias":
                names.add(f"{module_name}.{parameter_name}" if module_name else parameter_name)
    return names


def assign(model: nn.Module, specs: list[GroupSpec], *, why_frozen: str = "") -> dict[str, list[tuple[str, Any]]]:
    """{group name: [(parameter name, parameter)]} of the trainable parameters, `default` for those no
    group holds; one line for a group that holds nothing trainable, or a parameter two groups hold.

    `why_frozen` explains an empty part in that line (" (model.freeze_vision=true)")."""
    base = base_model(model)
    paths = component_paths(base)
    parts = {spec.name: spec for spec in specs if spec.match is None}
    patterns = [(spec, re.compile(spec.match)) for spec in specs if spec.match is not None]
    held: dict[str, list[tuple[str, Any]]] = {spec.name: [] for spec in specs}
    held[DEFAULT_GROUP] = []
    for name, parameter in base.named_parameters():
        if not parameter.requires_grad:
            continue
        owners = [spec.name for spec, pattern in patterns if pattern.fullmatch(name)]
        if (part := part_of(name, paths)) in parts:
            owners.insert(0, part)
        if len(owners) > 1:
            raise LauncherError(
                f"train.groups.{owners[0]} and train.groups.{owners[1]} both hold {name}: a parameter takes one "
                "group's rate; narrow the match"
            )
        held[owners[0] if owners else DEFAULT_GROUP].append((name, parameter))
    for spec in specs:
        if not held[spec.name]:
            what = f"no trainable parameter's name matches '{spec.match}'" if spec.match else (
                f"nothing in the {spec.name} part trains{why_frozen}"
            )  # fmt: skip
            raise LauncherError(f"train.groups.{spec.name}: {what}; drop the group or change what trains")
    return held


def stage_specs(specs: list[GroupSpec], stage: Stage | None) -> list[GroupSpec]:
    """The groups that apply within a stage: a part's group while that part trains, every regex group."""
    if stage is None:
        return specs
    return [spec for spec in specs if spec.match is not None or spec.name in stage.train]


def optimizer_groups(
    model: nn.Module, specs: list[GroupSpec], *, lr: float, weight_decay: float | None, decay_norms_and_biases: bool
) -> tuple[list[dict[str, Any]], list[OptimizerGroup]]:
    """(the `model_parameters` for deepspeed.initialize, what each group is): one group per configured group
    and one for the rest, each split in two where biases and norm weights skip a non-zero weight decay.

    `lr`, `weight_decay`: the optimizer block's own (weight_decay None: a user's block leaves it to the
    optimizer's default, which the groups that set none keep)."""
    held = assign(model, specs)
    no_decay = set() if decay_norms_and_biases else _no_decay_names(base_model(model))
    by_name = {spec.name: spec for spec in specs}
    param_groups: list[dict[str, Any]] = []
    described: list[OptimizerGroup] = []
    for group, members in held.items():
        if not members:
            continue
        spec = by_name.get(group, GroupSpec(name=group))
        rate = spec.rate(lr)
        decay = spec.weight_decay if spec.weight_decay is not None else weight_decay
        undecayed = {n for n, _ in members if n in no_decay} if decay else set()
        for name, params, group_decay in (
            (group, [p for n, p in members if n not in undecayed], decay),
            (group + NO_DECAY, [p for n, p in members if n in undecayed], 0.0),
        ):
            if not params:
                continue
            settings = {"lr": rate, "name": name}
            if group_decay is not None:
                settings["weight_decay"] = group_decay
            param_groups.append({"params": params, **settings})
            count = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
            described.append(OptimizerGroup(name, rate, group_decay, count))
    return param_groups, described
