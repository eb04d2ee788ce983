"""A stage schedule inside one run (`train.stages`): what trains when, checked without torch.

    python train.py train.max_steps=300 \\
        'train.stages=[{steps: 100, train: [projector]}, {train: [projector, language]}]'

LLaVA-1.5's recipe is two stages: the projector alone, then the projector with the language model. Each
stage trains as its own job would, the next starting from the weights the previous one ended with: the
parts it names train (the others are frozen), with a fresh optimizer (Adam states only for what trains
now) and its own warm-up and cosine over its steps, from the start of the data. So a two-stage run gives
the losses of its two stages run as two jobs (tests/e2e/test_stages.py), without a second launch.

The steps of the stages add up to train.max_steps; the last stage may leave its steps out and take the
rest. Each stage may set its own `lr` (or `lr_scale`, a multiple of train.lr); train.groups' rates apply
within every stage to the parts that train in it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.config.knobs import TRAIN_KNOBS
from launcher.config.schema import TRAINABLE
from launcher.core.errors import LauncherError

SETTINGS = ("name", "steps", "train", "lr", "lr_scale")
# A stage's name is a folder's (RUN/stages/NAME, the model it ended with): one plain name, never a path.
STAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_EXAMPLE = "'train.stages=[{steps: 100, train: [projector]}, {train: [projector, language]}]'"


@dataclass(frozen=True)
class Stage:
    """One stage of the schedule: the steps it trains (1-based, inclusive) and what trains in them."""

    index: int  # 0-based position in the schedule
    name: str
    first_step: int
    last_step: int
    train: tuple[str, ...]  # parts of TRAINABLE, in TRAINABLE's order
    lr: float | None = None
    lr_scale: float | None = None

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1

    def rate(self, base_lr: float) -> float:
        """This stage's learning rate (train.lr unless it sets its own)."""
        if self.lr is not None:
            return self.lr
        return base_lr * (1.0 if self.lr_scale is None else self.lr_scale)

    def freeze(self) -> dict[str, bool]:
        """{part: frozen} in this stage: what the model's freeze flags are while it trains."""
        return {part: part not in self.train for part in TRAINABLE}

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "steps": [self.first_step, self.last_step], "train": list(self.train),
                "lr": self.lr, "lr_scale": self.lr_scale}  # fmt: skip

    def describe(self, base_lr: float) -> str:
        """`projector-only: steps 1-100, projector at lr 0.001`."""
        return (
            f"{self.name}: steps {self.first_step}-{self.last_step}, {' + '.join(self.train)} "
            f"at lr {self.rate(base_lr):g}"
        )


def plan_stages(
    given: Sequence[Any] | None,
    *,
    max_steps: int | None,
    frozen: Mapping[str, bool] | None = None,
    warmup_steps: int | None = None,
) -> tuple[Stage, ...]:
    """The stages `train.stages` gives (none without it), or one line naming the key and the fix.

    `max_steps`: the run's length (None before train.epochs is counted: the sum is checked later);
    `frozen`: the model's freeze flags, which a stage may not undo; `warmup_steps`: train.warmup_steps,
    which every stage must be longer than."""
    if given is None:
        return ()
    if isinstance(given, str | Mapping) or not isinstance(given, Sequence) or not given:
        raise LauncherError(f"train.stages={given} must be a list of stages, e.g. {_EXAMPLE}")
    parsed = [_parse(index, entry, frozen or {}, last=index == len(given) - 1) for index, entry in enumerate(given)]
    names = [name for name, *_ in parsed]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise LauncherError(f"train.stages[{index}].name={name}: two stages have that name; name each its own")
    counted = sum(steps for _, steps, *_ in parsed if steps is not None)
    if parsed[-1][1] is None:  # the last stage takes the rest
        if max_steps is None:
            rest = None
        elif max_steps - counted < 1:
            raise LauncherError(
                f"train.stages: the stages before the last take {counted} steps of train.max_steps={max_steps}, "
                "leaving the last stage none: raise train.max_steps or shorten the earlier stages"
            )
        else:
            rest = max_steps - counted
        parsed[-1] = (parsed[-1][0], rest, *parsed[-1][2:])
    elif max_steps is not None and counted != max_steps:
        raise LauncherError(
            f"train.stages: the stages take {counted} steps but train.max_steps={max_steps}: set "
            f"train.max_steps={counted}, or leave the last stage's steps out (it takes the rest)"
        )
    if max_steps is None and parsed[-1][1] is None:
        return ()  # the run's length is not known yet (train.epochs): planned again once counted
    stages, first = [], 1
    for index, (name, steps, train, lr, lr_scale) in enumerate(parsed):
        if warmup_steps is not None and warmup_steps >= steps:
            raise LauncherError(
                f"train.stages[{index}] ({name}) takes {steps} steps, no more than train.warmup_steps={warmup_steps}: "
                "each stage warms up anew; lower train.warmup_steps (or use train.warmup_ratio) or lengthen the stage"
            )
        stages.append(Stage(index, name, first, first + steps - 1, train, lr, lr_scale))
        first += steps
    return tuple(stages)


