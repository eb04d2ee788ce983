"""One rank's data: its records, its loaders (training, held-out loss, exact match) and its place in them.

Each split's records reach their loader through launcher.data.splits, whichever kind of source they are:
decoded per batch, read from the data cache (data.cache: every rank builds its share of it first), or
streamed from shard files as training goes (data.streaming: nothing indexed or cached first). Here they
are sampled, packed or paired, sharded by rank and made resumable. At ZeRO-3 with several ranks every batch
runs the vision tower (a dummy image where a batch has none): otherwise ranks whose batches differ in
modality hang. Records over data.max_length are cut or skipped alike whatever the kind; rank 0 lists those
skipped in RUN/skipped_records.jsonl, and with a stream each rank lists the rows it skips as it meets them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from launcher.core.children import helper_process
from launcher.core.errors import LauncherError
from launcher.core.logs import FILE_ONLY
from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.data.cache import CacheInfo, Part, ensure_job_cache
from launcher.data.formats import SkipTally
from launcher.data.index import Records
from launcher.data.packing import PackedCollator, PackedRows
from launcher.data.pairs import PairCollator, PairedRows
from launcher.data.records import ConversationDataset, LoadedData, Source, read_data, require_one_global_batch
from launcher.data.sampling import LengthGroupedSampler, MixtureSampler, PackedSampler
from launcher.data.shapes import prepare_data
from launcher.data.splits import ModalityGuard, Split, cached_split, decoded_split, streamed_batches_of
from launcher.data.video import VideoSampling
from launcher.job.planning import cache_dir
from launcher.job.spec import Job
from launcher.model.stats import pack_length
from launcher.train.checkpoint import DataPosition, ResumableSampler, batches
from launcher.train.distributed import Rank, any_rank, barrier, main_process_first
from launcher.train.preference import PairSet

log = logging.getLogger("launcher")


@dataclass
class Data:
    """The data streams of one rank."""

    batches: Iterator[dict[str, Any]]  # training micro-batches, forever, from `position` on
    position: DataPosition  # what `batches` has handed out (saved in checkpoints)
    sampler: Any
    micro: int
    world_size: int
    eval_loader: Any | None = None
    accuracy_set: Any | None = None  # this rank's share of the exact-match samples
    source_names: list[str] = field(default_factory=list)  # of a mixture (data.sources); empty otherwise
    restart: Callable[[], Iterator[dict[str, Any]]] | None = None  # `batches` anew, from `position` on
    loaders: list[Any] = field(default_factory=list)  # the DataLoaders whose persistent workers this rank owns
    # Preference pairs (data.pairs): each split's pairs and collator, which a precomputed reference reads.
    pair_sets: dict[str, PairSet] = field(default_factory=dict)
    video_guard: bool = False  # ZeRO-3's modality guard gives batches a blank video (ModalityGuard)

    def start_eval_workers(self) -> None:
        """Fork the evaluation loader's persistent workers now (the loop's start, beside the training
        loader's first fork), not at the first evaluation: forked right after a step of a 2-rank ZeRO-3 run,
        a worker hung inside CPython 3.11's fork (a runtime lock another thread held at the fork,
        python/cpython#112275, fixed in 3.12). Its first batches are loaded again at the evaluation."""
        loader = self.eval_loader
        if loader is not None and loader.num_workers > 0 and loader.persistent_workers:
            iter(loader)

    def shut_down_workers(self) -> None:
        """End the loaders' worker processes, however the rank ends. They ignore SIGTERM (a group's stop
        signal must not end them before their rank has saved), and the interpreter's exit terminates and
        joins every worker still alive: one kept by a reference cycle (an exception's traceback) would
        hold the rank's exit forever."""
        for loader in self.loaders:
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()  # DataLoader's own shutdown: each worker told, joined, else killed
            loader._iterator = None

    def start_over(self) -> None:
        """Training batches from the start of the data again (the next stage of train.stages: as a job of its
        own would); the loader's workers of the batches so far are shut down."""
        if self.restart is None:
            raise LauncherError("this data cannot start over (a stream): train.stages needs data.streaming=false")
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()  # the generator's loader iterator goes with it, and its worker processes
        self.position.epoch = self.position.batches = self.position.records = 0
        self.batches = self.restart()

    def global_draws(self, batches: int | None = None) -> int:
        """Training samples all ranks drew after `batches` micro-batches each (default: so far)."""
        return (self.position.batches if batches is None else batches) * self.micro * self.world_size

    def source_counts(self, global_draws: int | None = None) -> dict[str, int]:
        """Training samples drawn from each source of a mixture so far (all ranks)."""
        if not self.source_names:
            return {}
        drawn = self.global_draws() if global_draws is None else global_draws
        return dict(zip(self.source_names, self.sampler.source_counts(drawn), strict=True))

    def mixture_position(self, global_draws: int | None = None) -> dict[str, dict[str, int]]:
        """What a checkpoint records of a mixture: samples drawn from, and records in, each source."""
        sizes = dict(zip(self.source_names, (int(n) for n in self.sampler.sizes), strict=True))
        return {"drawn": self.source_counts(global_draws), "records": sizes}


