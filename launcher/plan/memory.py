"""Memory estimates, pure arithmetic: parameter counts and a DeepSpeed layout in, bytes out.

No torch, no I/O. Every formula is stated in the docstring of the function that applies it; the
planner (`launcher.plan`) feeds it the counts `launcher.model_stats` takes from a model built on the
meta device, and tests/unit/plan/test_memory.py checks the model-state figures against real DeepSpeed engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from launcher.config.precision import fastest_precisions, precision_of
from launcher.config.schema import PREFERENCE_LOSSES
from launcher.core.errors import LauncherError
from launcher.model.stats import ModelStats

GiB = 2**30
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# The presets in conf/deepspeed, fastest first: (zero stage, offload.optimizer, offload.param).
# tests/unit/plan/test_memory.py checks this table against the composed presets.
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
    dtype = precision_of(ds)
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
        params, grads, on_cpu, on_nvme = _optimizer_offload(layout, e, part, trainable, params, master + optimizer)
    if stage == 3 and layout.offload_param != "none":
        if layout.offload_param == "nvme":
            on_nvme += partitions
        else:
            on_cpu += partitions
    return ModelStates(params, grads, master, optimizer, on_cpu, on_nvme)


def _optimizer_offload(
    layout: Layout, e: int, part: int, trainable: int, params: int, states: int
) -> tuple[int, int, int, int]:
    """(parameters, gradients on the device, bytes on the CPU, bytes on NVMe) of `model_state_bytes` when
    the optimizer is offloaded; `states` are the master weights and Adam states it moves."""
    stage = layout.stage
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
    offloaded = states + cpu_grads + (0 if stage == 3 else e * part)
    if layout.offload_optimizer == "nvme":
        return params, grads, offloaded - (states + 4 * part), states + 4 * part
    return params, grads, offloaded, 0


def activation_bytes(stats: ModelStats, layout: Layout, *, seq_len: int, images: int, rows: int = 1) -> int:
    """Activations kept for the backward pass, per rank, for one micro batch.

    b = micro batch, s = language-model tokens per sample (text + image tokens), e = bytes per
    element, per layer and token (elements), measured on transformers 5.24 layers with PyTorch's
    scaled-dot-product attention (which keeps no s x s score matrix):
      language layer (Llama/Qwen2: RMSNorm, rotary attention, gated MLP):
          A = 10 h + 2 kv + 4 i   in bf16/fp16 (8 h + ... in fp32: RMSNorm's fp32 upcast is then free)
      vision layer (CLIP / Qwen2-VL ViT: LayerNorm, attention, plain MLP): A_v = 12 h + 2 i (4 i if gated)
      projector: about 2 (h_vision m^2 + h) per image token (m: patch merge, 1 for LLaVA)
      logits: s V (2 e + 8) bytes: the logits, their fp32 copy for the loss, and the gradients of both
    activations = rows b [e s (L A + 3 h) + e n_img v L_v A_v + projector + logits]
    rows: 2 for a preference loss (each sample is a chosen and a rejected row), else 1.
    With the chunked loss (loss.chunk_tokens = c > 0, launcher.model.logps) no logits are kept: one chunk's
    (c V (2 e + 8) bytes, c at most the micro batch's tokens) exists at a time, for the whole micro batch;
    with liger's fused loss (model.kernels=liger) `fused_loss_bytes`.
    With gradient checkpointing (non-reentrant) a checkpointed stack keeps only each layer's input
    hidden state, and one layer's activations are recomputed at a time during backward: L A becomes
    L h + A for the language model (model.gradient_checkpointing), L_v A_v becomes L_v h_v + A_v for
    the vision tower (model.vision_gradient_checkpointing).
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
    layers = _kept_per_token(text.layers, per_layer, text.hidden, "language" in stats.checkpointed)
    elements = seq_len * (layers + final_norm)
    if trains["vision"]:
        vision = stats.vision
        vision_layer = 12 * vision.hidden + (4 if vision.gated else 2) * vision.intermediate
        kept = _kept_per_token(vision.layers, vision_layer, vision.hidden, "vision" in stats.checkpointed)
        elements += images * stats.vision_tokens * kept
    if trains["vision"] or trains["projector"]:
        elements += images * stats.image_tokens * stats.projector_width
    logit_bytes = stats.vocab_size * (2 * e + 8)
    batch = rows * layout.micro_batch
    if stats.loss_chunk and stats.kernels == "liger":
        return batch * e * elements + fused_loss_bytes(stats, batch * seq_len, e)
    if stats.loss_chunk:
        return batch * e * elements + min(stats.loss_chunk, batch * seq_len) * logit_bytes
    return batch * (e * elements + seq_len * logit_bytes)


def fused_loss_bytes(stats: ModelStats, tokens: int, e: int) -> int:
    """liger's fused linear cross-entropy at its peak over `tokens` positions (model.kernels=liger), as
    liger-kernel 0.8.5 allocates (at ZeRO-3 too: the whole output layer is gathered for it): one chunk's logits
    (its chunk: the tokens over ceil(V / h), rounded up to a power of two, so that a chunk's logits are about
    as large as the hidden states), the input's gradient (tokens x h, kept for the backward pass), and the
    output layer's gradient summed in fp32 and cast to the weight's dtype (V x h x (4 + e); the cast copy is
    kept for the backward pass)."""
    vocab, hidden = stats.vocab_size, stats.text.hidden
    spread = -(-vocab // hidden)
    chunk = min(tokens, 1 << max(0, (-(-tokens // spread) - 1).bit_length()))
    return chunk * vocab * e + tokens * hidden * e + vocab * hidden * (4 + e)


def _kept_per_token(layers: int, per_layer: int, hidden: int, checkpointed: bool) -> int:
    """Elements a stack of layers keeps per token: every layer's activations, or (checkpointed) each
    layer's input plus the one layer recomputed during backward."""
    if not checkpointed or layers == 0:
        return layers * per_layer
    return layers * hidden + per_layer


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
    reference: int = 0  # a preference loss's live reference copy (loss.reference=live), on the device

    @property
    def device_total(self) -> int:
        return self.states.on_device + self.reference + self.step + self.buffers + self.activations


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


def estimate(
    stats: ModelStats,
    layout: Layout,
    *,
    seq_len: int,
    images: int = 1,
    pairs: bool = False,
    live_reference: bool = False,
) -> Estimate:
    """Everything one configuration needs: see model_state_bytes, step_and_buffer_bytes, activation_bytes.

    A preference loss (`pairs`, loss=dpo|ipo) runs each sample as two rows, its chosen and its rejected
    answer: twice the activations. Its reference costs nothing on the device when precomputed (a table of
    two numbers per pair) or the policy's own base (loss.reference=adapter); a live copy
    (`live_reference`) holds every weight in the training precision, e P (stages 0-2) or its ZeRO-3
    partition e P / N (plus the weights below the persistence threshold, which every rank keeps whole),
    in CPU memory where the policy's weights are offloaded; no gradients, no optimizer, and activations
    only transiently (it runs without grad).

    CPU per node = max(loading, offloaded): before DeepSpeed takes the model, each rank on the node
    loads the checkpoint into CPU memory (load_bytes x P per rank; at stage 3 transformers partitions
    while loading, so one layer at a time); offloaded states (and NVMe swap buffers) come after.
    """
    persistent = stats.persistent(layout.persistence_threshold) if layout.stage == 3 else 0
    states = model_state_bytes(stats.total, stats.trainable, layout, persistent=persistent)
    step, buffers = step_and_buffer_bytes(stats, layout)
    activations = activation_bytes(stats, layout, seq_len=seq_len, images=images, rows=2 if pairs else 1)
    reference = reference_on_cpu = 0
    if live_reference:
        held = _ceil_div(stats.total, layout.world_size) + persistent if layout.stage == 3 else stats.total
        reference = BYTES[layout.dtype] * held
        if layout.offload_param != "none":  # offloaded with the policy's weights (NVMe: to the CPU)
            reference, reference_on_cpu = 0, reference
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
    cpu = max(loading, ranks * (states.on_cpu + swap + reference_on_cpu))
    return Estimate(
        layout=layout,
        states=states,
        step=step,
        buffers=buffers,
        activations=activations,
        cpu_per_node=cpu,
        nvme_per_node=ranks * states.on_nvme,
        seq_len=seq_len,
        reference=reference,
    )


def planned_bytes(est: Estimate, kind: str) -> int:
    """The bytes per rank a run is planned to need at its peak, the figure its measured peak (summary.json's
    peak_memory_bytes) is compared with: the device's total; on a CPU the device is the host, so what is
    kept in CPU memory (offloaded states, or loading the checkpoint) counts too, the rank's share."""
    total = est.device_total
    if kind == "cpu":
        total += est.cpu_per_node // est.layout.ranks_per_node
    return total


def preference_terms(loss: Any) -> dict[str, bool]:
    """estimate()'s arguments for a job's loss config: pairs (loss=dpo|ipo) and a live reference copy."""
    pairs = str(loss.name) in PREFERENCE_LOSSES
    return {"pairs": pairs, "live_reference": pairs and str(loss.reference) == "live"}


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


@dataclass(frozen=True)
class Row:
    preset: str
    dtype: str
    estimate: Estimate | None
    fits: bool
    why: str  # why it does not fit, or why it could not be estimated


def recommend(rows: Sequence[Row], kind: str = "cuda") -> Row | None:
    """The fastest row expected to fit on a device of this kind: presets in PRESETS order, then the
    precisions fastest first there (bf16, fp16, fp32 on a GPU; fp32 first on a CPU)."""
    order = list(PRESETS)
    dtypes = fastest_precisions(kind)

    def speed(row: Row) -> tuple[int, int]:
        return order.index(row.preset), dtypes.index(row.dtype)

    fitting = [row for row in rows if row.fits and row.preset in PRESETS]
    return min(fitting, key=speed) if fitting else None
