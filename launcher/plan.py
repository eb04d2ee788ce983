"""Memory planner: what each DeepSpeed preset needs per device for a model, before anything starts.

    python -m launcher.plan model=llava_1_5_7b dist.nproc_per_node=8 plan.gpu_memory_gb=80
    python -m launcher.plan                      # the built-in tiny model on this machine

Takes the same overrides as train.py. The model is built on the meta device from its config (no
weights are read), its parameters are counted per component with the configured freezing, and every
preset x precision is estimated per device: model states (parameters, gradients, fp32 master
weights, Adam states, as ZeRO partitions and offloads them), the optimizer step's fp32 gradients,
communication buffers and activations. `preflight()` estimates only the job about to run.

The arithmetic (the first half of this file) is pure: counts in, bytes out, no torch. Every formula
is stated in the docstring of the function that applies it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.errors import LauncherError, one_line

GiB = 2**30
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
PRECISION_ORDER = ("bf16", "fp16", "fp32")  # fastest first, at equal memory bf16 before fp16 (no loss scaling)

# The presets in conf/deepspeed, fastest first: (zero stage, offload.optimizer, offload.param).
# tests/test_plan.py checks this table against the composed presets.
PRESETS: dict[str, tuple[int, str, str]] = {
    "z0": (0, "none", "none"),
    "z1": (1, "none", "none"),
    "z2": (2, "none", "none"),
    "z3": (3, "none", "none"),
    "z2_offload": (2, "cpu", "none"),
    "z3_offload": (3, "cpu", "cpu"),
    "z3_nvme": (3, "nvme", "nvme"),
}

# DeepSpeed 0.19's defaults for zero_optimization keys a dict may leave out.
_DS_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "allgather_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "sub_group_size": 1_000_000_000,
}
_STAGE0_ALLREDUCE_BUCKET = 500_000_000  # elements DeepSpeed flattens per all-reduce at stage 0


# ================================================================================ pure arithmetic
@dataclass(frozen=True)
class Layout:
    """The part of a DeepSpeed dict (and of the job's shape) that memory depends on."""

    stage: int
    dtype: str  # fp32 | bf16 | fp16
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"
    world_size: int = 1
    ranks_per_node: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    reduce_bucket: int = _DS_DEFAULTS["reduce_bucket_size"]
    allgather_bucket: int = _DS_DEFAULTS["allgather_bucket_size"]
    prefetch_bucket: int = _DS_DEFAULTS["stage3_prefetch_bucket_size"]
    persistence_threshold: int = _DS_DEFAULTS["stage3_param_persistence_threshold"]
    sub_group_size: int = _DS_DEFAULTS["sub_group_size"]
    nvme_buffer_count: int = 5
    nvme_buffer_size: int = 100_000_000

    @property
    def preset(self) -> str | None:
        """The conf/deepspeed preset with this stage and offload, if one has them."""
        for name, (stage, optimizer, param) in PRESETS.items():
            if (stage, optimizer, param) == (self.stage, self.offload_optimizer, self.offload_param):
                return name
        return None

    def describe(self) -> str:
        """'deepspeed=z2 bf16 on 8 ranks', or the stage and offload when no preset matches."""
        where = f"deepspeed={self.preset}"
        if self.preset is None:
            offload = f"optimizer={self.offload_optimizer} param={self.offload_param}"
            where = f"zero stage {self.stage} with offload {offload}"
        return f"{where} {self.dtype} on {self.world_size} rank{'s' if self.world_size > 1 else ''}"


def layout_from_ds_config(ds: Mapping[str, Any], *, world_size: int, ranks_per_node: int) -> Layout:
    """Read a final DeepSpeed dict (as `build_ds_config` returns it); missing keys take DeepSpeed's defaults."""
    zero = ds.get("zero_optimization") or {}
    dtype = "fp16" if (ds.get("fp16") or {}).get("enabled") else "fp32"
    if (ds.get("bf16") or {}).get("enabled") or (ds.get("bfloat16") or {}).get("enabled"):
        dtype = "bf16"
    offload_param = zero.get("offload_param") or {}

    def get(key: str) -> int:
        value = zero.get(key)
        return int(_DS_DEFAULTS[key] if value is None else value)

    return Layout(
        stage=int(zero.get("stage", 0)),
        dtype=dtype,
        offload_optimizer=(zero.get("offload_optimizer") or {}).get("device", "none") or "none",
        offload_param=offload_param.get("device", "none") or "none",
        world_size=world_size,
        ranks_per_node=max(1, min(ranks_per_node, world_size)),
        micro_batch=int(ds.get("train_micro_batch_size_per_gpu", 1)),
        grad_accum=int(ds.get("gradient_accumulation_steps", 1)),
        reduce_bucket=get("reduce_bucket_size"),
        allgather_bucket=get("allgather_bucket_size"),
        prefetch_bucket=get("stage3_prefetch_bucket_size"),
        persistence_threshold=get("stage3_param_persistence_threshold"),
        sub_group_size=get("sub_group_size"),
        nvme_buffer_count=int(offload_param.get("buffer_count", 5)),
        nvme_buffer_size=int(offload_param.get("buffer_size", 100_000_000)),
    )


@dataclass(frozen=True)
class ModelStates:
    """Bytes one rank holds for its model states, wherever they live (device, CPU or NVMe)."""

    params: int
    grads: int
    master: int  # fp32 master weights
    optimizer: int  # Adam's two moments
    on_cpu: int  # the part of the four above that lives in CPU memory
    on_nvme: int  # ... and on NVMe

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def on_device(self) -> int:
        return self.total - self.on_cpu - self.on_nvme


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def model_state_bytes(total: int, trainable: int, layout: Layout, *, persistent: int = 0) -> ModelStates:
    """Bytes of parameters, gradients, master weights and Adam states one rank holds.

    With e = bytes per element of the training dtype (4 fp32, 2 bf16/fp16), P = all parameters,
    T = trainable parameters, N = world size, t = ceil(T / N) (one rank's partition):

    | stage | parameters            | gradients | fp32 master              | Adam (m, v) |
    |-------|-----------------------|-----------|--------------------------|-------------|
    | 0     | e P                   | e T       | 4 T if e = 2, else none  | 8 T         |
    | 1     | e P                   | e T       | 4 t                      | 8 t         |
    | 2     | e P                   | e t       | 4 t                      | 8 t         |
    | 3     | e (ceil(P/N) + K)     | e t       | 4 t                      | 8 t         |

    This is what DeepSpeed 0.19 keeps between steps. Stage 0 in bf16/fp16 runs DeepSpeed's FP16
    optimizer, which keeps a full fp32 copy; ZeRO 1-3 keep an fp32 partition even when training
    in fp32 (a copy, not a view). Stage 1 partitions only the optimizer: each rank accumulates the
    full gradient before reducing it. K = parameters that stage 3 keeps whole on every rank (each
    of at most stage3_param_persistence_threshold elements), on top of their partitions. Frozen
    parameters cost only their e P (stage 3: partitioned like the others).

    Offload (ZeRO-Offload, ZeRO-Infinity) moves the master weights and Adam states to the CPU
    (NVMe) and adds what the CPU optimizer step needs there: an fp32 gradient partition (4 t), a
    16-bit copy of the parameter partition at stages 1-2 (e t) or the 16-bit gradient partition at
    stage 3 (e t), and at stages 1-2 with gradient accumulation the accumulated gradients (e t).
    Parameter offload moves stage 3's partitions (e ceil(P/N)) to the CPU (NVMe); K stays.
    """
    e = BYTES[layout.dtype]
    n, stage = layout.world_size, layout.stage
    if stage not in (0, 1, 2, 3):
        raise LauncherError(f"zero stage {stage} is unknown: use 0, 1, 2 or 3")
    part = _ceil_div(trainable, n) if stage > 0 else trainable
    if stage == 3:
        partitions = e * _ceil_div(total, n)
        params = partitions + e * persistent
    else:
        partitions = 0
        params = e * total
    grads = e * trainable if stage <= 1 else e * part
    master = 4 * part if (stage > 0 or e == 2) else 0
    optimizer = 8 * part
    on_cpu = on_nvme = 0

    offload_optimizer = layout.offload_optimizer if stage > 0 else "none"
    if offload_optimizer != "none":
        cpu_grads = 4 * part  # the fp32 gradient partition the CPU step reads
        if stage == 3:
            cpu_grads += e * part  # 16-bit gradient partitions, kept next to the CPU optimizer
            grads = cpu_grads
        else:
            params += e * part  # the 16-bit partition the CPU step writes, then copied to the device
            if layout.grad_accum > 1:
                cpu_grads += e * part  # gradients accumulated on the CPU between steps
            # stage 2 keeps no gradient partition on the device; stage 1 still accumulates full ones
            grads = cpu_grads + (e * trainable if stage == 1 else 0)
        offloaded = master + optimizer + cpu_grads + (0 if stage == 3 else e * part)
        if offload_optimizer == "nvme":
            on_nvme += master + optimizer + 4 * part
            on_cpu += offloaded - (master + optimizer + 4 * part)
        else:
            on_cpu += offloaded
    if stage == 3 and layout.offload_param != "none":
        if layout.offload_param == "nvme":
            on_nvme += partitions
        else:
            on_cpu += partitions
    return ModelStates(params, grads, master, optimizer, on_cpu, on_nvme)


@dataclass(frozen=True)
class TransformerDims:
    """The shapes activations depend on, for one stack of transformer layers."""

    hidden: int
    layers: int
    intermediate: int
    kv_width: int = 0  # key/value width (heads x head dim); 0: as wide as hidden
    gated: bool = False  # SwiGLU-style MLP (gate, up, down) rather than fc1, act, fc2


@dataclass(frozen=True)
class ModelStats:
    """What the estimates need to know about a model: counts and shapes, no weights."""

    name: str
    total: int  # unique parameters (tied weights once)
    trainable: int
    components: Mapping[str, int]  # vision / projector / language parameters
    frozen: tuple[str, ...]  # frozen components
    largest_layer: int  # the most parameters one module owns directly (DeepSpeed's "largest layer")
    param_sizes: tuple[int, ...]  # every parameter's element count (stage-3 persistence)
    text: TransformerDims
    vocab_size: int
    vision: TransformerDims
    vision_tokens: int  # vision-tower tokens per image
    image_tokens: int  # language-model tokens per image
    projector_width: int  # elements the projector keeps per language-model image token
    load_bytes: int = 4  # bytes per parameter of the checkpoint as it is loaded into CPU memory

    def persistent(self, threshold: int) -> int:
        """Parameters stage 3 keeps whole on every rank: those of at most `threshold` elements."""
        return sum(size for size in self.param_sizes if size <= threshold)


def activation_bytes(stats: ModelStats, layout: Layout, *, seq_len: int, images: int) -> int:
    """Activations kept for the backward pass, per rank, for one micro batch.

    b = micro batch, s = language-model tokens per sample (text + image tokens), e = bytes per
    element, per layer and token (elements), measured on transformers 5.24 layers with PyTorch's
    scaled-dot-product attention (which keeps no s x s score matrix) and no activation checkpointing:
      language layer (Llama/Qwen2: RMSNorm, rotary attention, gated MLP):
          10 h + 2 kv + 4 i   in bf16/fp16 (8 h + ... in fp32: RMSNorm's fp32 upcast is then free)
      vision layer (CLIP / Qwen2-VL ViT: LayerNorm, attention, plain MLP): 12 h + 2 i (4 i if gated)
      projector: about 2 (h_vision m^2 + h) per image token (m: patch merge, 1 for LLaVA)
      logits: s V (2 e + 8) bytes: the logits, their fp32 copy for the loss, and the gradients of both
    activations = b [e s (L (10 h + 2 kv + 4 i) + 3 h) + e n_img v L_v (12 h_v + 2 i_v) + projector + logits]
    A component's activations count only when something at or before it trains (vision -> projector
    -> language): a frozen vision tower keeps nothing for backward.
    """
    if stats.trainable == 0:
        return 0
    e = BYTES[layout.dtype]
    trains = {name: name not in stats.frozen for name in ("vision", "projector", "language")}
    text = stats.text
    kv = text.kv_width or text.hidden
    norms = 8 if layout.dtype == "fp32" else 10
    per_layer = norms * text.hidden + 2 * kv + (4 if text.gated else 2) * text.intermediate
    final_norm = (2 if layout.dtype == "fp32" else 3) * text.hidden
    elements = seq_len * (text.layers * per_layer + final_norm)
    if trains["vision"]:
        vision = stats.vision
        vision_layer = 12 * vision.hidden + (4 if vision.gated else 2) * vision.intermediate
        elements += images * stats.vision_tokens * vision.layers * vision_layer
    if trains["vision"] or trains["projector"]:
        elements += images * stats.image_tokens * stats.projector_width
    logits = seq_len * stats.vocab_size * (2 * e + 8)
    return layout.micro_batch * (e * elements + logits)


@dataclass(frozen=True)
class Estimate:
    """Per-rank device memory and per-node CPU memory of one configuration."""

    layout: Layout
    states: ModelStates
    step: int  # fp32 gradients the optimizer step builds on the device (freed after the step)
    buffers: int  # communication buckets; stage 3: gathered layers and prefetch
    activations: int
    cpu_per_node: int  # CPU memory per node: offloaded states, or loading the checkpoint
    nvme_per_node: int
    seq_len: int

    @property
    def device_total(self) -> int:
        return self.states.on_device + self.step + self.buffers + self.activations


def step_and_buffer_bytes(stats: ModelStats, layout: Layout) -> tuple[int, int]:
    """(optimizer-step fp32 gradients, communication buffers) on the device, per rank.

    Step: DeepSpeed converts the gradient it updates to fp32 at the optimizer step: 4 T at stage 0
    in bf16/fp16 (the FP16 optimizer's flat fp32 gradient), 4 t at stages 1-3 (the flat partition);
    none at stage 0 in fp32 or with optimizer offload (counted on the CPU, where it is kept).
    Buffers: stage 0 flattens gradients for all-reduce, up to e min(T, 5e8) when N > 1; stages 1-2
    keep e (reduce bucket + allgather bucket); stage 3 keeps e (reduce bucket + prefetch bucket
    + 2 x largest layer): DeepSpeed's own estimator counts 4 bytes (a 16-bit parameter and its
    gradient) per element of the largest layer for the gathered working set.
    """
    e = BYTES[layout.dtype]
    trainable, n = stats.trainable, layout.world_size
    if layout.stage == 0:
        step = 4 * trainable if e == 2 else 0
        buffers = e * min(trainable, _STAGE0_ALLREDUCE_BUCKET) if n > 1 else 0
    else:
        step = 0 if layout.offload_optimizer != "none" else 4 * _ceil_div(trainable, n)
        if layout.stage < 3:
            buffers = e * (min(layout.reduce_bucket, trainable) + min(layout.allgather_bucket, trainable))
        else:
            buffers = e * (
                min(layout.reduce_bucket, trainable)
                + min(layout.prefetch_bucket, stats.total)
                + 2 * stats.largest_layer
            )
    return step, buffers


def estimate(stats: ModelStats, layout: Layout, *, seq_len: int, images: int = 1) -> Estimate:
    """Everything one configuration needs: see model_state_bytes, step_and_buffer_bytes, activation_bytes.

    CPU per node = max(loading, offloaded): before DeepSpeed takes the model, each rank on the node
    loads the checkpoint into CPU memory (load_bytes x P per rank; at stage 3 transformers partitions
    while loading, so one layer at a time); offloaded states (and NVMe swap buffers) come after.
    """
    persistent = stats.persistent(layout.persistence_threshold) if layout.stage == 3 else 0
    states = model_state_bytes(stats.total, stats.trainable, layout, persistent=persistent)
    step, buffers = step_and_buffer_bytes(stats, layout)
    activations = activation_bytes(stats, layout, seq_len=seq_len, images=images)
    ranks = layout.ranks_per_node
    if layout.stage == 3:
        loading = ranks * stats.load_bytes * stats.largest_layer
    else:
        loading = ranks * stats.load_bytes * stats.total
    swap = 0
    if layout.offload_param == "nvme":
        swap += layout.nvme_buffer_count * layout.nvme_buffer_size * BYTES[layout.dtype]
    if layout.offload_optimizer == "nvme":
        swap += 16 * min(layout.sub_group_size, _ceil_div(stats.trainable, layout.world_size))
    cpu = max(loading, ranks * (states.on_cpu + swap))
    return Estimate(
        layout=layout,
        states=states,
        step=step,
        buffers=buffers,
        activations=activations,
        cpu_per_node=cpu,
        nvme_per_node=ranks * states.on_nvme,
        seq_len=seq_len,
    )


@dataclass(frozen=True)
class Target:
    """The machine planned for: memory per device and per node, and the precisions it has."""

    kind: str  # cuda | cpu | another DeepSpeed accelerator's name
    device_bytes: int
    cpu_bytes: int | None  # None: unknown (planning for another machine), not checked
    precisions: tuple[str, ...]
    headroom: float  # fraction of each memory kept free
    source: str  # where device_bytes came from, for the report

    @property
    def usable_device(self) -> int:
        return int(self.device_bytes * (1.0 - self.headroom))

    @property
    def usable_cpu(self) -> int | None:
        return None if self.cpu_bytes is None else int(self.cpu_bytes * (1.0 - self.headroom))


def fits(est: Estimate, target: Target) -> tuple[bool, str]:
    """Whether the estimate fits the target, and if not, why (one phrase).

    On a CPU "device" the ranks of a node and the offloaded states share one memory.
    """
    if target.kind == "cpu":
        need = est.layout.ranks_per_node * est.device_total + est.cpu_per_node
        if need > target.usable_device:
            return False, f"needs about {need / GiB:.1f} GiB of this machine's memory"
        return True, ""
    if est.device_total > target.usable_device:
        return False, f"needs about {est.device_total / GiB:.1f} GiB per device"
    if target.usable_cpu is not None and est.cpu_per_node > target.usable_cpu:
        return False, f"needs about {est.cpu_per_node / GiB:.1f} GiB of CPU memory per node"
    return True, ""


def recommend(rows: Sequence[Row]) -> Row | None:
    """The fastest row expected to fit: presets in PRESETS order, then bf16, fp16, fp32."""
    order = list(PRESETS)

    def speed(row: Row) -> tuple[int, int]:
        return order.index(row.preset), PRECISION_ORDER.index(row.dtype)

    fitting = [row for row in rows if row.fits and row.preset in PRESETS]
    return min(fitting, key=speed) if fitting else None


# ================================================================================ the model
def model_dir(cfg: DictConfig) -> str:
    """The directory or hub id whose config.json describes the model `train.py` would train.

    A tiny model is built the way the training path builds it (from the data's vocabulary, cached
    under cache_dir), so its vocabulary, and with it its parameter count, is the one training uses.
    """
    model = cfg.model
    if model.source == "pretrained":
        if not model.path:
            raise LauncherError(f"model.path is empty for model={model.name}: give a hub id or a local directory")
        return str(model.path)
    if model.source != "tiny":
        raise LauncherError(f"model.source={model.source} is unknown: use tiny or pretrained")
    from launcher.data import load_records
    from launcher.train_loop import prepare_data, resolve_model_path

    cache = Path(cfg.cache_dir).expanduser().absolute()
    train_file, eval_file, image_root = prepare_data(cfg, cache)
    records, _ = load_records(train_file, image_root, on_bad_record=cfg.data.on_bad_record)
    if eval_file is not None:
        records += load_records(eval_file, image_root, on_bad_record=cfg.data.on_bad_record)[0]
    return resolve_model_path(cfg, cache, records)


def _read_config(path: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise LauncherError(
            f"model.path={path}: cannot read its config ({one_line(err)}); give a local directory holding "
            "config.json or a reachable hub id"
        ) from None


def model_stats(cfg: DictConfig, *, path: str | None = None) -> ModelStats:
    """Build the model on the meta device from its config and count what the estimates need."""
    import torch
    from transformers import AutoModelForImageTextToText

    from launcher.models import apply_freeze

    path = path or model_dir(cfg)
    config = _read_config(path)
    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except ValueError as err:
        raise LauncherError(f"model.path={path}: not an image-text-to-text model ({one_line(err)})") from None
    freeze = {
        "vision": bool(cfg.model.freeze_vision),
        "projector": bool(cfg.model.freeze_projector),
        "language": bool(cfg.model.freeze_language),
    }
    counts = apply_freeze(model, **freeze)
    try:
        return _stats(cfg, config, model, counts, freeze)
    except AttributeError as err:  # a config without the fields of the layouts known here
        raise LauncherError(
            f"model.path={path}: the memory planner does not know the layout of {type(config).__name__} ({err}); "
            "set preflight=off to train without the estimate"
        ) from None


def _stats(cfg: DictConfig, config, model, counts: dict[str, int], freeze: dict[str, bool]) -> ModelStats:
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())
    names = [name for name, _ in model.named_modules()]

    def gated(*parts: str) -> bool:
        return any(name.endswith("gate_proj") and any(part in name for part in parts) for name in names)

    text_config = config.get_text_config()
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    text = TransformerDims(
        hidden=text_config.hidden_size,
        layers=text_config.num_hidden_layers,
        intermediate=text_config.intermediate_size,
        kv_width=(getattr(text_config, "num_key_value_heads", None) or heads) * head_dim,
        gated=gated("language_model"),
    )
    vision_config = config.vision_config
    vision_hidden = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
    vision = TransformerDims(
        hidden=vision_hidden,
        layers=getattr(vision_config, "num_hidden_layers", None) or vision_config.depth,
        intermediate=getattr(vision_config, "intermediate_size", None) or int(vision_config.mlp_ratio * vision_hidden),
        gated=gated("visual", "vision_tower"),
    )
    vision_tokens, image_tokens, merge = _image_tokens(cfg, config)
    return ModelStats(
        name=str(cfg.model.name),
        total=counts["total"],
        trainable=counts["trainable"],
        components={key: counts[key] for key in ("vision", "projector", "language")},
        frozen=tuple(name for name, frozen in freeze.items() if frozen),
        largest_layer=int(largest),
        param_sizes=tuple(int(p.numel()) for p in model.parameters()),
        text=text,
        vocab_size=int(text_config.vocab_size),
        vision=vision,
        vision_tokens=vision_tokens,
        image_tokens=image_tokens,
        projector_width=2 * (vision_hidden * merge * merge + text.hidden),
        load_bytes=_dtype_bytes(getattr(config, "dtype", None)),
    )


def _dtype_bytes(dtype: Any) -> int:
    name = str(dtype or "float32").removeprefix("torch.")
    return {"float16": 2, "bfloat16": 2, "half": 2}.get(name, 4)


def _image_tokens(cfg: DictConfig, config) -> tuple[int, int, int]:
    """(vision-tower tokens, language-model tokens, patch merge) for one image.

    LLaVA: (image_size / patch)^2 patches, plus CLIP's class token in the tower; the "default"
    feature strategy drops it again. Qwen2-VL (dynamic resolution): a square image of plan.image_size
    pixels (default 448; a tiny model's own image size) rounded to whole merged patches; the merger
    turns m x m patches into one language-model token.
    """
    vision_config = config.vision_config
    patch = vision_config.patch_size
    merge = getattr(vision_config, "spatial_merge_size", None)
    if merge:
        side = cfg.plan.image_size or (cfg.model.image_size if cfg.model.source == "tiny" else 448)
        unit = patch * merge
        patches = (max(1, round(side / unit)) * merge) ** 2
        return patches, patches // (merge * merge), merge
    patches = (vision_config.image_size // patch) ** 2
    cls = 1 if str(getattr(vision_config, "model_type", "")).startswith("clip") else 0
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    return patches + cls, patches + (cls if strategy == "full" else 0), 1


def sequence(cfg: DictConfig, stats: ModelStats) -> tuple[int, int]:
    """(language-model tokens per sample, images per sample).

    plan.seq_len when set; else plan.text_tokens (default 512, or 32 for tiny models, whose built-in
    conversations are about 15 text tokens) plus the image tokens of plan.images_per_sample images.
    """
    plan = cfg.plan
    images = int(plan.images_per_sample)
    if plan.seq_len:
        return int(plan.seq_len), images
    text = plan.text_tokens or (32 if cfg.model.source == "tiny" else 512)
    return int(text) + images * stats.image_tokens, images


# ================================================================================ the machine
def target_device(plan: DictConfig) -> Target:
    """The device planned for: plan.gpu_memory_gb, else the detected accelerator's memory (a CPU: RAM)."""
    import psutil

    from launcher.validate import detect_device

    device = detect_device()
    ram = int(psutil.virtual_memory().total)
    cpu_bytes = int(plan.cpu_memory_gb * GiB) if plan.cpu_memory_gb else ram
    if device.kind == "cpu" and plan.gpu_memory_gb:
        # Planning a GPU job from a machine without one: assume a current GPU (bf16 and fp16), and
        # check CPU memory only when plan.cpu_memory_gb says how much that machine has.
        kind, precisions = "cuda", ("bf16", "fp16", "fp32")
        cpu_bytes = int(plan.cpu_memory_gb * GiB) if plan.cpu_memory_gb else None
        source = f"plan.gpu_memory_gb={plan.gpu_memory_gb:g}"
    else:
        kind = device.kind
        precisions = tuple(p for p, ok in (("bf16", device.bf16), ("fp16", device.fp16), ("fp32", True)) if ok)
        if plan.gpu_memory_gb:
            source = f"plan.gpu_memory_gb={plan.gpu_memory_gb:g}"
        else:
            source = f"detected {device.name or device.kind}" + (" (this machine's RAM)" if kind == "cpu" else "")
    if plan.gpu_memory_gb:
        device_bytes = int(plan.gpu_memory_gb * GiB)
    elif kind == "cpu":
        device_bytes = cpu_bytes or ram
    else:
        from deepspeed.accelerator import get_accelerator

        device_bytes = int(get_accelerator().total_memory())
    if plan.precisions:
        unknown = [p for p in plan.precisions if p not in BYTES]
        if unknown:
            raise LauncherError(f"plan.precisions: {unknown[0]} is unknown: use bf16, fp16 or fp32")
        precisions = tuple(p for p in PRECISION_ORDER if p in plan.precisions)
    if not 0 <= plan.headroom < 1:
        raise LauncherError(f"plan.headroom={plan.headroom} must be a fraction in [0, 1)")
    return Target(kind, device_bytes, cpu_bytes, precisions, float(plan.headroom), source)


# ================================================================================ configurations
@dataclass(frozen=True)
class Row:
    preset: str
    dtype: str
    estimate: Estimate | None
    fits: bool
    why: str  # why it does not fit, or why it could not be estimated


def _variant_ds(
    cfg: DictConfig, preset: str, dtype: str, *, world_size: int, hidden: int, kind: str, explicit: frozenset[str]
) -> dict[str, Any]:
    """The DeepSpeed dict `train.py deepspeed=PRESET precision=DTYPE` would run (same other knobs)."""
    from launcher.ds_config import Device, build_ds_config
    from launcher.entry import load_deepspeed_json

    container = OmegaConf.to_container(cfg, resolve=True)
    stage, optimizer, param = PRESETS[preset]
    container["zero"]["stage"] = stage
    container["offload"].update({"optimizer": optimizer, "param": param})
    if "nvme" in (optimizer, param) and not container["offload"].get("nvme_path"):
        container["offload"]["nvme_path"] = "/local_nvme"  # only the estimate needs it: not checked here
    container["precision"]["dtype"] = dtype
    base = load_deepspeed_json(cfg.deepspeed_json) if cfg.deepspeed_json else None
    return build_ds_config(
        container,
        world_size=world_size,
        hidden_size=hidden,
        device=Device(kind=kind, bf16=True, fp16=kind != "cpu"),
        base=base,
        base_source=f"deepspeed_json={cfg.deepspeed_json}",
        explicit_groups=explicit | {"zero", "offload", "precision"},
    )


def plan_rows(
    cfg: DictConfig,
    stats: ModelStats,
    target: Target,
    *,
    presets: Sequence[str] = tuple(PRESETS),
    precisions: Sequence[str] | None = None,
    explicit: frozenset[str] = frozenset(),
) -> list[Row]:
    """One estimate per preset x precision, for the job's world size, batch and sequence."""
    world_size = int(cfg.dist.nproc_per_node) * int(cfg.dist.nnodes)
    seq_len, images = sequence(cfg, stats)
    rows = []
    for preset in presets:
        for dtype in precisions or target.precisions:
            try:
                ds = _variant_ds(
                    cfg,
                    preset,
                    dtype,
                    world_size=world_size,
                    hidden=stats.text.hidden,
                    kind=target.kind,
                    explicit=explicit,
                )
            except LauncherError as err:
                rows.append(Row(preset, dtype, None, False, one_line(err)))
                continue
            layout = layout_from_ds_config(ds, world_size=world_size, ranks_per_node=int(cfg.dist.nproc_per_node))
            est = estimate(stats, layout, seq_len=seq_len, images=images)
            ok, why = fits(est, target)
            rows.append(Row(preset, dtype, est, ok, why))
    return rows


def deepspeed_reference(stats: ModelStats, layout: Layout) -> tuple[int, int] | None:
    """(GPU, CPU) bytes from DeepSpeed's own estimators, where they apply: ZeRO 2/3, bf16/fp16.

    They assume every parameter trains, mixed precision, 2 P + 18 P / N on the GPU at stage 2
    (16-bit parameters, then 16-bit and fp32 gradients, fp32 master, Adam), and add 4 x largest
    layer at stage 3; the CPU figure includes loading the model (x 1.5 buffer factor).
    """
    if (
        layout.stage not in (2, 3)
        or layout.dtype == "fp32"
        or "nvme" in (layout.offload_optimizer, layout.offload_param)
    ):
        return None
    nodes = _ceil_div(layout.world_size, layout.ranks_per_node)
    if layout.stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            stats.total, layout.ranks_per_node, nodes, cpu_offload=layout.offload_optimizer == "cpu"
        )
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            stats.total,
            stats.largest_layer,
            layout.ranks_per_node,
            nodes,
            cpu_offload=layout.offload_optimizer == "cpu",
            cpu_offload_params=layout.offload_param == "cpu",
        )
    return gpu, cpu