def build_data(
    job: Job,
    rank: Rank,
    loaded: LoadedData,
    processor: Any,
    zero_stage: int,
    run_dir: RunDir,
    summary: Summary,
    stop: Callable[[], bool] = lambda: False,
) -> Data:
    """This rank's loaders over the records read (`read_records`), sharded by rank, resumable; the counts of
    what was skipped go into `summary`. `stop()` says whether this rank was asked to stop: a data cache being
    built stops between its shards (launcher.data.cache.Part)."""
    data = job.config.data
    images = data.modality_guard
    if images is None:
        images = zero_stage == 3 and rank.world_size > 1
    guard = ModalityGuard.of(images, processor, (loaded.train, loaded.eval), streaming=bool(data.streaming))
    tally = SkipTally(bad=loaded.skipped, entries=list(loaded.skip_log))
    if data.streaming:
        built, train_cache = _streamed(job, rank, loaded.sources[0], processor, guard, tally), None
    else:
        built, train_cache = _indexed(job, rank, loaded, processor, guard, tally, stop)
    if loaded.eval:
        built.eval_loader, built.accuracy_set, eval_pairs = _held_out(
            job, rank, processor, loaded.eval, guard, tally, stop
        )
        built.loaders.append(built.eval_loader)
        if eval_pairs is not None:
            built.pair_sets["eval"] = eval_pairs
    summary.records_skipped, summary.records_too_long = tally.bad, tally.too_long
    summary.records_truncated = tally.truncated
    if train_cache is not None:
        summary.data_cache = {
            "path": str(train_cache.path),
            "built": train_cache.built,
            "build_s": train_cache.build_seconds,
        }
    if rank.is_main and not (data.streaming and job.resume is not None):  # a stream's file lists rows met before
        _report_skipped(job, run_dir, tally)
    if data.streaming:
        tally.watch(_stream_skips(rank, run_dir, summary))
        barrier()  # rank 0 has written the file the ranks' streams append to
    built.video_guard = guard.videos
    return built


