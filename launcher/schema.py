"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

The root schema (`base_config`) types the whole composed config, so a misspelt key in a YAML file
or on the command line fails at compose time instead of being silently ignored. This module is
imported by `train.py` before Hydra parses the command line: it must stay free of torch, deepspeed
and transformers so that `python train.py --cfg job` is instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ZeroConfig:
    """ZeRO stage and the knobs that only exist for that stage (names as DeepSpeed spells them)."""

    stage: int = 0
    # Stage 3 only: how many parameters may be gathered at once, and how soon a released
    # parameter may be reused before it is re-gathered. Lower both to save memory.
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    # Stage 3 only: gather full 16-bit weights when the model is saved (needed for model/).
    stage3_gather_16bit_weights_on_model_save: bool = True
    # Stage 3 only: optimizer-step granularity; smaller lowers peak memory of offloaded steps.
    sub_group_size: int = 1_000_000_000


@dataclass
class PrecisionConfig:
    """Training dtype; `auto` resolves at run time from what the device supports."""

    dtype: str = "fp32"  # fp32 | bf16 | fp16 | auto
    # fp16 loss scaling (ignored otherwise). loss_scale=0 means dynamic scaling.
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class OffloadConfig:
    """Where optimizer states and parameters live when they are not on the accelerator."""

    optimizer: str = "none"  # none | cpu | nvme
    param: str = "none"  # none | cpu | nvme
    pin_memory: bool = True
    nvme_path: str | None = None
    # NVMe parameter offload: number and size (elements) of the swap buffers.
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    # Parameter offload: elements kept in CPU memory before swapping to NVMe.
    max_in_cpu: int = 1_000_000_000


@dataclass
class CommConfig:
    """Communication knobs. A null bucket size is derived from the model's hidden size."""

    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int | None = None


@dataclass
class TrainConfig:
    """Training knobs the DeepSpeed dict depends on. Give any two of the three batch sizes."""

    micro_batch_size: int | None = 32  # per device
    grad_accum: int | None = None
    global_batch_size: int | None = None
    max_steps: int = 1000
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int | None = None  # null: 5% of max_steps
    # Floor of the cosine schedule, as a fraction of lr.
    min_lr_ratio: float = 0.05
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 0
    eval_every: int = 250  # 0: evaluate only at the end
    save_every: int = 0  # 0: checkpoint only at the end
    keep_checkpoints: int = 2  # the newest K complete checkpoints are kept, older ones deleted
    # fp16 only: steps with a non-finite loss tolerated in a row (the loss scaler skips their update);
    # fp32/bf16 apply every update, so a non-finite loss always stops the run.
    max_nonfinite_steps: int = 0
    log_every: int = 100


@dataclass
class ModelConfig:
    """A vision-language model: built tiny from code (`source: tiny`) or loaded (`source: pretrained`)."""

    name: str = MISSING
    source: str = "tiny"  # tiny | pretrained
    # pretrained: a hub id or a local directory; tiny: the architecture to build.
    path: str | None = None
    arch: str | None = None  # tiny_llava | tiny_qwen2_vl
    freeze_vision: bool = False
    freeze_projector: bool = False
    freeze_language: bool = False
    # Dimensions of a tiny model (ignored for pretrained models, whose config says).
    hidden_size: int = 64
    num_layers: int = 2
    vision_hidden_size: int = 64
    vision_layers: int = 2
    image_size: int = 32
    patch_size: int = 8


@dataclass
class DataConfig:
    """A data set in LLaVA conversation format; `synthetic: true` generates the built-in one first."""

    name: str = MISSING
    synthetic: bool = False
    path: str | None = None
    eval_path: str | None = None
    image_root: str | None = None
    on_bad_record: str = "error"  # error | skip
    num_workers: int = 1
    # Exact-match accuracy of greedy generation on the eval split (meaningful for short answers).
    eval_accuracy: bool = False
    eval_samples: int = 256
    max_new_tokens: int = 8
    # Built-in synthetic data only.
    n_train: int = 4000
    n_eval: int = 200
    image_size: int = 32
    seed: int = 0


@dataclass
class DistConfig:
    """How ranks start (the `dist` group): local | torchrun | deepspeed | slurm; see conf/dist/*.yaml."""

    launcher: str = "local"
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0  # torchrun: this node's rank (0 .. nnodes-1)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # null: a free port (local), derived from the job id (slurm)
    hostfile: str | None = None  # deepspeed: "HOST slots=N" lines
    include: str = ""  # deepspeed: --include, e.g. "node1@node2:0,1"
    exclude: str = ""  # deepspeed: --exclude
    backend: str = "auto"  # auto: nccl on GPU, gloo on CPU
    timeout_s: int = 1800  # a collective that waits longer fails the job (DeepSpeed's default: 30 min)


@dataclass
class LoggerConfig:
    """Weights & Biases logging (rank 0 only)."""

    name: str = "wandb"
    enabled: bool = True
    project: str = "vlm-ds-launcher"
    entity: str | None = None
    mode: str = "auto"  # auto | online | offline | disabled
    tags: list[str] = field(default_factory=list)


@dataclass
class PlanConfig:
    """Memory planner (`python -m launcher.plan`) and the preflight estimate before training starts."""

    # Memory per device and per node, in GiB; null: the detected accelerator (a CPU: its RAM) and RAM.
    gpu_memory_gb: float | None = None
    cpu_memory_gb: float | None = None
    # Fraction of each memory kept free (CUDA context, allocator fragmentation, NCCL buffers).
    headroom: float = 0.1
    # Language-model tokens per sample (text + image tokens); null: text_tokens + the model's image tokens.
    seq_len: int | None = None
    text_tokens: int | None = None  # null: 512 (tiny models: 32)
    images_per_sample: int = 1
    image_size: int | None = None  # pixels per side for dynamic-resolution models (Qwen2-VL); null: 448
    precisions: list[str] | None = None  # null: those the device supports (bf16, fp16, fp32)
    markdown: bool = False  # print the table as Markdown


@dataclass
class Config:
    """The root of the composed config."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # Any DeepSpeed key the groups do not model, deep-merged last; its keys are checked.
    deepspeed_extra: dict[str, Any] = field(default_factory=dict)
    # An existing DeepSpeed JSON to start from ("auto"/null values are filled by the composition).
    deepspeed_json: str | None = None
    # Continue a run from its latest complete checkpoint, in its own run directory: a run directory,
    # or `auto` (resume when hydra.run.dir already holds a checkpoint, e.g. a requeued SLURM job).
    resume: str | None = None
    # Compose, validate, write ds_config.json and print it; train nothing.
    dry_run: bool = False
    # Estimate memory before training: warn (print a line when it is not expected to fit), error, off.
    preflight: str = "warn"
    # Where built-in models and data are cached between runs.
    cache_dir: str = "${oc.env:VLM_LAUNCHER_CACHE,outputs/cache}"
    # The metric a sweep optimises (returned by the job).
    objective: str = "eval/loss"


def register_configs() -> None:
    """Register the root schema; `conf/config.yaml` lists it first in its defaults."""
    ConfigStore.instance().store(name="base_config", node=Config)
