"""The model as one rank trains it: loaded, frozen and adapted as the job says, wrapped by DeepSpeed.

A new way to train (LoRA, gradient checkpointing, 4-bit bases) changes `load_model` and nothing else.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from launcher.config.groups import DEFAULT_GROUP, group_specs
from launcher.config.schema import freeze_flags, plain
from launcher.config.stages import Stage, stage_ds_config
from launcher.core.logs import quiet_transformers
from launcher.core.summary import Summary
from launcher.job.spec import Job
from launcher.model.components import apply_freeze, compile_layers, enable_gradient_checkpointing
from launcher.model.groups import OptimizerGroup, optimizer_groups, stage_specs
from launcher.model.kernels import apply_liger_layers, enable_fused_loss, kernels_used
from launcher.model.loading import (
    load_model_and_processor,
    made_where_it_trains,
    read_config,
    resolve_attn_implementation,
)
from launcher.model.method import (
    apply_method,
    keep_4bit_layout,
    kept_unquantized,
    parameter_counts,
    quantization_config,
)
from launcher.train import ops
from launcher.train.distributed import Rank

log = logging.getLogger("launcher")


@dataclass
class Engine:
    """DeepSpeed's engine of this rank and what a step needs beside it."""

    engine: Any  # deepspeed.DeepSpeedEngine
    scheduler: Any
    processor: Any
    dtype: torch.dtype  # what floating inputs (pixels) are cast to
    grad_norm: GradNormSource
    groups: tuple[OptimizerGroup, ...] = ()  # the optimizer's groups, in its order (launcher.model.groups)
    base_lr: float = 0.0  # the optimizer block's rate, which train.groups' rates are set against
    # The trainable parameters' names (the engine's module's) in the optimizer's order: its state's indices.
    param_names: tuple[str, ...] = ()
    ds_config: dict[str, Any] | None = None  # the dict it was initialised with (a stage's own, with train.stages)
    path: str | None = None  # where its weights were loaded from

    @property
    def micro(self) -> int:
        return int(self.engine.train_micro_batch_size_per_gpu())

    @property
    def accum(self) -> int:
        return int(self.engine.gradient_accumulation_steps())

    @property
    def zero_stage(self) -> int:
        return int(self.engine.zero_optimization_stage())

    def group_layout(self) -> list[list[Any]]:
        """[name, elements] of each optimizer group: what a checkpoint's optimizer state is saved by."""
        return [[group.name, group.params] for group in self.groups]

    def applied_rates(self) -> dict[str, float]:
        """The rates the next update applies: `train/lr`, the schedule's rate for train.lr, and with
        train.groups one `train/lr/NAME` per configured group (read from the optimizer DeepSpeed steps)."""
        rates = [float(rate) for rate in self.engine.get_lr()]
        if len(rates) != len(self.groups):  # not built by build_engine
            return {"train/lr": rates[0]}
        # Every group's rate follows the one schedule: train.lr's, from a group with a non-zero rate.
        paired = [(rate, group.lr) for rate, group in zip(rates, self.groups, strict=True) if group.lr]
        rate, built = paired[0] if paired else (0.0, 1.0)
        metrics = {"train/lr": rate if built == self.base_lr else self.base_lr * rate / built}
        if any(group.group != DEFAULT_GROUP for group in self.groups):
            for rate, group in zip(rates, self.groups, strict=True):
                metrics[f"train/lr/{group.group}"] = rate
        return metrics


def build_engine(
    job: Job, rank: Rank, summary: Summary, *, stage: Stage | None = None, path: str | None = None
) -> Engine:
    """Seed, load the model, hand it to `deepspeed.initialize` with the job's dict; what it learns about
    the model goes into `summary`.

    With train.stages, the engine of one `stage`, as a job of that stage alone would build it: its parts
    train, its rate and schedule, the model from `path` (the weights the stage before ended with)."""
    import deepspeed

    ds_config = dict(job.ds_config)
    if stage is not None:
        ds_config = stage_ds_config(ds_config, plain(job.config.train), stage)
    reshard = job.resume.reshard if job.resume else None
    if reshard is not None and reshard.converts and reshard.zero_stage > 0:
        # A load-time switch only (DeepSpeed reads the checkpoint's universal copy); ds_config.json stays the job's.
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    seed_everything(int(job.config.train.seed))
    model, processor = load_model(job, rank, ds_config, summary, stage=stage, path=path)
    optimizer = ds_config["optimizer"]["params"]
    param_groups, groups = optimizer_groups(
        model,
        stage_specs(group_specs(job.config.train.groups), stage),
        lr=float(optimizer["lr"]),
        weight_decay=None if optimizer.get("weight_decay") is None else float(optimizer["weight_decay"]),
        decay_norms_and_biases=bool(job.config.train.decay_norms_and_biases),
    )
    # Before deepspeed.initialize, which replaces the groups' parameters with its flat partitions (ZeRO-1/2).
    names = {id(param): name for name, param in model.named_parameters()}  # the engine's module is `model`
    ordered = tuple(names[id(param)] for group in param_groups for param in group["params"])
    fallback = ops.optimizer_fallback(ds_config)  # on every rank: each loads (or builds) the op itself
    if fallback and rank.is_main:
        log.warning(fallback)
    engine, _, _, scheduler = deepspeed.initialize(model=model, model_parameters=param_groups, config=ds_config)
    start_warm_up_at_step_one(scheduler)
    built = Engine(engine, scheduler, processor, engine_dtype(engine), GradNormSource(engine))
    built.groups, built.base_lr, built.param_names = tuple(groups), float(optimizer["lr"]), ordered
    built.ds_config, built.path = ds_config, str(path or job.model_path)
    summary.param_groups = groups_in_use(engine, scheduler, groups)
    summary.optimizer = type(getattr(engine, "basic_optimizer", None) or engine.optimizer).__name__
    summary.zero_stage = built.zero_stage
    summary.world_size = rank.world_size
    summary.precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(built.dtype, "fp32")
    summary.params_held_per_rank = params_held_per_rank(engine, rank.device)
    return built