def _parse(index: int, entry: Any, frozen: Mapping[str, bool], *, last: bool) -> tuple:
    """(name, steps or None, parts, lr, lr_scale) of one entry."""
    key = f"train.stages[{index}]"
    if not isinstance(entry, Mapping):
        raise LauncherError(f"{key}={entry} must be a stage: {{steps, train, lr, lr_scale, name}}, e.g. {_EXAMPLE}")
    unknown = sorted(str(setting) for setting in entry if setting not in SETTINGS)
    if unknown:
        raise LauncherError(
            f"{key}.{unknown[0]} is no stage setting: use steps, train (the parts that train), lr, lr_scale or name"
        )
    name = str(entry.get("name") or f"stage{index + 1}")
    if not STAGE_NAME.fullmatch(name):
        raise LauncherError(
            f"{key}.name={name!r} names the stage's folder (RUN/stages/NAME): use up to 64 letters, digits, '.', '_' "
            "or '-', starting with a letter or digit (no '/', no '..')"
        )
    steps = entry.get("steps")
    if steps is None and not last:
        raise LauncherError(
            f"{key} ({name}) gives no steps: only the last stage may leave them out (it takes the rest)"
        )
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise LauncherError(f"{key}.steps={steps}: a stage needs a whole number of steps, at least 1")
    train = entry.get("train")
    if isinstance(train, str):
        train = [train]
    if not isinstance(train, Sequence) or not train:
        raise LauncherError(
            f"{key}.train={train}: name the parts that train in this stage, a list of {', '.join(TRAINABLE)}"
        )
    for part in train:
        if part not in TRAINABLE:
            raise LauncherError(f"{key}.train: {part} is no part of the model that trains: use {', '.join(TRAINABLE)}")
        if frozen.get(part):
            raise LauncherError(
                f"{key}.train names {part}, which model.freeze_{part}=true freezes for the whole run: set "
                f"model.freeze_{part}=false to let stages decide, or drop it from the stage"
            )
    if len(set(train)) != len(train):
        raise LauncherError(f"{key}.train={list(train)} names a part twice: name each once")
    lr, lr_scale = (_rate(key, setting, entry.get(setting)) for setting in ("lr", "lr_scale"))
    if lr is not None and lr_scale is not None:
        raise LauncherError(f"{key} sets both lr and lr_scale: give one (lr_scale multiplies train.lr)")
    parts = tuple(part for part in TRAINABLE if part in train)
    return name, steps, parts, lr, lr_scale