def _indexed(
    job: Job,
    rank: Rank,
    loaded: LoadedData,
    processor: Any,
    guard: ModalityGuard,
    tally: SkipTally,
    stop: Callable[[], bool],
) -> tuple[Data, CacheInfo | None]:
    """The training data of records read (and indexed) before training, through the data cache or not."""
    micro = job.micro_batch
    split = _split(job, rank, processor, loaded.train, "train", guard, tally, stop)
    train_set, collate, train_cache = split.dataset, split.collate, split.cache
    sources = train_set.sources if train_cache is not None else loaded.train.sources[split.kept]
    pairs = None
    if job.config.data.pairs:  # preference pairs: an item, a record of the sampler, is a pair of rows
        train_set, collate = _paired(rank, train_set, collate, split.kept, "train")
        pairs = PairSet(train_set, collate, train_cache.path.name if train_cache is not None else None)
    require_one_global_batch(len(train_set), micro, rank.world_size)  # decoding and length may drop records
    sampler = _sampler(job, rank, loaded, train_set, sources)
    if job.config.data.packing:  # rows of records (the cache's lengths planned into data.pack_length tokens)
        train_set, collate = PackedRows(train_set), PackedCollator(processor, **guard.args())
        if len(sampler) < micro:
            raise LauncherError(
                f"data: the records pack into {len(sampler)} row(s) of {sampler.budget} tokens per rank, fewer than "
                f"one micro-batch ({micro} rows): more records, a smaller train.micro_batch_size, or a shorter "
                "data.pack_length"
            )
    train_loader = DataLoader(
        train_set, batch_size=micro, sampler=sampler, drop_last=True, generator=torch.Generator(),
        collate_fn=collate, **_loader_args(job, rank),
    )  # fmt: skip
    dataset = train_cache.path.name if train_cache is not None else f"{len(train_set)} records"
    built = Data(
        batches=iter(()),
        position=DataPosition(dataset=dataset),
        sampler=sampler,
        micro=micro,
        world_size=rank.world_size,
        source_names=[source.name for source in loaded.sources] if loaded.mixture else [],
    )
    # Each loader draws its workers' seed from a generator of its own, not from the global one (whose
    # restored state a resumed run's extra draws would shift): see launcher.train.checkpoint.batches.
    # Over the position, not `built`: a cycle through `built` would keep the loader's workers alive past
    # the rank's end, and the interpreter's exit would wait on them (they ignore SIGTERM).
    if pairs is not None:
        built.pair_sets["train"] = pairs
    position = built.position
    built.restart = lambda: batches(train_loader, sampler, position, micro)
    built.loaders.append(train_loader)
    built.batches = built.restart()
    return built, train_cache


def _streamed(job: Job, rank: Rank, source: Source, processor: Any, guard: ModalityGuard, tally: SkipTally) -> Data:
    """The training data read from its shard files as training goes (data.streaming: launcher.data.stream)."""
    micro, position = job.micro_batch, DataPosition()
    streamed = streamed_batches_of(
        job.config.data, source, processor, guard,
        place=(int(job.config.train.seed), rank.rank, rank.world_size), micro=micro, position=position,
        skips=tally, loader_args=_loader_args(job, rank),
    )  # fmt: skip
    return Data(batches=streamed, position=position, sampler=None, micro=micro, world_size=rank.world_size)


def _stream_skips(rank: Rank, run_dir: RunDir, summary: Summary) -> Any:
    """What a stream does with the records it skips while training: every rank lists them in
    RUN/skipped_records.jsonl; summary.json counts rank 0's (each rank meets only its own)."""
    said = False

    def on_change(tally: SkipTally, new: list[dict[str, Any]]) -> None:
        nonlocal said
        run_dir.append_skipped_records([{"split": "train", "rank": rank.rank, **entry} for entry in new])
        summary.records_skipped, summary.records_too_long = tally.bad, tally.too_long
        summary.records_truncated = tally.truncated
        if new and rank.is_main and not said:
            log.info("data: the stream skips records that cannot train; each is listed in %s", run_dir.skipped_records)
            said = True

    return on_change


