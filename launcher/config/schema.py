"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

The root schema (`base_config`) types the whole composed config, so a misspelt key in a YAML file
or on the command line fails at compose time instead of being silently ignored. This module is
imported by `train.py` before Hydra parses the command line: it must stay free of torch, deepspeed
and transformers so that `python train.py --cfg job` is instant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, DictConfig, OmegaConf

from launcher.core.rundir import RunDir


# ----------------------------------------------------------------------------- closed choices
# Every field with a closed set of values is an enum: OmegaConf refuses anything else when the config
# is composed ("Invalid value 'onlin', expected one of [auto, online, offline, disabled]"), before any
# process starts. Member names equal their values, so the YAML, the command line and the saved
# .hydra/config.yaml all spell a choice the same way, and a member compares equal to its string.
class Choice(str, Enum):
    """A closed choice; behaves as its string value (comparisons, f-strings, JSON)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def _choice(name: str, values: tuple[str, ...]) -> type[Choice]:
    return Choice(name, {value: value for value in values})  # type: ignore[return-value]


Precision = _choice("Precision", ("fp32", "bf16", "fp16", "auto"))
PlannedPrecision = _choice("PlannedPrecision", ("bf16", "fp16", "fp32"))
OffloadDevice = _choice("OffloadDevice", ("none", "cpu", "nvme"))
ModelSource = _choice("ModelSource", ("tiny", "pretrained", "random"))
TinyArch = _choice("TinyArch", ("tiny_llava", "tiny_qwen2_vl"))
OnBadRecord = _choice("OnBadRecord", ("error", "skip"))
Truncation = _choice("Truncation", ("truncate", "skip"))
CacheImages = _choice("CacheImages", ("auto", "encoded", "pixels"))
CacheCheck = _choice("CacheCheck", ("checksums", "sizes"))
DataFormat = _choice("DataFormat", ("auto", "llava", "sharegpt", "messages"))
DistLauncher = _choice("DistLauncher", ("local", "torchrun", "deepspeed", "slurm"))
DistBackend = _choice("DistBackend", ("auto", "nccl", "gloo", "ccl"))
LoggerMode = _choice("LoggerMode", ("auto", "online", "offline", "disabled"))
Preflight = _choice("Preflight", ("warn", "error", "off"))
Method = _choice("Method", ("full", "lora", "qlora"))
AttnImplementation = _choice("AttnImplementation", ("auto", "eager", "sdpa", "flash_attention_2"))
# The kernels of the layers and the loss besides the attention: torch's, or liger-kernel's fused Triton ones.
Kernels = _choice("Kernels", ("torch", "liger"))
Batching = _choice("Batching", ("pad", "group", "pack"))
ShapesTask = _choice("ShapesTask", ("shape", "colour", "motion"))
# A tiny model's starting weights (model.tiny_base): random, or pretrained once on one of the built-in set's
# tasks; auto pretrains where adapters would otherwise learn around noise (launcher.model.method.tiny_base_task).
TinyBase = _choice("TinyBase", ("auto", "random", "shape", "colour"))
QuantType = _choice("QuantType", ("nf4", "fp4"))
# The training objective (the `loss` group): supervised fine-tuning, or a preference loss on chosen and
# rejected answers (launcher.train.preference).
LossName = _choice("LossName", ("sft", "dpo", "ipo"))
PREFERENCE_LOSSES = ("dpo", "ipo")
# Where a preference loss's reference log-probs come from: one pass before training (precomputed), the
# base with the LoRA adapter disabled (adapter), or a frozen copy of the model beside the policy (live).
Reference = _choice("Reference", ("precomputed", "adapter", "live"))
# The presets in conf/deepspeed (launcher.memory.PRESETS holds what each selects; a test keeps them equal).
DeepSpeedPreset = _choice("DeepSpeedPreset", ("z0", "z1", "z2", "z3", "z2_offload", "z3_offload", "z3_nvme"))
# The metric a sweep optimises, and where summary.json keeps it.
OBJECTIVES = {
    "eval/loss": "eval_loss",
    "eval/accuracy": "eval_accuracy",
    "eval/rewards_accuracy": "eval_rewards_accuracy",  # a preference loss's (loss=dpo|ipo)
    "train/loss": "final_loss",
    "perf/samples_per_sec": "samples_per_sec",
    "perf/tokens_per_sec": "tokens_per_sec",
    "perf/mfu": "mfu",
}
Objective = _choice("Objective", tuple(OBJECTIVES))


# ----------------------------------------------------------------------------- the groups
# Where a value lives: a group's option YAML (conf/<group>/<option>.yaml) sets what differs between
# options; the schema holds the types and the few values no option changes. MISSING marks a field
# every option of its group sets; None marks an optional knob ("not used here", "derived", or
# "DeepSpeed's own default"). The training knobs have their values in conf/train/default.yaml only.
@dataclass
class ZeroConfig:
    """ZeRO stage and the knobs that only exist for that stage (names as DeepSpeed spells them)."""

    stage: int = MISSING
    # Stage 3 only (values in conf/zero/stage3.yaml; null: DeepSpeed's default).
    stage3_max_live_parameters: int | None = None
    stage3_max_reuse_distance: int | None = None
    stage3_gather_16bit_weights_on_model_save: bool | None = None
    sub_group_size: int | None = None


@dataclass
class PrecisionConfig:
    """Training dtype; `auto` resolves at run time from what the device supports."""

    dtype: Precision = MISSING
    # fp16 loss scaling (values in conf/precision/fp16.yaml; null: DeepSpeed's default).
    loss_scale: float | None = None
    initial_scale_power: int | None = None
    loss_scale_window: int | None = None
    hysteresis: int | None = None
    min_loss_scale: float | None = None


@dataclass
class OffloadConfig:
    """Where optimizer states and parameters live when they are not on the accelerator."""

    optimizer: OffloadDevice = MISSING
    param: OffloadDevice = MISSING
    # Page-locked host memory for offloaded states: faster transfers, but it cannot be swapped out.
    pin_memory: bool = True
    # NVMe only (values in conf/offload/nvme.yaml): the swap directory, parameter swap buffers
    # (count, elements each) and elements kept in CPU memory before swapping.
    nvme_path: str | None = None
    buffer_count: int | None = None
    buffer_size: int | None = None
    max_in_cpu: int | None = None


@dataclass
class CommConfig:
    """Communication knobs. A null bucket size is derived from the model's hidden size."""

    overlap_comm: bool = MISSING
    contiguous_gradients: bool = MISSING
    reduce_scatter: bool = MISSING
    allgather_partitions: bool = MISSING
    reduce_bucket_size: int | None = MISSING
    allgather_bucket_size: int | None = MISSING
    stage3_prefetch_bucket_size: int | None = MISSING
    stage3_param_persistence_threshold: int | None = MISSING


