"""Preference training (loss=dpo|ipo): the losses, the reference log-probs three ways, the metrics.

A batch holds B pairs as 2 x B rows (launcher.data.pairs): their chosen answers, then their rejected
ones. One forward pass gives each row's log-probability of its answer (the sum over its answer tokens,
launcher.model.logps: without the whole logits unless loss.chunk_tokens=0); the loss compares the
policy's with the reference model's:

    h = (log p(chosen) - log ref(chosen)) - (log p(rejected) - log ref(rejected))
    dpo: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)     (eps: loss.label_smoothing)
    ipo: (h - 1 / (2 beta))^2

At the start the policy is the reference: h = 0 and the DPO loss is log 2. The rewards people read are
beta (log p - log ref) of each answer; reward accuracy is the share of pairs whose chosen answer's reward
is the higher.

The reference (loss.reference):
  precomputed  one pass before training computes the reference's log-probs of every pair of the train
               and eval sets with the model as it starts (the policy is the reference then), every rank a
               share of the chunks; they are kept under cache_dir/reference/KEY (KEY: the model, method,
               precision and the data caches), a killed pass keeps its finished chunks. Training holds
               one model.
  adapter      under LoRA/QLoRA, the policy's own base with the adapter disabled (no second copy).
  live         a frozen copy of the model beside the policy, partitioned like it under ZeRO-3.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from launcher.config.schema import LossConfig
from launcher.core.children import helper_process
from launcher.core.errors import Interrupted, LauncherError, one_line
from launcher.core.json_files import read_json_or_none, write_json_atomic
from launcher.core.manifest import damage, fingerprint
from launcher.core.signals import pause_for_test
from launcher.data.pairs import PAIR_INDEX
from launcher.job.planning import cache_dir
from launcher.job.spec import Job
from launcher.train.distributed import Rank, all_reduce_sum, any_rank, barrier
from launcher.train.losses import Loss, Sums, row_logps

log = logging.getLogger("launcher")

REFERENCE_VERSION = 2  # 2: the log-probs' path (loss.chunk_tokens) is part of the key
CHUNK_PAIRS = 1024  # pairs per file of a precomputed reference: what a killed pass loses at most, per rank
META_FILE = "meta.json"


# ----------------------------------------------------------------------------- the losses
def pair_losses(
    loss: LossConfig, policy: torch.Tensor, reference: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each pair's loss, chosen rewards, rejected rewards) from [2, B] log-probs (row 0 chosen, 1 rejected)."""
    beta = float(loss.beta)
    ratios = policy - reference  # log p - log ref of each answer
    margin = ratios[0] - ratios[1]
    if str(loss.name) == "ipo":
        losses = (margin - 1.0 / (2.0 * beta)) ** 2
    else:
        smoothing = float(loss.label_smoothing)
        losses = -torch.nn.functional.logsigmoid(beta * margin) * (1.0 - smoothing)
        losses = losses - torch.nn.functional.logsigmoid(-beta * margin) * smoothing
    rewards = beta * ratios.detach()
    return losses, rewards[0], rewards[1]