def release(engine: Engine) -> None:
    """Let an engine go before another is built (the next stage of train.stages): DeepSpeed's hooks and
    buffers, then the model, optimizer states and gradients it held."""
    import gc

    engine.engine.destroy()
    engine.engine = engine.scheduler = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def groups_in_use(engine: Any, scheduler: Any, built: list[OptimizerGroup]) -> list[dict[str, Any]]:
    """The optimizer's groups as DeepSpeed holds them once initialised (the optimizer it steps, at every
    ZeRO stage and offload): name, the peak rate its schedule scales, weight decay, and elements."""
    peaks = getattr(scheduler, "org_lrs", None)  # WarmupCosineLR's; a fixed rate is the group's own
    elements = {group.name: group.params for group in built}
    return [
        {
            "name": group.get("name"),
            "lr": float(peaks[index] if peaks is not None else group["lr"]),
            "weight_decay": group.get("weight_decay"),
            "params": elements.get(group.get("name")),
        }
        for index, group in enumerate(engine.optimizer.param_groups)
    ]


def start_warm_up_at_step_one(scheduler: Any) -> None:
    """Make step k of DeepSpeed's WarmupCosineLR apply its iteration k: lr x k / warm-up steps in the
    warm-up, then the cosine (the floor reached at the last step).

    As built, it sets the rate of iteration -1 (0) for step 1 and steps to iteration 0 (0 again, in a
    linear warm-up) for step 2: two updates at rate 0, so a 1- or 2-step run saved its starting weights.
    Two steps here, before any update; a resume then loads the checkpoint's own iteration over them."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    if isinstance(scheduler, WarmupCosineLR):
        scheduler.step()
        scheduler.step()


def load_model(
    job: Job,
    rank: Rank,
    ds_config: dict[str, Any],
    summary: Summary,
    *,
    stage: Stage | None = None,
    path: str | None = None,
) -> tuple[Any, Any]:
    """The model as it trains (frozen parts frozen, adapters added, checkpointing on) and its processor,
    from the path the launcher resolved (a tiny model was built there before any rank started), or from
    `path`; a `stage` of train.stages decides what is frozen."""
    model_cfg, method = job.config.model, job.config.method
    path = path or job.model_path
    freeze = freeze_flags(model_cfg)
    if stage is not None:
        freeze = stage.freeze()
    zero3 = ds_config["zero_optimization"]["stage"] == 3
    extra: dict[str, Any] = {}
    if str(method.name) == "qlora":
        from transformers import AutoModelForImageTextToText

        # Module names only (nothing allocated), and before transformers learns of ZeRO-3 below: it would
        # partition this skeleton too.
        with torch.device("meta"):
            skeleton = AutoModelForImageTextToText.from_config(read_config(str(path)))
        keep = kept_unquantized(skeleton, method, model_cfg)
        extra["quantization_config"] = quantization_config(method, job.precision, keep=keep)
        if not zero3:  # bitsandbytes quantises as the weights reach the device; ZeRO-3 places them itself
            extra["device_map"] = {"": rank.device}
    extra.update(made_where_it_trains(str(path), rank.device, zero3=zero3))
    # At ZeRO-3 transformers must know the DeepSpeed config before the model is built, so that
    # from_pretrained partitions the weights at construction instead of materialising them per rank.
    hf_ds_config = None
    if zero3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # kept alive on purpose: transformers reads it at load
    attention = resolve_attn_implementation(
        str(model_cfg.attn_implementation), device_kind=rank.device.type, precision=job.precision
    )
    quiet_transformers()
    model, processor = load_model_and_processor(
        str(path),
        attn_implementation=attention,
        min_pixels=model_cfg.min_pixels,
        max_pixels=model_cfg.max_pixels,
        **extra,
    )
    if str(method.name) == "qlora" and rank.device.type == "cpu":
        keep_4bit_layout(model)
    # True when ZeRO-3 partitioned the weights while loading (zero.Init tags each parameter).
    summary.partitioned_at_load = any(hasattr(p, "ds_id") for p in model.parameters())
    model.config.use_cache = False
    liger = str(model_cfg.kernels) == "liger"
    liger_layers = apply_liger_layers(model, rank.device.type) if liger else {}
    apply_freeze(model, **freeze)
    enable_gradient_checkpointing(
        model, language=model_cfg.gradient_checkpointing, vision=model_cfg.vision_gradient_checkpointing
    )
    # The adapters' initial weights from train.seed alone: loading the base draws from the generator
    # differently per ZeRO stage (zero.Init), and the same job must start from the same adapters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(job.config.train.seed))
        model = apply_method(model, method, model_cfg)
    if model_cfg.compile:
        compiled = compile_layers(model)
        if rank.is_main:
            log.info("model.compile: %d layer parts compiled (each layer's MLP and norms)", len(compiled))
    loss_problem = enable_fused_loss(model, zero_stage=ds_config["zero_optimization"]["stage"]) if liger else None
    summary.kernels = kernels_used(model_cfg, liger_layers, loss_problem)
    if rank.is_main and liger:
        log.info("model.kernels=liger: %s", summary.kernels)
    counts = parameter_counts(model)
    summary.params_total, summary.params_trainable = counts["total"], counts["trainable"]
    summary.trainable_fraction = counts["trainable"] / max(counts["total"], 1)
    summary.method, summary.attn_implementation, summary.base_model = str(method.name), attention, job.model_path
    if rank.is_main:
        log.info(
            "model %s (%s, attention %s): %s of %s parameters train (%.2f%%): vision %s, projector %s, language %s",
            path,
            method.name,
            attention,
            *(f"{counts[key]:,}" for key in ("trainable", "total")),
            100 * summary.trainable_fraction,
            *(f"{counts[key]:,}" for key in ("vision", "projector", "language")),
        )
    del hf_ds_config  # alive until here, as before the QLoRA skeleton: adding the adapters asks it too
    return model, processor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def engine_dtype(engine: Any) -> torch.dtype:
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


def params_held_per_rank(engine: Any, device: torch.device) -> list[int]:
    """Parameter elements each rank holds: its ZeRO-3 partition, or everything below stage 3."""
    held = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in engine.module.parameters())
    counts = torch.zeros(torch.distributed.get_world_size(), dtype=torch.int64, device=device)
    counts[torch.distributed.get_rank()] = held
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(counts)
    return [int(c) for c in counts.tolist()]


def unpartitioned_grad_norm(engine: Any) -> float:
    """Gradient norm at ZeRO stage 0 in fp32 without clipping (GradNormSource.computed_here decides).

    Gradients are already all-reduced at the accumulation boundary, so the local norm is global.
    One fused per-tensor norm call: a Python loop over the parameters cost ~1% of a tiny model's step."""
    grads = [p.grad.detach() for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return math.nan
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)), dtype=torch.float64))