@dataclass
class TrainConfig:
    """Training knobs: types here, values and their meaning in conf/train/default.yaml."""

    micro_batch_size: int | None = MISSING
    grad_accum: int | None = MISSING
    global_batch_size: int | None = MISSING
    max_steps: int | None = MISSING  # null: train.epochs decides (launcher.entry.resolve_training_length)
    epochs: float | None = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING
    warmup_steps: int | None = MISSING
    warmup_ratio: float | None = MISSING
    min_lr_ratio: float = MISSING
    betas: list[float] = MISSING
    eps: float = MISSING
    grad_clip: float = MISSING
    seed: int = MISSING
    eval_every: int = MISSING
    save_every: int = MISSING
    keep_checkpoints: int = MISSING
    max_nonfinite_steps: int = MISSING
    log_every: int = MISSING
    profile_steps: list[int] | None = MISSING  # [FIRST, LAST]: rank 0 profiles those steps (launcher.train.profile)
    # NAME -> {lr, lr_scale, weight_decay, match}: parameter groups (launcher.model.groups); untyped here,
    # because OmegaConf cannot add a typed entry from a dotted override, and checked by launcher.config.ranges.
    groups: dict[str, Any] = MISSING
    decay_norms_and_biases: bool = MISSING
    # [{steps, train, lr, lr_scale, name}]: what trains when, in one run (launcher.config.stages); untyped
    # for the same reason, checked by launcher.config.ranges.
    stages: Any = MISSING