def _rate(key: str, setting: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise LauncherError(
            f"{key}.{setting}={value} must be a number above 0 (a part that should not learn: leave it out)"
        )
    return float(value)


def stage_at(stages: Sequence[Stage], step: int) -> Stage:
    """The stage that trains step `step` (1-based); step 0 (nothing trained yet) is the first's."""
    for stage in stages:
        if step <= stage.last_step:
            return stage
    return stages[-1]


def stage_train(train: Mapping[str, Any], stage: Stage) -> dict[str, Any]:
    """The train group as a job of this stage alone sees it: its steps, its rate, no schedule of stages.
    What `launcher.config.knobs` computes from it (warm-up, the cosine's length) is the stage's own."""
    return {**train, "max_steps": stage.steps, "lr": stage.rate(float(train["lr"])), "stages": None}


def stage_config(config: Any, stage: Stage) -> Any:
    """The typed config (launcher.config.schema.Config) of a job that trains this stage alone: its freeze
    flags, steps and rate; what the checks and the rank build a stage's model from."""
    train = dataclasses.replace(
        config.train, max_steps=stage.steps, lr=stage.rate(float(config.train.lr)), stages=None, epochs=None
    )
    return dataclasses.replace(training_parts(config, stage.train), train=train)


def training_parts(config: Any, parts: Sequence[str]) -> Any:
    """The typed config with only `parts` left to train (the others' freeze flags set), stages dropped."""
    model = dataclasses.replace(config.model, **{f"freeze_{part}": part not in parts for part in TRAINABLE})
    return dataclasses.replace(config, model=model, train=dataclasses.replace(config.train, stages=None))


def parts_by_stage(given: Sequence[Any] | None) -> list[tuple[str, ...]]:
    """What each stage of `train.stages` trains, before the run's length is known (the planner's view)."""
    if not given:
        return []
    plan_stages(given, max_steps=None)  # refuses a malformed schedule in its one line
    return [_parse(index, entry, {}, last=True)[2] for index, entry in enumerate(given)]


# The knobs a stage sets anew: its rate and its schedule's length and warm-up (launcher.config.knobs).
STAGE_KNOBS = ("train.lr", "train.max_steps", "train.warmup_steps")


def stage_ds_config(ds_config: Mapping[str, Any], train: Mapping[str, Any], stage: Stage) -> dict[str, Any]:
    """The DeepSpeed dict a job of this stage alone trains with: the run's, with the stage's rate and
    schedule wherever the run's dict has them (a user's own optimizer or scheduler block included)."""
    staged = copy.deepcopy(dict(ds_config))
    values = stage_train(train, stage)
    for knob in TRAIN_KNOBS:
        if knob.key not in STAGE_KNOBS:
            continue
        *parents, leaf = knob.path.split(".")
        node = staged
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            node[leaf] = knob.value(values, None)
    return staged


def check_schedule_kept(saved: Sequence[Mapping[str, Any]] | None, now: Sequence[Stage], step: int) -> str | None:
    """Why a resume at `step` cannot continue with this schedule (None when it can): the stages that had
    started by that step must be the ones the checkpoint was trained with; later ones may change."""
    saved = list(saved or [])
    current = [stage.to_json() for stage in now]
    started = [stage for stage in saved if stage["steps"][0] <= step]
    if not saved and not current:
        return None
    if not saved or not current:
        had = "with train.stages" if saved else "without train.stages"
        return f"the checkpoint at step {step} was trained {had}: resume with the schedule it was trained with"
    for index, stage in enumerate(started):
        if index >= len(current) or _trained_part(current[index], step) != _trained_part(stage, step):
            return (
                f"train.stages[{index}] ({stage['name']}) had run up to step {min(step, stage['steps'][1])} "
                "when the checkpoint was saved, and this command changes it: keep the stages that have started "
                "(change only later ones), or start a new run"
            )
    return None


def _trained_part(stage: Mapping[str, Any], step: int) -> tuple:
    """What of a stage decides the steps up to `step`: everything, except where the running stage ends
    (which may move, as long as it is not before `step`)."""
    first, last = stage["steps"]
    ends = "running" if first <= step < last else last
    return stage["name"], first, ends, tuple(stage["train"]), stage["lr"], stage["lr_scale"]
