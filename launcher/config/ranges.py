"""Every knob's range, in one table, checked once before a job is planned (`check_config`).

A value out of range would otherwise reach a rank and fail there with a traceback (a model built with
0 attention heads), reach DeepSpeed (which accepts a negative learning rate), or fail much later (a
huge worker count, killed by the out-of-memory killer). Each row names a key, the test its value must
pass and what the error says; rules that relate several keys (a tiny model's dimensions, warm-up
against the run's length) follow the table. The closed choices are the schema's enums (refused by
Hydra at compose time). Reads a composed config or its typed form (launcher.config.schema.Config)
alike, by attribute.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from launcher.config.groups import group_specs
from launcher.config.schema import freeze_flags
from launcher.config.stages import plan_stages
from launcher.core.errors import LauncherError

WORKERS_PER_CORE = 4  # DataLoader workers beyond this many per usable core only add processes


@dataclass(frozen=True)
class Range:
    key: str  # dotted: "train.lr"
    test: Callable[[Any], bool]  # the value is in range
    says: str  # what the error says after "KEY=VALUE "
    optional: bool = False  # null is allowed (not checked)
    when: Callable[[Any], bool] | None = None  # only for configs where this holds (the config -> bool)


def at_least(key: str, low: int, **kwargs: Any) -> Range:
    return Range(key, lambda v: int(v) >= low, "must be positive" if low == 1 else f"must be at least {low}", **kwargs)


def positive(key: str) -> Range:
    return Range(key, lambda v: v > 0, "must be positive")


def not_negative(key: str) -> Range:
    return Range(key, lambda v: v >= 0, "must not be negative")


def finite(key: str) -> Range:
    return Range(key, math.isfinite, "must be a finite number")


def _synthetic(cfg: Any) -> bool:
    return bool(cfg.data.synthetic)


def _adapters(cfg: Any) -> bool:
    return str(cfg.method.name) in ("lora", "qlora")


# Knobs another knob's default is made from (the tiny LLaVA's model.image_size from data.video.grid on the
# motion task): checked before the others, so that a bad one is named rather than the value made from it.
SOURCE_RANGES: tuple[Range, ...] = (at_least("data.video.grid", 1),)

RANGES: tuple[Range, ...] = (
    at_least("data.eval_samples", 1),
    at_least("data.max_new_tokens", 1),
    at_least("data.n_train", 1, when=_synthetic),
    at_least("data.n_eval", 1, when=_synthetic),  # an empty held-out file is refused when read
    at_least("data.image_size", 8, when=_synthetic),
    at_least("data.seed", 0, when=_synthetic),
    at_least("dist.nproc_per_node", 1),
    at_least("dist.nnodes", 1),
    at_least("dist.node_rank", 0),
    at_least("dist.timeout_s", 1),
    Range(
        "dist.step_timeout_s",
        lambda v: 0 <= float(v) < math.inf,
        "must be a number of seconds, or 0 (or null) for no watchdog",
        optional=True,
    ),
    at_least("data.max_image_pixels", 1),
    Range("data.video.fps", lambda v: 0 < float(v) < math.inf, "must be a positive number of frames per second"),
    at_least("data.video.min_frames", 1),
    Range(
        "data.video.max_frames",
        lambda v: int(v) >= 1,
        "must be a positive number of frames per video, at least data.video.min_frames",
    ),
    at_least("data.video.max_pixels", 64, optional=True),
    Range("data.video.max_seconds", lambda v: float(v) > 0, "must be a positive length, or null", optional=True),
    at_least("data.shuffle_block", 1),
    at_least("data.pack_length", 16, when=lambda cfg: cfg.data.pack_length is not None),
    at_least("data.pack_max_images", 1, optional=True),
    Range(
        "data.max_length",
        lambda v: int(v) >= 1,
        "must be a positive number of tokens per sample (text + image tokens), e.g. 2048, or null for no limit",
        optional=True,
    ),
    Range("dist.master_port", lambda v: 1 <= int(v) <= 65535, "must be a TCP port in [1, 65535]", optional=True),
    at_least("train.keep_checkpoints", 1),
    at_least("logger.log_every", 1),
    at_least("train.max_nonfinite_steps", 0),
    Range(
        "loss.chunk_tokens",
        lambda v: int(v) >= 0,
        "must be a number of answer tokens per pass through the output layer (e.g. 1024), or 0 for the whole logits",
    ),
    Range("train.seed", lambda v: 0 <= int(v) < 2**32, "must lie in [0, 2**32) (NumPy's seed range)"),
    *(
        Range(
            f"plan.{key}",
            lambda v: 0 < float(v) < math.inf,
            "must be a positive number of GiB (or null: detected)",
            optional=True,
        )
        for key in ("gpu_memory_gb", "cpu_memory_gb")
    ),
    Range("plan.headroom", lambda v: 0 <= float(v) < 1, "must be a fraction in [0, 1)"),
    *(at_least(f"plan.{key}", 1, optional=True) for key in ("seq_len", "text_tokens", "image_size")),
    at_least("plan.images_per_sample", 0),
    at_least("plan.videos_per_sample", 0),
    Range("method.r", lambda v: int(v) >= 1, "must be a positive LoRA rank (8 to 64 are usual)", when=_adapters),
    Range("method.alpha", lambda v: float(v) > 0, "must be positive (usually 2 x method.r)", when=_adapters),
    Range("method.dropout", lambda v: 0 <= float(v) < 1, "must lie in [0, 1)", when=_adapters),
)
# The training knobs, checked after the rest (the order a job with several mistakes reports them in).
TRAIN_RANGES: tuple[Range, ...] = (
    Range(
        "train.epochs",
        lambda v: math.isfinite(v) and v > 0,
        "must be a positive number of passes over the data",
        optional=True,
    ),
    Range("train.warmup_ratio", lambda v: 0 <= v < 1, "must be a fraction in [0, 1), e.g. 0.03", optional=True),
    replace(positive("train.max_steps"), optional=True),
    positive("train.lr"),
    positive("train.log_every"),
    *(not_negative(f"train.{key}") for key in ("weight_decay", "grad_clip", "eval_every", "save_every")),
    # Adam divides by sqrt(v) + eps: 0 gives NaN where a gradient's second moment is 0 (a frozen row).
    Range("train.eps", lambda v: 0 < v < 1, "must lie in (0, 1): Adam divides by sqrt(v) + eps (1e-8 is usual)"),
    *(
        replace(finite(f"train.{key}"), optional=key == "max_steps")
        for key in (
            "max_steps",
            "lr",
            "log_every",
            "weight_decay",
            "grad_clip",
            "eval_every",
            "save_every",
            "eps",
            "min_lr_ratio",
        )
    ),
    Range("train.min_lr_ratio", lambda v: 0 <= v <= 1, "must lie in [0, 1]"),
    Range(
        "train.profile_steps",
        lambda v: len(v) == 2 and 1 <= int(v[0]) <= int(v[1]),
        "must be [FIRST,LAST], the steps to profile (1 <= FIRST <= LAST, e.g. [3,4]: after the first, slower "
        "steps), or null",
        optional=True,
    ),
)
# The tuner's own knobs (python -m launcher.tune).
TUNE_RANGES: tuple[Range, ...] = (
    replace(at_least("tune.warmup_steps", 0), says="must be 0 or more"),
    replace(at_least("tune.measure_steps", 1), says="must be 1 or more"),
    Range("tune.margin", lambda v: float(v) >= 0, "must be positive (or 0)"),
    *(
        Range(f"tune.{key}", lambda v: float(v) > 0, "must be positive")
        for key in ("skip_margin", "loss_tolerance", "low_precision_loss_tolerance", "candidate_timeout_s")
    ),
    Range(
        "tune.micro_batch_sizes",
        lambda v: len(v) > 0 and all(int(n) >= 1 for n in v),
        "must list positive micro batch sizes (e.g. [4,8,16]), or be null for half, once and twice the job's",
        optional=True,
    ),
    Range(
        "tune.pack_lengths",
        lambda v: len(v) > 0 and all(int(n) >= 16 for n in v),
        "must list row lengths of 16 tokens or more (e.g. [2048,4096]), or be null for data.pack_length",
        optional=True,
    ),
    Range(
        "tune.memory_gb",
        lambda v: float(v) > 0,
        "must be positive (GiB per rank), or null for the planner's",
        optional=True,
    ),
)


def value_of(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_config(cfg: Any, *, tuner: bool = False) -> None:
    """Refuse, in one line naming the key, the first value out of its range (CHECKS, in order).

    A job's knobs; with `tuner`, the tuner's own (the `tune` group) as well."""
    for rule in CHECKS:
        if rule.group != "tune" or tuner:
            rule.check(cfg)


@dataclass(frozen=True)
class _Rule:
    group: str
    check: Callable[[Any], None]


def _range_rule(row: Range) -> _Rule:
    def check(cfg: Any) -> None:
        if row.when is not None and not row.when(cfg):
            return
        value = value_of(cfg, row.key)
        if value is None and row.optional:
            return
        if value is None or not row.test(value):
            raise LauncherError(f"{row.key}={value} {row.says}")

    return _Rule(row.key.split(".", 1)[0], check)


# ----------------------------------------------------------------------------- rules between keys
def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. a SLURM or container allocation)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _num_workers(cfg: Any) -> None:
    cores, workers = usable_cores(), cfg.data.num_workers
    if not 0 <= int(workers) <= WORKERS_PER_CORE * cores:
        raise LauncherError(
            f"data.num_workers={workers} must lie in [0, {WORKERS_PER_CORE * cores}] ({WORKERS_PER_CORE} per "
            f"usable core, {cores} here): each worker is a process with its own copy of the data set; "
            f"data.num_workers={min(cores, 2)} is plenty for images this size"
        )


def _model_source(cfg: Any) -> None:
    """A pretrained model needs a path (a random one too: its architecture's); a tiny one is built from code
    and takes none."""
    model = cfg.model
    if str(model.source) != "tiny" and str(model.tiny_base) != "auto":
        raise LauncherError(
            f"model.tiny_base={model.tiny_base} sets a tiny model's starting weights, and model={model.name} is "
            f"model.source={model.source}: drop model.tiny_base, or train a tiny model (model=tiny_llava)"
        )
    if str(model.source) in ("pretrained", "random"):
        if not model.path:
            raise LauncherError(f"model.path is empty for model={model.name}: give a hub id or a local directory")
        return
    if model.path:
        raise LauncherError(
            f"model.path={model.path} is given, but model={model.name} builds a tiny model from code and would "
            f"ignore it: to train the model saved there add model.source=pretrained (a trained run's model/ "
            "loads this way), or leave model.path unset"
        )
    if model.arch is None:
        raise LauncherError(
            f"model.arch is not set for the tiny model model={model.name}: use tiny_llava or tiny_qwen2_vl"
        )


TINY_LIMITS = {"num_layers": 256, "vision_layers": 256, "hidden_size": 32768, "vision_hidden_size": 32768,
               "image_size": 4096}  # fmt: skip


def _tiny_dimensions(cfg: Any) -> None:
    """A tiny model's dimensions must build: heads of 32, whole patches, Qwen2-VL's 2x2 merge."""
    model = cfg.model
    if str(model.source) != "tiny":
        return
    for key in ("hidden_size", "vision_hidden_size"):
        value = value_of(model, key)
        if int(value) < 32 or int(value) % 32:
            raise LauncherError(
                f"model.{key}={value} must be a positive multiple of 32 (attention heads of 32 dimensions), "
                "e.g. 64 or 128"
            )
    for key in ("num_layers", "vision_layers", "image_size", "patch_size"):
        _range_rule(at_least(f"model.{key}", 1)).check(cfg)
    # A model built from code is planned and built in full: past these its planning alone would fill memory.
    for key, most in TINY_LIMITS.items():
        value = int(value_of(model, key))
        if value > most:
            raise LauncherError(
                f"model.{key}={value} must be at most {most} for a model built from code (the largest published "
                "models have ~130 layers and ~16,384 wide): lower it"
            )
    image, patch = int(model.image_size), int(model.patch_size)
    if image % patch:
        raise LauncherError(f"model.image_size={image} must be a multiple of model.patch_size={patch}")
    if str(model.arch) == "tiny_qwen2_vl" and (image // patch) % 2:
        raise LauncherError(
            f"model.image_size / model.patch_size = {image // patch} must be even: tiny_qwen2_vl merges 2x2 patches"
        )


def _pixels(cfg: Any) -> None:
    """model.min_pixels / model.max_pixels: positive, and the range not empty (null: the processor's own)."""
    low, high = cfg.model.min_pixels, cfg.model.max_pixels
    for key, value in (("min_pixels", low), ("max_pixels", high)):
        if value is not None and int(value) < 1:
            raise LauncherError(
                f"model.{key}={value} must be a positive number of pixels per image (e.g. {448 * 448} for 448 x 448), "
                "or null for the processor's own"
            )
    if low is not None and high is not None and int(high) < int(low):
        raise LauncherError(
            f"model.max_pixels={high} is below model.min_pixels={low}: raise model.max_pixels or lower "
            "model.min_pixels (each image is resized to between the two)"
        )


def _frames(cfg: Any) -> None:
    video = cfg.data.video
    if int(video.min_frames) > int(video.max_frames):
        raise LauncherError(
            f"data.video.min_frames={video.min_frames} is over data.video.max_frames={video.max_frames}: "
            "raise max_frames or lower min_frames"
        )


def _length(cfg: Any) -> None:
    if cfg.train.max_steps is None and cfg.train.epochs is None:
        raise LauncherError(
            "train.max_steps=null and train.epochs=null: give the training length, e.g. train.max_steps=1000 "
            "or train.epochs=1"
        )


def _betas(cfg: Any) -> None:
    betas = list(cfg.train.betas)
    if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
        raise LauncherError(f"train.betas={betas} must be two numbers in [0, 1), e.g. [0.9, 0.95]")


def _warmup(cfg: Any) -> None:
    warmup, steps = cfg.train.warmup_steps, cfg.train.max_steps
    if warmup is not None and steps is not None and not 1 <= warmup < steps:
        raise LauncherError(
            f"train.warmup_steps={warmup} must lie in [1, train.max_steps={steps}) "
            "(DeepSpeed's WarmupCosineLR needs at least one warm-up step)"
        )


def _stages(cfg: Any) -> None:
    given = getattr(cfg.train, "stages", None)
    if given is None:
        return
    if str(cfg.method.name) != "full":
        raise LauncherError(
            f"train.stages with method={cfg.method.name}: a stage schedule trains parts of the model itself; "
            "with adapters, train in separate jobs (or use method=full)"
        )
    if getattr(cfg.data, "streaming", False):
        raise LauncherError(
            "train.stages with data.streaming=true: each stage reads the data from its start, which a stream "
            "cannot; use the indexed data (data.streaming=false) or separate jobs"
        )
    plan_stages(
        given, max_steps=cfg.train.max_steps, frozen=freeze_flags(cfg.model), warmup_steps=cfg.train.warmup_steps
    )


# In the order a config with several mistakes reports them: what the model is, the rest of the job,
# then the training knobs (relations last), then the tuner's.
CHECKS: tuple[_Rule, ...] = (
    *(_range_rule(row) for row in SOURCE_RANGES),
    _Rule("model", _model_source),
    _Rule("model", _tiny_dimensions),
    _Rule("model", _pixels),
    _Rule("data", _num_workers),
    *(_range_rule(row) for row in RANGES),
    _Rule("data", _frames),
    *(_range_rule(row) for row in TRAIN_RANGES[:2]),  # epochs, warm-up ratio
    _Rule("train", _length),
    *(_range_rule(row) for row in TRAIN_RANGES[2:-1]),
    _Rule("train", _betas),
    _Rule("train", _warmup),
    _range_rule(TRAIN_RANGES[-1]),  # min_lr_ratio
    _Rule("train", lambda cfg: group_specs(cfg.train.groups)),
    _Rule("train", _stages),
    *(_range_rule(row) for row in TUNE_RANGES),
)