# ================================================================================ preflight
def preflight(cfg: DictConfig, ds_config: dict[str, Any], world_size: int) -> str | None:
    """One line when the job's configuration is not expected to fit its device, else None.

    Estimates the given DeepSpeed dict only (and, when it does not fit, the presets at the same
    precision, to name the fastest one expected to fit). Problems training would also hit (an
    unreadable model.path) raise LauncherError.
    """
    stats = model_stats(cfg)
    target = target_device(cfg.plan)
    seq_len, images = sequence(cfg, stats)
    layout = layout_from_ds_config(ds_config, world_size=world_size, ranks_per_node=int(cfg.dist.nproc_per_node))
    est = estimate(stats, layout, seq_len=seq_len, images=images)
    ok, why = fits(est, target)
    if ok:
        return None
    rows = plan_rows(cfg, stats, target, precisions=(layout.dtype,))
    best = recommend(rows)
    if best is not None:
        advice = f"expected to fit: deepspeed={best.preset} precision={best.dtype}"
    else:
        advice = "no preset is expected to fit: lower train.micro_batch_size or plan.seq_len, or add ranks"
    return (
        f"memory plan: {layout.describe()} {why} (model states {est.states.on_device / GiB:.1f}, activations "
        f"{est.activations / GiB:.1f} at micro batch {layout.micro_batch} x {seq_len} tokens, buffers "
        f"{(est.step + est.buffers) / GiB:.1f}); usable: {target.usable_device / GiB:.1f} GiB of "
        f"{target.device_bytes / GiB:.1f} ({target.source}, plan.headroom={target.headroom:g}); {advice}; "
        "python -m launcher.plan with the same overrides prints every preset"
    )