# The parts of a vision-language model that train or stay frozen (model.freeze_<part>, train.stages).
TRAINABLE = ("vision", "projector", "language")


def freeze_flags(model: Any) -> dict[str, bool]:
    """{part: whether model.freeze_<part> freezes it} of a model config (typed or not)."""
    return {part: bool(getattr(model, f"freeze_{part}")) for part in TRAINABLE}


@dataclass
class ModelConfig:
    """A vision-language model: built tiny from code (`source: tiny`), loaded (`source: pretrained`), or
    model.path's architecture with random weights and a local tokenizer, without a download (`source: random`)."""

    name: str = MISSING
    source: ModelSource = MISSING
    # pretrained, random: a hub id or a local directory (random reads only its config); tiny: null.
    path: str | None = None
    arch: TinyArch | None = None  # tiny models only: the architecture to build
    # Tiny models only: their starting weights. auto: random for a full fine-tune; for adapters (method=lora|qlora)
    # on the built-in data, the tiny model pretrained once on the built-in set's other question (cached), so
    # the adapters learn a second task, as LoRA is used. random, or a task (shape, colour) to pretrain on.
    tiny_base: TinyBase = TinyBase.auto
    freeze_vision: bool = False
    freeze_projector: bool = False
    freeze_language: bool = False
    # Dimensions of a tiny model (values in conf/model/tiny_*.yaml; a pretrained model's config says).
    hidden_size: int | None = None
    num_layers: int | None = None
    vision_hidden_size: int | None = None
    vision_layers: int | None = None
    image_size: int | None = None
    patch_size: int | None = None
    # The attention kernel: auto picks flash_attention_2 where it can run (CUDA, the flash-attn package,
    # bf16/fp16), else sdpa; asking for one that cannot run here stops the job before it starts.
    attn_implementation: AttnImplementation = AttnImplementation.auto
    # Activation (gradient) checkpointing, non-reentrant: recompute each layer's activations in the
    # backward pass instead of keeping them. The language model and the vision tower separately.
    gradient_checkpointing: bool = False
    vision_gradient_checkpointing: bool = False
    # torch.compile each layer's MLP and norms (language model and vision tower), what compilation fuses;
    # not the attention, one fused kernel already. The first steps pay the compilation. Not at ZeRO-3.
    compile: bool = False
    # liger: liger-kernel's fused kernels (launcher.model.kernels): the output layer with the loss, the language
    # model's RMSNorms, SwiGLU MLPs and rotary embedding, the vision tower's LayerNorms. Needs CUDA (and the
    # liger-kernel package); not with model.compile. torch: torch's own.
    kernels: Kernels = Kernels.torch
    # Dynamic-resolution models (Qwen2-VL family): pixels per image after resizing, the main memory lever
    # (image tokens = pixels / (patch_size * merge)^2). null: the processor's own (a tiny model's image_size^2).
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass
class MethodConfig:
    """What is trained (the `method` group): every weight (`full`), LoRA adapters (`lora`), or LoRA on a
    4-bit base (`qlora`, CUDA and bitsandbytes only). Built on peft; values in conf/method/*.yaml."""

    name: Method = MISSING
    r: int = 8  # LoRA rank
    alpha: float = 16  # scaling alpha / r
    dropout: float = 0.05
    # Which linear layers get adapters: [all-linear] (every linear layer of the language model, the
    # output head excluded), or layer names (suffixes such as q_proj, v_proj) within the adapted parts.
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # A regular expression over full module names (re.fullmatch, as peft does); replaces target_modules.
    target_regex: str | None = None
    include_vision: bool = False  # adapters on the vision tower's linear layers too
    # Components trained in full beside the adapters and saved with them: projector, vision, language,
    # or module names. LLaVA's LoRA recipe trains the projector in full.
    modules_to_save: list[str] = field(default_factory=lambda: ["projector"])
    # qlora: the 4-bit quantisation of the frozen base (bitsandbytes).
    quant_type: QuantType = QuantType.nf4
    double_quant: bool = True