@dataclass
class PairSums(Sums):
    """What a step's (or an evaluation's) pairs add up to; summed over micro-batches and ranks."""

    loss: float = 0.0
    chosen: float = 0.0  # rewards
    rejected: float = 0.0
    correct: float = 0.0  # pairs whose chosen reward is the higher
    pairs: float = 0.0

    def add(self, losses: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        self.loss += float(losses.detach().sum())
        self.chosen += float(chosen.sum())
        self.rejected += float(rejected.sum())
        self.correct += float((chosen > rejected).sum())
        self.pairs += len(losses)

    def metrics(self, prefix: str) -> dict[str, float]:
        """{prefix/loss, prefix/rewards_chosen, .../rewards_rejected, .../rewards_margin, .../rewards_accuracy}."""
        pairs = max(self.pairs, 1.0)
        return {
            f"{prefix}/loss": self.loss / pairs,
            f"{prefix}/rewards_chosen": self.chosen / pairs,
            f"{prefix}/rewards_rejected": self.rejected / pairs,
            f"{prefix}/rewards_margin": (self.chosen - self.rejected) / pairs,
            f"{prefix}/rewards_accuracy": self.correct / pairs,
        }


# ----------------------------------------------------------------------------- one batch
@dataclass
class PreferenceLoss(Loss):
    """loss=dpo|ipo (launcher.train.losses' interface): a micro-batch's loss is the mean over its pairs."""

    loss: LossConfig
    reference: Reference
    chunk: int = 0  # loss.chunk_tokens

    @property
    def name(self) -> str:
        return str(self.loss.name)

    def units(self, batch: dict[str, Any]) -> int:
        return pair_count(batch)

    def new_sums(self) -> PairSums:
        return PairSums()

    def forward(
        self, model: Any, batch: dict[str, Any], split: str, to_device: Callable[[dict], dict], sums: PairSums
    ) -> torch.Tensor:
        """The policy's pass over a batch of pairs, against the reference's log-probs."""
        inputs, labels, pairs = model_inputs(batch)
        inputs = to_device(inputs)
        labels = labels.to(inputs["input_ids"].device)
        policy = row_logps(model, inputs, labels, self.chunk).view(2, -1)
        with torch.no_grad():
            reference = self.reference.logps(model, inputs, labels, pairs, split)
        losses, chosen, rejected = pair_losses(self.loss, policy, reference.to(policy.device))
        sums.add(losses, chosen, rejected)
        return losses.mean()


def pair_count(batch: dict[str, Any]) -> int:
    """The preference pairs of a batch (launcher.data.pairs): half its rows."""
    return int(batch["input_ids"].shape[0]) // 2


def model_inputs(batch: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """A pair batch -> (what the model takes, the labels, the pairs' positions)."""
    inputs = {key: value for key, value in batch.items() if key not in ("labels", PAIR_INDEX)}
    return inputs, batch["labels"], batch[PAIR_INDEX]


class Reference:
    """The reference's log-probs of a batch's answers: [2, B] (chosen, rejected), fp32."""

    name = "reference"
    chunk = 0  # loss.chunk_tokens, as the policy's are computed

    def logps(self, ds: Any, inputs: dict, labels: torch.Tensor, pairs: torch.Tensor, split: str) -> torch.Tensor:
        raise NotImplementedError


class PrecomputedReference(Reference):
    """Log-probs computed before training (`precomputed_reference`), looked up by each pair's position."""

    name = "precomputed"

    def __init__(self, path: Path, tables: dict[str, np.ndarray], seconds: float | None = None):
        self.path, self.tables = path, tables
        self.seconds = seconds  # how long this start took to compute it (None: it was read)

    def logps(self, ds: Any, inputs: dict, labels: torch.Tensor, pairs: torch.Tensor, split: str) -> torch.Tensor:
        return torch.from_numpy(self.tables[split][pairs.numpy()].T.astype(np.float32))


class AdapterReference(Reference):
    """The policy's base: the same model with its LoRA adapter (and the modules it trains in full) disabled."""

    name = "adapter"

    def logps(self, ds: Any, inputs: dict, labels: torch.Tensor, pairs: torch.Tensor, split: str) -> torch.Tensor:
        with ds.module.disable_adapter():
            return row_logps(ds, inputs, labels, self.chunk).view(2, -1)


class LiveReference(Reference):
    """A frozen copy of the starting model in a DeepSpeed engine of its own (no optimizer)."""

    name = "live"

    def __init__(self, engine: Any):
        self.engine = engine
        # Elements this rank holds: a ZeRO-3 partition (ds_tensor), else every weight.
        self.params_held = sum(getattr(p, "ds_tensor", p).numel() for p in engine.module.parameters())

    def logps(self, ds: Any, inputs: dict, labels: torch.Tensor, pairs: torch.Tensor, split: str) -> torch.Tensor:
        return row_logps(self.engine, inputs, labels, self.chunk).view(2, -1)


# ----------------------------------------------------------------------------- the reference of a job
def build_reference(
    job: Job,
    rank: Rank,
    ds: Any,
    dtype: torch.dtype,
    ds_config: dict[str, Any],
    sets: dict[str, PairSet],
    to_device: Callable[[dict], dict],
    *,
    may_compute: bool,
    stop: Callable[[], bool],
) -> Reference:
    """The reference loss.reference names (the job's checks refused the choices its method cannot give)."""
    choice = str(job.config.loss.reference)
    if choice == "adapter":
        reference: Reference = AdapterReference()
    elif choice == "live":
        reference = build_live_reference(job, rank, ds_config)
    else:
        reference = precomputed_reference(job, rank, ds, dtype, sets, to_device, may_compute=may_compute, stop=stop)
    reference.chunk = int(job.config.loss.chunk_tokens)  # computed as the policy's log-probs are
    return reference


# ----------------------------------------------------------------------------- a live copy
def build_live_reference(job: Job, rank: Rank, ds_config: dict[str, Any]) -> LiveReference:
    """The frozen copy: the job's model loaded again, every weight frozen, in an engine without an
    optimizer; ZeRO-3 partitions it as it partitions the policy (and offloads it where the policy's
    weights are offloaded: to the CPU), other stages hold it whole."""
    import deepspeed

    from launcher.core.logs import quiet_transformers
    from launcher.model.loading import load_model_and_processor, made_where_it_trains, resolve_attn_implementation

    config = {
        key: ds_config[key]
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "bf16", "fp16")
        if key in ds_config
    }
    zero = ds_config["zero_optimization"]
    stage = int(zero["stage"])
    config["zero_optimization"] = {"stage": 0}
    if stage == 3:  # the policy's partitioning (and parameter offload: to the CPU, NVMe swap files being its own)
        config["zero_optimization"] = {key: value for key, value in zero.items() if key != "offload_optimizer"}
        if zero.get("offload_param", {}).get("device") == "nvme":
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    hf_ds_config = None
    if stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(config)  # noqa: F841 (transformers reads it while loading)
    model_cfg = job.config.model
    attention = resolve_attn_implementation(
        str(model_cfg.attn_implementation), device_kind=rank.device.type, precision=job.precision
    )
    quiet_transformers()
    model, _ = load_model_and_processor(
        str(job.model_path), attn_implementation=attention, min_pixels=model_cfg.min_pixels,
        max_pixels=model_cfg.max_pixels, **made_where_it_trains(str(job.model_path), rank.device, zero3=stage == 3),
    )  # fmt: skip
    model.config.use_cache = False
    model.requires_grad_(False)
    model.eval()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return LiveReference(engine)


# ----------------------------------------------------------------------------- the precomputed pass
def reference_key(job: Job, datasets: dict[str, str | None], dtype: torch.dtype) -> str:
    """What a precomputed reference depends on: the model (its files' names, sizes and times), the method
    (a 4-bit base differs), the precision of the pass, and each split's data cache (its records' tokens)."""
    parts = {
        "version": REFERENCE_VERSION,
        "model": str(job.model_path),
        "files": model_files(str(job.model_path)),
        "method": "qlora" if str(job.config.method.name) == "qlora" else "base",
        "dtype": str(dtype),
        # Chunks through the output layer, or the whole logits (0): equal to ~1e-6, not bitwise.
        "chunk_tokens": int(job.config.loss.chunk_tokens),
        "data": datasets,
    }
    if str(job.config.model.kernels) == "liger":  # liger's fused loss: equal to ~1e-6 too (keys of before kept)
        parts["kernels"] = "liger"
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def model_files(path: str) -> list[list[Any]]:
    """[name, size, mtime] of the model directory's files (a hub id: nothing to stat)."""
    folder = Path(path)
    if not folder.is_dir():
        return []
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in folder.iterdir() if p.is_file())