class GradNormSource:
    """Where train/grad_norm comes from at ZeRO stage 0 in fp32, the one case DeepSpeed keeps no norm
    (engine.get_global_grad_norm() serves the others).

    With clipping on, DeepSpeed computes the norm to clip by (engine.clip_fp32_gradients calls
    deepspeed.runtime.utils.clip_grad_norm_, which returns it) and drops it: this engine's
    clip_fp32_gradients makes the same call and keeps the result, so the metric costs nothing (a second
    pass over the gradients cost ~1% of a small model's step). Without clipping the launcher computes
    the norm before the optimizer step (`computed_here`)."""

    def __init__(self, engine: Any) -> None:
        self.computed_here = False
        self._kept: Any = None
        if engine.zero_optimization_stage() != 0 or engine_dtype(engine) != torch.float32:
            return
        if engine.gradient_clipping() > 0 and hasattr(engine, "clip_fp32_gradients"):
            from deepspeed.runtime.utils import clip_grad_norm_

            def clip_and_keep_norm() -> None:
                self._kept = clip_grad_norm_(
                    parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
                )

            engine.clip_fp32_gradients = clip_and_keep_norm
        else:
            self.computed_here = True

    def take(self, computed: float) -> float:
        """This step's norm: the one DeepSpeed's clipping kept, else `computed` (NaN when there is none)."""
        kept, self._kept = self._kept, None
        return computed if kept is None else float(kept)

    def of_step(self, engine: Any, computed: float) -> float:
        """train/grad_norm of the step that just ended: DeepSpeed's, else the one kept or computed here."""
        fallback = self.take(computed)
        norm = engine.get_global_grad_norm()
        if norm is None:
            return fallback
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)