# ================================================================================ the report
def _unit(rows: Sequence[Row]) -> tuple[str, int]:
    """GiB, or MiB for tables whose largest figure is under 1 GiB (tiny models)."""
    largest = max((row.estimate.device_total for row in rows if row.estimate), default=0)
    return ("GiB", GiB) if largest >= GiB else ("MiB", 2**20)


def _amount(value: int | None, unit: int) -> str:
    return "-" if value is None else f"{value / unit:.2f}"


def format_table(rows: Sequence[Row], stats: ModelStats, *, markdown: bool = False, reference: bool = True) -> str:
    """The estimates as an aligned text table (or Markdown), one row per preset x precision."""
    _, unit = _unit(rows)
    header = ["preset", "dtype", "model states", "activations", "step+buffers", "device total", "CPU/node", "fits"]
    if reference:
        header.append("DeepSpeed's estimate device/CPU")

    def amount(value: int | None) -> str:
        return _amount(value, unit)

    table = [header]
    for row in rows:
        est = row.estimate
        if est is None:
            table.append([row.preset, row.dtype, "-", "-", "-", "-", "-", f"not valid: {row.why}"] + ([""] * reference))
            continue
        line = [
            row.preset,
            row.dtype,
            amount(est.states.on_device),
            amount(est.activations),
            amount(est.step + est.buffers),
            amount(est.device_total),
            amount(est.cpu_per_node) + (f" (+{amount(est.nvme_per_node)} NVMe)" if est.nvme_per_node else ""),
            "yes" if row.fits else "no",
        ]
        if reference:
            ds_ref = deepspeed_reference(stats, est.layout)
            line.append("-" if ds_ref is None else f"{amount(ds_ref[0])} / {amount(ds_ref[1])}")
        table.append(line)
    if markdown:
        lines = ["| " + " | ".join(cells) + " |" for cells in table]
        lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table)