def read_records(job: Job, rank: Rank) -> LoadedData:
    """The train and eval records (at least one global micro-batch of them); rank 0 generates the built-in
    set first (if the launcher did not) while the others wait."""
    data, cache = job.config.data, cache_dir(job.config)
    if data.synthetic:
        with main_process_first(rank):
            prepare_data(data, cache)
    # Under on_bad_record=skip an image that does not decode must be found before training: the cache
    # build decodes every image anyway; without the cache the records are decoded here once.
    decode = str(data.on_bad_record) == "skip" and not data.cache
    loaded = read_data(data, cache, decode=decode)
    if rank.is_main and not data.streaming:
        log.info(
            "data: %d train, %d eval records (%d bad records skipped); format %s",
            len(loaded.train),
            len(loaded.eval),
            loaded.skipped,
            ", ".join(f"{source.name}={fmt}" for source, fmt in zip(loaded.sources, loaded.formats, strict=True)),
        )
    if not data.streaming:
        require_one_global_batch(len(loaded.train), job.micro_batch, rank.world_size)
    return loaded


def _sampler(job: Job, rank: Rank, loaded: LoadedData, train_set: Any, sources: np.ndarray) -> Any:
    """Whose indices the training loader takes: a mixture's, length-grouped ones, or a shuffled shard."""
    placement = {"num_replicas": rank.world_size, "rank": rank.rank, "seed": int(job.config.train.seed)}
    if loaded.mixture:
        sizes = np.bincount(sources, minlength=len(loaded.sources)).tolist()
        return MixtureSampler(sizes, [source.weight for source in loaded.sources], **placement)
    if job.config.data.packing:
        budget, most = int(pack_length(job.config.data) or 0), job.config.data.pack_max_images
        images = train_set.vision_inputs()[0] if most is not None else None  # packing reads the data cache
        return PackedSampler(train_set.lengths(), budget=budget, images=images, max_images=most, **placement)
    if job.config.data.group_by_length:
        return LengthGroupedSampler(train_set.lengths(), micro=job.micro_batch, **placement)
    return ResumableSampler(train_set, shuffle=True, **placement)


def _loader_args(job: Job, rank: Rank) -> dict[str, Any]:
    workers = int(job.config.data.num_workers)
    return {
        "num_workers": workers,
        "persistent_workers": workers > 0,
        "worker_init_fn": helper_process,  # no worker outlives its rank, nor stops before it has saved
        # Page-locked batches copy to a GPU asynchronously (the step moves them with non_blocking=True).
        "pin_memory": rank.device.type == "cuda",
    }


def _paired(rank: Rank, rows: Any, collate: Any, kept: Sequence[int], split: str) -> tuple[PairedRows, PairCollator]:
    """A split's rows as preference pairs (launcher.data.pairs): those whose both records survived."""
    paired = PairedRows(rows, kept)
    if rank.is_main:  # the records line counts answers; what trains is pairs
        left_out = f", {paired.dropped} left out as their other answer was skipped (skipped_records.jsonl)"
        log.info("data: %d %s preference pairs%s", len(paired), split, left_out if paired.dropped else "")
    if not len(paired):
        raise LauncherError(f"data: no {split} preference pair has both its answers left (each skipped: see the log)")
    return paired, PairCollator(collate)


def _held_out(
    job: Job,
    rank: Rank,
    processor: Any,
    records: Records,
    guard: ModalityGuard,
    tally: SkipTally,
    stop: Callable[[], bool],
) -> tuple[Any, Any, PairSet | None]:
    """The held-out loss loader, this rank's exact-match samples (None without data.eval_accuracy), and the
    held-out pairs (None unless data.pairs)."""
    data = job.config.data
    split = _split(job, rank, processor, records, "eval", guard, tally, stop)
    eval_set, collate, kept, cache = split.dataset, split.collate, split.kept, split.cache
    pairs = None
    if data.pairs:  # the held-out pairs; exact match asks for each pair's chosen answer
        eval_set, collate = _paired(rank, eval_set, collate, kept, "eval")
        pairs = PairSet(eval_set, collate, cache.path.name if cache is not None else None)
        kept = [int(kept[chosen]) for chosen, _ in eval_set.pairs]
    sampler = DistributedSampler(eval_set, num_replicas=rank.world_size, rank=rank.rank, shuffle=False)
    generator = torch.Generator().manual_seed(int(job.config.train.seed))
    loader = DataLoader(
        eval_set, batch_size=job.micro_batch, sampler=sampler, generator=generator, collate_fn=collate,
        **_loader_args(job, rank),
    )  # fmt: skip
    if not data.eval_accuracy:
        return loader, None, pairs
    # The same number of samples per rank: under ZeRO-3 the ranks' generate calls run in lock-step.
    usable = min(int(data.eval_samples), len(kept)) // rank.world_size * rank.world_size
    chosen = [records[int(i)] for i in kept[:usable][rank.rank :: rank.world_size]]
    samples = ConversationDataset(chosen, VideoSampling.of(data.video))
    return loader, samples, pairs