@dataclass
class LossConfig:
    """The training objective (the `loss` group): `sft` (the answer tokens' cross-entropy), or a preference
    loss over pairs of a chosen and a rejected answer to the same prompt: `dpo` (DPO's sigmoid loss, with
    label smoothing: conservative DPO) or `ipo` (IPO's squared loss). Values in conf/loss/*.yaml."""

    name: LossName = MISSING
    beta: float = 0.1  # how far the policy may move from the reference (DPO's beta; IPO's tau)
    label_smoothing: float = 0.0  # dpo: the share of pairs assumed mislabelled (0 <= x < 0.5)
    reference: Reference = Reference.precomputed
    # precomputed: a directory of reference log-probs to use (null: cache_dir/reference/KEY, computed
    # before training when missing); it must have been computed for this model and data.
    reference_path: str | None = None
    # Answer tokens per pass through the output layer, each chunk's logits recomputed in the backward pass
    # instead of kept (launcher.model.logps): the whole logits (tokens x vocabulary, fp32) never exist. 0:
    # transformers' own loss over the whole logits.
    chunk_tokens: int = 1024


def is_preference(name: Any) -> bool:
    """Whether loss.name trains on preference pairs (data.pairs' value)."""
    return str(name) in PREFERENCE_LOSSES


if not OmegaConf.has_resolver("is_preference"):
    OmegaConf.register_new_resolver("is_preference", is_preference)


def tiny_llava_image_size(task: Any, grid: Any) -> int:
    """The tiny LLaVA's image side (model.image_size's default, conf/model/tiny_llava.yaml): 32 px, the
    built-in set's images; on the built-in motion task, 64 px per frame of its data.video.grid x grid tiles
    (128 at the default 2): at 32 px a frame is 4 x 4 patches, too coarse for its 2-layer tower to tell
    where the shape is in each (held-out exact match stays at chance), at 64 px 8 x 8 (0.99 within 500
    steps; docs/models.md)."""
    return 64 * int(grid) if str(task) == "motion" else 32


if not OmegaConf.has_resolver("tiny_llava_image_size"):
    OmegaConf.register_new_resolver("tiny_llava_image_size", tiny_llava_image_size)


@dataclass
class SourceConfig:
    """One source of a mixture (data.sources): its file, folder or hub id, and its share of the draws."""

    path: str = MISSING
    weight: float = 1.0
    name: str | None = None  # in per-source metrics (default: the file's name)
    format: DataFormat | None = None  # default: data.format
    image_root: str | None = None  # default: data.image_root, else the file's folder