def report(cfg: DictConfig, overrides: Sequence[str] = ()) -> str:
    """The planner's whole output for a composed config: model, assumptions, table, recommendation."""
    from launcher.ds_config import explicit_groups_from_overrides

    stats = model_stats(cfg)
    target = target_device(cfg.plan)
    rows = plan_rows(cfg, stats, target, explicit=explicit_groups_from_overrides(list(overrides)))
    seq_len, images = sequence(cfg, stats)
    world_size = int(cfg.dist.nproc_per_node) * int(cfg.dist.nnodes)
    components = ", ".join(
        f"{name} {count / 1e6:,.1f}M{' (frozen)' if name in stats.frozen else ''}"
        for name, count in stats.components.items()
    )
    micro = next((row.estimate.layout.micro_batch for row in rows if row.estimate), None)
    if target.kind == "cpu":
        cpu = "the same memory (ranks and offloaded states share it)"
    elif target.cpu_bytes is None:
        cpu = "not checked (set plan.cpu_memory_gb)"
    else:
        cpu = f"{target.cpu_bytes / GiB:.1f} GiB"
    lines = [
        f"model {stats.name}: {stats.total / 1e6:,.1f}M parameters ({components}); "
        f"{stats.trainable / 1e6:,.1f}M trainable",
        f"job: {world_size} rank(s), {cfg.dist.nproc_per_node} per node; micro batch {micro}; "
        f"{seq_len} tokens per sample ({images} image(s) x {stats.image_tokens} image tokens)",
        f"device: {target.device_bytes / GiB:.1f} GiB ({target.source}); CPU per node: {cpu}; "
        f"fits = within {1 - target.headroom:.0%} (plan.headroom={target.headroom:g})",
        f"{_unit(rows)[0]} per device unless noted; model states = parameters, gradients, fp32 master weights, "
        "Adam states (the part on the device)",
        "",
        format_table(rows, stats, markdown=bool(cfg.plan.markdown)),
        "",
    ]
    best = recommend(rows)
    if best is None:
        lines.append(
            "recommendation: nothing is expected to fit; lower train.micro_batch_size or plan.seq_len, or add ranks"
        )
    else:
        lines.append(
            f"recommendation: deepspeed={best.preset} precision={best.dtype} (the fastest expected to fit: "
            f"{_amount(best.estimate.device_total, _unit(rows)[1])} {_unit(rows)[0]} per device)"
        )
    return "\n".join(lines)


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose(overrides: Sequence[str]) -> DictConfig:
    """The config `python train.py OVERRIDES` would run with."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from launcher.schema import register_configs

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="config", overrides=list(overrides))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def main(argv: Sequence[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    try:
        print(report(cfg, overrides))
    except LauncherError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