def _split(
    job: Job,
    rank: Rank,
    processor: Any,
    records: Records,
    split: str,
    guard: ModalityGuard,
    tally: SkipTally,
    stop: Callable[[], bool],
) -> Split:
    """One split through the data cache or decoded per batch (launcher.data.splits), under data.max_length:
    both cut and skip the same records, counted in `tally`."""
    if job.config.data.cache:
        built = cached_split(_cache(job, rank, processor, records, stop), processor, guard, split)
    else:
        built = decoded_split(job.config.data, processor, records, guard, split)
    tally.merge(built.skips)
    return built


def _cache(job: Job, rank: Rank, processor: Any, records: Records, stop: Callable[[], bool]) -> CacheInfo:
    """The records' data cache: every rank builds its share of a missing one (launcher.data.cache), and all
    stop it together when one was asked to stop."""
    part = Part(rank.rank, rank.world_size, barrier, stop_wanted=stop, any_rank=partial(any_rank, device=rank.device))
    info = ensure_job_cache(job.config.data, cache_dir(job.config), str(job.model_path), processor, records, part)
    if rank.is_main:
        log.info(
            "data cache %s: %s (%d records, %d skipped, %.1f MiB)",
            info.path,
            f"built in {info.build_seconds:.1f} s" if info.built else "reused",
            info.records,
            info.skipped,
            info.bytes / 2**20,
            extra={} if info.built else FILE_ONLY,  # a build took a while: the terminal says so
        )
    return info


def _report_skipped(job: Job, run_dir: RunDir, tally: SkipTally) -> None:
    """Rank 0: RUN/skipped_records.jsonl (rewritten at every start, so a resume repeats no line) and one
    log line with the counts, naming the file."""
    run_dir.write_skipped_records(tally.entries)
    longest = job.config.data.max_length
    parts = [
        f"{tally.bad} bad record(s) skipped" if tally.bad else "",
        f"{tally.too_long} record(s) over data.max_length={longest} skipped" if tally.too_long else "",
        f"{tally.truncated} record(s) truncated to data.max_length={longest}" if tally.truncated else "",
    ]
    parts = [part for part in parts if part]
    if parts:
        where = f": see {run_dir.skipped_records}" if tally.entries else ""
        log.info("data: %s%s", ", ".join(parts), where)


def check_same_dataset(data: Data, saved: DataPosition) -> None:
    """A resume must train on the records it saved its place in: a data file edited, cut or reordered since
    (or a hand-edited data setting) would silently resume at a place in other records."""
    now = data.position.dataset
    if saved.dataset is not None and now is not None and saved.dataset != now:
        raise LauncherError(
            f"the training data changed since the checkpoint was saved (data cache {saved.dataset} -> {now}: "
            "data.path's records, data.max_length or the model's processor differ); resume with the data it "
            "was saved with, or start a new run"
        )


def check_mixture_position(data: Data, saved: DataPosition) -> None:
    """A resumed mixture must be the one saved: the same sources, records per source and draws per source."""
    now = data.mixture_position(data.global_draws(saved.batches))
    if saved.sources != now:
        raise LauncherError(
            f"the checkpoint's mixture {saved.sources} differs from the data's now {now} at the same step: "
            "data.sources (files, their records, weights or names) changed since it was saved; resume with the "
            "same mixture"
        )