@dataclass
class PairSet:
    """One split's pairs as the pass reads them: the dataset, its collator, its data cache's name."""

    dataset: Any
    collate: Callable[[list[Any]], dict[str, Any]]
    cache: str | None


def _span(pairs: int, number: int) -> range:
    """The pairs of chunk `number` of a set of `pairs`."""
    return range(number * CHUNK_PAIRS, min(pairs, (number + 1) * CHUNK_PAIRS))


def _chunks(sizes: dict[str, int]) -> list[tuple[str, int]]:
    """(split, number) of every chunk of a reference of `sizes` pairs per split."""
    return [(split, n) for split, pairs in sizes.items() for n in range(-(-pairs // CHUNK_PAIRS))]


def precomputed_reference(
    job: Job,
    rank: Rank,
    ds: Any,
    dtype: torch.dtype,
    sets: dict[str, PairSet],
    to_device: Callable[[dict], dict],
    *,
    may_compute: bool,
    stop: Callable[[], bool] = lambda: False,
) -> PrecomputedReference:
    """The reference log-probs of every pair of `sets` (train, eval): read from loss.reference_path or
    cache_dir/reference/KEY, or computed there first with `ds`, the policy as it starts (`may_compute`:
    no step trained yet). Every rank computes a share of the missing chunks, in lock-step (ZeRO-3's
    gathers need every rank's forward), and keeps all of them: ranks need not share a disk."""
    loss = job.config.loss
    datasets = {split: pair_set.cache for split, pair_set in sets.items()}
    key = reference_key(job, datasets, dtype)
    given = loss.reference_path
    path = Path(str(given)).expanduser() if given else cache_dir(job.config) / "reference" / key
    meta = read_json_or_none(path / META_FILE)
    sizes = {split: len(pair_set.dataset) for split, pair_set in sets.items()}
    if meta is not None and meta.get("key") != key:
        raise LauncherError(
            f"loss.reference_path={given}: its log-probs were computed for another model or data "
            f"({meta.get('model')}, data {meta.get('data')}; this job: {job.model_path}, data {datasets}): "
            "point it at this job's reference, or leave it unset to compute one"
        )
    if meta is not None or (path / META_FILE).exists():  # a meta.json that does not parse is damage too
        meta = _checked(path, meta, sizes, given=given, may_compute=may_compute)
    if given and meta is None:
        raise LauncherError(
            f"loss.reference_path={given}: no precomputed reference there ({path / META_FILE} is missing); "
            "leave loss.reference_path unset to compute one"
        )
    seconds = None
    if any_rank(meta is None, device=rank.device):  # every rank takes part when one lacks it (its own disk)
        if not may_compute:
            raise LauncherError(
                f"the precomputed reference {path} is missing, and this run has trained steps since the start "
                "(the reference is the model as it started): restore it, or start a new run"
            )
        started = time.perf_counter()
        _compute(job, rank, ds, sets, to_device, path, key, datasets, stop)
        seconds = round(time.perf_counter() - started, 3)
    tables = {split: _read_table(path, split, sizes[split]) for split in sets}
    return PrecomputedReference(path, tables, seconds)


def _compute(
    job: Job,
    rank: Rank,
    ds: Any,
    sets: dict[str, PairSet],
    to_device: Callable[[dict], dict],
    path: Path,
    key: str,
    datasets: dict[str, str | None],
    stop: Callable[[], bool],
) -> None:
    started = time.perf_counter()
    path.mkdir(parents=True, exist_ok=True)
    sizes = {split: len(pair_set.dataset) for split, pair_set in sets.items()}
    chunks = _chunks(sizes)
    # The chunks some rank lacks (a stopped pass keeps those it finished; a rank on another node may have a disk
    # of its own): the same list on every rank.
    whole = [_chunk_whole(path, split, n, len(_span(len(sets[split].dataset), n))) for split, n in chunks]
    lacking = all_reduce_sum([float(not present) for present in whole], rank.device)
    todo = [chunk for chunk, count in zip(chunks, lacking, strict=True) if count]
    if rank.is_main:
        total = sum(len(pair_set.dataset) for pair_set in sets.values())
        needed = sum(len(_span(len(sets[split].dataset), number)) for split, number in todo)
        kept = f" ({total - needed} kept from an earlier start)" if needed < total else ""
        log.info("reference: computing the log-probs of %d pairs once%s, into %s", needed, kept, path)
    micro = job.micro_batch
    rounds = -(-len(todo) // rank.world_size)

    def stopping() -> None:
        """Before each forward pass (every rank runs as many, so the ranks agree in one collective): a chunk
        takes minutes on a large model, and a stop must not wait for it (the chunk under way is dropped)."""
        if any_rank(stop(), device=rank.device):
            raise Interrupted(
                f"stopped by a signal while computing the reference log-probs {path}: the chunks written are "
                "kept, and the next start computes only the rest"
            )

    computed: dict[tuple[str, int], np.ndarray] = {}
    was_training = ds.training
    ds.eval()
    try:
        for number in range(rounds):
            mine = number * rank.world_size + rank.rank
            chunk = todo[mine] if mine < len(todo) else None
            # Every rank runs as many forward passes as the round's longest chunk needs.
            round_chunks = todo[number * rank.world_size :][: rank.world_size]
            passes = max(-(-len(_span(len(sets[s].dataset), n)) // micro) for s, n in round_chunks)
            table = _compute_chunk(job, rank, ds, sets, to_device, chunk, passes, stopping)
            if chunk is not None:
                _write_chunk(_chunk_file(path, *chunk), table)
                computed[chunk] = table
    finally:
        ds.train(was_training)
    # Every rank keeps every chunk (one gather: two numbers per pair): written where its disk lacks it.
    for part in _gathered(computed):
        for chunk, table in part.items():
            if not _chunk_file(path, *chunk).exists():
                _write_chunk(_chunk_file(path, *chunk), table)
    barrier()  # every chunk is written: the first rank of each disk marks it complete
    meta = {
        "version": REFERENCE_VERSION, "key": key, "model": str(job.model_path), "data": datasets, "pairs": sizes,
        "seconds": round(time.perf_counter() - started, 3),
        # Each chunk's size and checksum: a reader trains on no chunk whose bytes changed since.
        "chunks": {_chunk_file(path, *chunk).name: fingerprint(_chunk_file(path, *chunk)) for chunk in chunks},
    }  # fmt: skip
    if not (path / META_FILE).exists():
        write_json_atomic(path / META_FILE, meta)  # last: its presence marks the reference complete
    if rank.is_main:
        log.info("reference: %d pairs in %.1f s", sum(sizes.values()), meta["seconds"])
    barrier()


def _gathered(computed: dict[tuple[str, int], np.ndarray]) -> list[dict[tuple[str, int], np.ndarray]]:
    """Every rank's `computed` (one collective; none on one rank)."""
    if torch.distributed.get_world_size() == 1:
        return [computed]
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, computed)
    return parts


def _write_chunk(file: Path, table: np.ndarray) -> None:
    partial = file.with_name(f".{file.name}.{os.getpid()}")
    with open(partial, "wb") as handle:
        np.save(handle, table)
    os.replace(partial, file)


@torch.no_grad()
def _compute_chunk(
    job: Job,
    rank: Rank,
    ds: Any,
    sets: dict[str, PairSet],
    to_device: Callable[[dict], dict],
    chunk: tuple[str, int] | None,
    passes: int,
    stopping: Callable[[], None],
) -> np.ndarray:
    """One chunk's [pairs, 2] log-probs (`chunk` None: this rank has none this round; an empty table), in
    `passes` forward passes: a rank with fewer batches repeats its last one, its result dropped. `stopping()`
    runs before each pass and raises when the ranks agree to stop."""
    split, number = chunk if chunk is not None else next((s, 0) for s in sets)
    pair_set = sets[split]
    span = _span(len(pair_set.dataset), number)
    workers = int(job.config.data.num_workers)
    loader = DataLoader(
        Subset(pair_set.dataset, list(span) if chunk is not None else [0]), batch_size=job.micro_batch,
        collate_fn=pair_set.collate, num_workers=workers, generator=torch.Generator(),
        worker_init_fn=helper_process, prefetch_factor=4 if workers else None,
    )  # fmt: skip
    found: list[np.ndarray] = []
    batch = None
    iterator = iter(loader)
    try:
        for _ in range(passes):
            stopping()
            batch = next(iterator, None) or batch
            inputs, labels, _ = model_inputs(batch)
            inputs = to_device(inputs)
            labels = labels.to(inputs["input_ids"].device)
            logps = row_logps(ds, inputs, labels, int(job.config.loss.chunk_tokens)).view(2, -1)
            if chunk is not None and sum(len(f) for f in found) < len(span):
                found.append(logps.T.double().cpu().numpy())
            pause_for_test("reference")  # the tests' stop signals land here, mid-chunk (a no-op otherwise)
    finally:
        # A stop raised mid-chunk: the loader's workers end now. The traceback keeps this frame, and with it
        # the iterator, whose workers held the process at its exit.
        del iterator
    return np.concatenate(found)[: len(span)] if found else np.zeros((0, 2))


def _chunk_file(path: Path, split: str, number: int) -> Path:
    return path / f"{split}-{number:05d}.npy"


def _chunk_whole(path: Path, split: str, number: int, pairs: int) -> bool:
    """Whether a chunk an earlier pass wrote reads back as its [pairs, 2] table; a damaged one is removed (and
    computed again). A chunk is written whole (renamed into place): damage is a later change to its bytes."""
    file = _chunk_file(path, split, number)
    if not file.exists():
        return False
    try:
        if np.load(file, mmap_mode="r").shape == (pairs, 2):
            return True
        why = "it holds another number of pairs"
    except (OSError, ValueError, EOFError) as err:
        why = f"it does not read back ({one_line(err)})"
    log.warning("reference: %s is damaged (%s): computing it again", file, why)
    file.unlink(missing_ok=True)
    return False


def _checked(path: Path, meta: dict | None, sizes: dict[str, int], *, given: Any, may_compute: bool) -> dict | None:
    """`meta` if every chunk it lists is as it recorded; None when the reference was damaged and may be computed
    again (the damaged files and meta.json removed, one line said); else one error naming the file and the fix."""
    names = [_chunk_file(path, *chunk).name for chunk in _chunks(sizes)]
    recorded = (meta or {}).get("chunks") or {}
    if meta is None:
        found = [(path / META_FILE, "it does not parse as JSON")]
    else:
        found = [(path / name, why) for name in names if (why := damage(path / name, recorded.get(name)))]
    if not found:
        return meta
    file, why = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    if given:
        raise LauncherError(
            f"loss.reference_path={given}: {file} is damaged ({why}){more}: restore the reference, or leave "
            "loss.reference_path unset to compute one"
        )
    if not may_compute:
        raise LauncherError(
            f"the precomputed reference {path} is damaged ({file.name}: {why}){more}, and this run has trained "
            f"steps since the start (the reference is the model as it started): restore it, or start a new run"
        )
    log.warning("reference: %s is damaged (%s)%s: computing it again", file, why, more)
    for damaged, _ in found:
        damaged.unlink(missing_ok=True)
    (path / META_FILE).unlink(missing_ok=True)
    return None


def _read_table(path: Path, split: str, pairs: int) -> np.ndarray:
    """One split's [pairs, 2] log-probs (chosen, rejected), from its chunk files."""
    chunks = -(-pairs // CHUNK_PAIRS)
    try:
        tables = [np.load(_chunk_file(path, split, n)) for n in range(chunks)]
    except (OSError, ValueError, EOFError) as err:  # a reference of an older version, without checksums
        raise LauncherError(
            f"{path}: a chunk of the precomputed reference does not read back ({one_line(err)}): delete the folder "
            "to have it computed again"
        ) from err
    table = np.concatenate(tables) if tables else np.zeros((0, 2))
    if len(table) != pairs:
        raise LauncherError(
            f"{path}: the precomputed reference holds {len(table)} {split} pairs, the data {pairs}: delete it to "
            "have it computed again"
        )
    return table