@dataclass
class VideoConfig:
    """Which frames of a record's video train (launcher/data/video.py): `fps` frames per second of video,
    spread evenly over all of it, at least `min_frames` and at most `max_frames`; each frame scaled down to
    at most `max_pixels` pixels (null: as the video has them). A video over `max_seconds` is a bad record.
    A model that takes frames as images (LLaVA) gets them tiled `grid` x `grid` into each image."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 32
    max_pixels: int | None = 200_704  # 448 x 448
    max_seconds: float | None = 3600.0
    # Frames per image side where the model takes frames as images (the LLaVA family; the Qwen2-VL family
    # takes videos as videos and ignores it): 2 tiles 4 frames in time order into one image, so its vision
    # tower sees them together and a frame costs a quarter of an image's tokens; 1: each frame an image.
    grid: int = 2


@dataclass
class DataConfig:
    """A data set (JSON/JSON lines in llava, sharegpt or messages format, or `datasets` files), or a
    mixture of several (data.sources); `synthetic: true` generates the built-in one first."""

    name: str = MISSING
    synthetic: bool = MISSING
    path: str | None = None  # the training file, `datasets` folder or hub id (unless synthetic or sources)
    eval_path: str | None = None  # an optional held-out set, read the same way
    image_root: str | None = None  # image paths are relative to it (default: the data file's folder)
    format: DataFormat = DataFormat.auto  # auto: detected per file from its first record
    split: str = "train"  # the split of a `datasets` folder or hub id
    eval_split: str | None = None  # the same for data.eval_path (default: train)
    # Several sources drawn by weight, e.g. [{path: a.json, weight: 3}, {path: b.parquet, weight: 1}].
    sources: list[SourceConfig] | None = None
    # error: stop at the first bad record; skip: skip bad records and count them.
    on_bad_record: OnBadRecord = OnBadRecord.error
    max_image_pixels: int = 64_000_000  # a larger image is a bad record (a decompression bomb)
    video: VideoConfig = field(default_factory=VideoConfig)  # how records' videos are sampled
    # Tokens per sample as the model sees them (text + image tokens); null: no limit. A longer record is
    # cut (truncate: the answer side from the end, images kept whole, the prompt kept, at least 16 answer
    # tokens kept, else skipped) or skipped (skip); skipped records are listed in RUN/skipped_records.jsonl.
    # The memory planner plans for it (a batch is padded to its longest record).
    max_length: int | None = 2048
    truncation: Truncation = Truncation.truncate
    # Tokenize every record once into cache_dir/data_cache (memory-mapped shards that every rank builds).
    cache: bool = True
    # Read the training records from their shard files as training goes (launcher/data/stream.py): nothing
    # indexed or cached first; data.path is a file, a folder, a glob or an fsspec URL of them. Needs
    # train.max_steps (a stream's length is not counted) and one data.path (no mixture, no length grouping).
    streaming: bool = False
    # Streaming: rows shuffled together, in blocks of this many consecutive rows (1: the files' order).
    shuffle_block: int = 1000
    # How the cache keeps images: encoded (the files' bytes; DataLoader workers decode and process them),
    # pixels (the image processor's float32 output: no image work per step, ~50x the disk), or auto: pixels
    # while the split's pixel values surely fit in 2 GiB (images of a fixed size), encoded otherwise.
    cache_images: CacheImages = CacheImages.auto
    # What each start checks of a built cache before training on it: every file's size and checksum (reads
    # the whole cache: disk-bound, ~8 GB/s from the page cache), or the sizes alone (a stat per file).
    cache_check: CacheCheck = CacheCheck.checksums
    # Batches of records of similar length (less padding); needs data.cache (the lengths come from it).
    group_by_length: bool = False
    # Several records per row up to data.pack_length tokens, kept apart (positions restart per record, a
    # block-diagonal mask): no padding but a row's tail. train.micro_batch_size then counts rows. Needs
    # data.cache (the lengths come from it) and train.max_steps.
    packing: bool = False
    pack_length: int | None = None  # tokens per packed row; null: data.max_length
    # The most images one packed row may hold (a video: the images its frames make): a row's vision-tower
    # activations grow with its images, and rows that gather short records hold several times the mean
    # (docs/planning.md). null: no limit.
    pack_max_images: int | None = None
    # Every batch runs the vision tower (a dummy image where a batch has none; and a dummy video where the
    # data has videos a Qwen2-VL-family model takes as videos), so that ranks whose batches differ in
    # modality cannot hang ZeRO-3's collectives. null: on at ZeRO-3 with several ranks.
    modality_guard: bool | None = None
    num_workers: int = MISSING  # DataLoader worker processes (0: decode images in the training process)
    # Exact-match accuracy of greedy generation on the eval split (meaningful for short answers).
    eval_accuracy: bool = MISSING
    eval_samples: int = 256
    max_new_tokens: int = 8
    # Built-in synthetic data only (values in conf/data/shapes.yaml).
    n_train: int | None = None
    n_eval: int | None = None
    image_size: int | None = None
    seed: int | None = None
    # Which question the built-in images ask: shape ("what is in the image?" -> "red circle") or colour
    # ("what colour is the shape?" -> "red"), a second task on the same kind of images; or motion, 2 s
    # videos of a shape crossing the frame ("which way does the shape move?" -> "left"), which no single
    # frame answers.
    task: ShapesTask = ShapesTask.shape
    # Records are preference pairs (a chosen and a rejected answer), each read as two adjacent records:
    # set by the loss (a preference loss), not by hand.
    pairs: bool = II("is_preference:${loss.name}")


@dataclass
class DistConfig:
    """How ranks start (the `dist` group): local | torchrun | deepspeed | slurm; see conf/dist/*.yaml."""

    launcher: DistLauncher = MISSING
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0  # torchrun: this node's rank (0 .. nnodes-1)
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # null: a free port (local), derived from the job id (slurm)
    hostfile: str | None = None  # deepspeed: "HOST slots=N" lines
    include: str = ""  # deepspeed: --include, e.g. "node1@node2:0,1"
    exclude: str = ""  # deepspeed: --exclude
    backend: DistBackend = DistBackend.auto  # auto: nccl on GPU, gloo on CPU
    timeout_s: int = 1800  # a collective that waits longer fails the job (DeepSpeed's default: 30 min)
    # A training step that takes longer dumps every thread's Python stack to errors/ and ends the job with
    # one line (a hang: ranks waiting on each other). 0 or null: no watchdog.
    step_timeout_s: float | None = 900


@dataclass
class LoggerConfig:
    """Weights & Biases logging (rank 0 only)."""

    name: str = MISSING
    enabled: bool = MISSING
    project: str = "vlm-ds-launcher"
    entity: str | None = None
    # auto: online when logged in, offline (inside the run directory) otherwise.
    mode: LoggerMode = LoggerMode.auto
    tags: list[str] = field(default_factory=list)
    # Steps between W&B history rows, each the mean over its steps (metrics.jsonl keeps every step).
    log_every: int = 10


@dataclass
class PlanConfig:
    """Memory planner (`python -m launcher.plan`) and the preflight estimate before training starts."""

    # Memory per device and per node, in GiB; null: the detected accelerator (a CPU: its RAM) and RAM.
    gpu_memory_gb: float | None = None
    cpu_memory_gb: float | None = None
    # Fraction of each memory kept free (CUDA context, allocator fragmentation, NCCL buffers).
    headroom: float = 0.1
    # Language-model tokens per sample (text + image tokens); null: the longest record's where the job's data
    # cache is built (docs/planning.md), else data.max_length where set (the most a sample holds), else
    # text_tokens + the model's image tokens.
    seq_len: int | None = None
    text_tokens: int | None = None  # null: 512 (tiny models: 32)
    images_per_sample: int = 1
    # Videos per sample, each planned as its data.video.max_frames frames train: data.video.grid^2 frames tiled
    # into an image (LLaVA), or a pair per temporal patch (the Qwen2-VL family).
    videos_per_sample: int = 0
    image_size: int | None = None  # pixels per side for dynamic-resolution models (Qwen2-VL); null: 448
    precisions: list[PlannedPrecision] | None = None  # null: those the device supports (bf16, fp16, fp32)
    markdown: bool = False  # print the table as Markdown


@dataclass
class TuneConfig:
    """Autotuner (`python -m launcher.tune`): the search space, the memory budget, the measurement."""

    # The space; each list null: its default (docs/tune.md). Micro batch sizes keep the global batch.
    presets: list[DeepSpeedPreset] | None = None  # null: every preset but z3_nvme (which needs offload.nvme_path)
    precisions: list[PlannedPrecision] | None = None  # null: those the device supports
    micro_batch_sizes: list[int] | None = None  # null: half, once and twice train.micro_batch_size
    gradient_checkpointing: list[bool] = field(default_factory=lambda: [False, True])
    attn_implementations: list[AttnImplementation] | None = None  # null: model.attn_implementation only
    # How micro batches are filled: pad (to the longest record), group (data.group_by_length), pack
    # (data.packing); null: the job's own. Candidates are compared by real (non-padding) tokens/s.
    batching: list[Batching] | None = None
    pack_lengths: list[int] | None = None  # tokens per packed row of `pack`; null: the job's data.pack_length
    kernels: list[Kernels] | None = None  # model.kernels of the candidates (torch, liger); null: the job's own
    # Memory one rank may use, in GiB: a GPU's device memory (CUDA out-of-memory also ends a candidate);
    # on a CPU, a rank's peak resident set size, enforced by the tuner. null: the planner's usable memory.
    memory_gb: float | None = None
    margin: float = 0.1  # prune a candidate predicted above the budget by more than this fraction
    warmup_steps: int = 1  # steps run before measuring: the first is 15-35% slower, the second is not (docs/tune.md)
    measure_steps: int = 4  # steps measured per candidate
    prune: bool = True  # skip candidates predicted not to fit (false: run every one, an exhaustive sweep)
    # Stop a candidate that a measured one beats on speed and on memory; skip one with gradient
    # checkpointing whose twin without it fits (or lost to one that fits): it cannot be faster.
    early_skip: bool = True
    skip_margin: float = 0.1  # ... by more than this fraction of speed
    loss_tolerance: float = 1e-4  # first losses (fp32) may differ from the reference by this (relative)
    low_precision_loss_tolerance: float = 2e-2  # ... in bf16/fp16
    candidate_timeout_s: float = 900  # a candidate running longer fails
    # Confirmation: the confirm_top fastest candidates that fit run confirm_runs times more, in turn; each
    # is then the median of its runs (one run on a busy machine can mislead), and where the runs cannot tell
    # the fastest from another, the simpler is picked. 0 runs: none.
    confirm_top: int = 3
    confirm_runs: int = 2
    dir: str | None = None  # null: outputs/tune/DATE/TIME


@dataclass
class Config:
    """The root of the composed config."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
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
    preflight: Preflight = Preflight.warn
    # Where built-in models and data are cached between runs.
    cache_dir: str = "${oc.env:VLM_LAUNCHER_CACHE,outputs/cache}"
    # The metric a sweep optimises (returned by the job).
    objective: Objective = Objective["eval/loss"]


def register_configs() -> None:
    """Register the root schema (`conf/config.yaml` lists it first in its defaults) and the resolver that
    puts a resume in its own run directory (`hydra.run.dir` in conf/config.yaml), and the one that lets
    train.epochs replace train.max_steps's default."""
    ConfigStore.instance().store(name="base_config", node=Config)
    if not OmegaConf.has_resolver("run_dir_of"):
        OmegaConf.register_new_resolver("run_dir_of", run_dir_of)
    if not OmegaConf.has_resolver("steps_unless_epochs"):
        OmegaConf.register_new_resolver("steps_unless_epochs", steps_unless_epochs)


DEFAULT_MAX_STEPS = 1000


def steps_unless_epochs(epochs: Any) -> int | None:
    """train.max_steps's default (conf/train/default.yaml): 1000 steps, or none when train.epochs is given,
    so `train.epochs=1` alone trains one epoch; a train.max_steps given beside it still wins."""
    return DEFAULT_MAX_STEPS if epochs is None else None


def run_dir_of(resume: str | None, fresh: str) -> str:
    """Where a job runs: `resume=DIR` continues in DIR when a job was started there (its command line is
    in DIR/.hydra/overrides.yaml); any other job in `fresh` (a new dated directory, or hydra.run.dir)."""
    if resume in (None, "", "auto", "null"):
        return fresh
    run_dir = Path(str(resume)).expanduser().absolute()
    return str(run_dir) if RunDir(run_dir).is_run() else fresh


# ----------------------------------------------------------------------------- the typed form
def typed(cfg: DictConfig) -> Config:
    """A composed config as the schema's dataclasses: every value typed, every interpolation resolved."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def from_plain(data: dict[str, Any]) -> Config:
    """A config written out with `plain` (job.json's), typed again."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), data))  # type: ignore[return-value]


def config_from_yaml(path: Path) -> Config:
    """A run's `.hydra/config.yaml` (as written, interpolations and all), typed and resolved."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path)))  # type: ignore[return-value]


def plain(node: Any) -> Any:
    """A typed config (or any part of it) as JSON data: dataclasses as dicts, choices as their strings."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return {f.name: plain(getattr(node, f.name)) for f in dataclasses.fields(node)}
    if isinstance(node, Enum):
        return node.value
    if isinstance(node, dict):
        return {key: plain(value) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [plain(value) for value in node]
    return node
