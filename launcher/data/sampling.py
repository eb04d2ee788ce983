"""Deterministic, resumable samplers: a weighted mixture of sources, and batches grouped by length.

Both offer what `checkpoint.batches` drives: a `seed`, a settable `start` (how many of this rank's
indices to skip on resume) and `set_epoch`. Every index is a pure function of the seed and its position,
so a resumed run sees exactly the stream the uninterrupted run would have seen, without replaying it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from launcher.core.errors import LauncherError
from launcher.data.packing import pack_rows


def _check_ranks(num_replicas: int, rank: int) -> None:
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} and num_replicas={num_replicas}: need 0 <= rank < num_replicas")


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to `total`, proportional to `weights` (Hamilton's method, ties to the lower index)."""
    quotas = weights / weights.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    short = total - int(counts.sum())
    counts[np.argsort(-(quotas - counts), kind="stable")[:short]] += 1
    return counts


class MixtureSampler(Sampler[int]):
    """An infinite stream over concatenated sources, mixed in exact proportions to their weights.

    The global stream of draws is cut into blocks of `block` draws. Each block holds the
    largest-remainder count of each source, in an order shuffled per block, so the ratio is exact over
    every full block yet random within it. Each source is walked in its own shuffled order, reshuffled
    each time it is used up: a small source repeats, a big one is never exhausted. Draw g goes to rank
    g % num_replicas, so ranks share one stream and together consume it exactly once.

    There is no epoch and no length: `set_epoch` does nothing, and `len()` raises TypeError (a
    DataLoader iterates it without asking). `start` skips this rank's first `start` items in time
    proportional to one block, not to `start`.
    """

    def __init__(
        self,
        source_sizes: list[int],
        weights: list[float],
        *,
        num_replicas: int,
        rank: int,
        seed: int,
        block: int = 1000,
    ) -> None:
        _check_ranks(num_replicas, rank)
        if block < 1:
            raise ValueError(f"block={block}: must be at least 1")
        self.sizes = _checked_sizes(source_sizes)
        w = _checked_weights(weights, len(self.sizes))
        self.block_counts = _largest_remainder(w, block)
        for s in np.flatnonzero(self.block_counts == 0):
            raise LauncherError(
                f"data.sources[{s}].weight={weights[s]}: less than one draw in {block}, so it would never be "
                "sampled; raise its weight"
            )
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.block = block
        self.start = 0
        self._perms: dict[int, tuple[int, np.ndarray]] = {}  # source -> (its epoch, its order): the last one used

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: the stream has no epochs. Kept so the training loop can drive any sampler."""

    def source_of(self, index: int) -> int:
        """The source a dataset index belongs to (for per-source metrics)."""
        if not 0 <= index < self.offsets[-1]:
            raise IndexError(f"index {index} is outside the {self.offsets[-1]} examples of the sources")
        return int(np.searchsorted(self.offsets, index, side="right")) - 1

    def source_counts(self, global_draws: int) -> list[int]:
        """How many of the first `global_draws` draws (all ranks) came from each source.

        This is each source's position in its own order, the number a checkpoint records per source."""
        full, rest = divmod(global_draws, self.block)
        labels, _ = self._block(full)
        counts = full * self.block_counts + np.bincount(labels[:rest], minlength=len(self.sizes))
        return [int(c) for c in counts]

    def __iter__(self) -> Iterator[int]:
        first = self.rank + self.start * self.num_replicas  # this rank's first global draw
        b = first // self.block
        while True:
            lo = b * self.block
            g0 = max(first, lo)
            g0 += (self.rank - g0) % self.num_replicas  # the first draw of this rank in the block
            yield from self._indices(b, np.arange(g0 - lo, self.block, self.num_replicas)).tolist()
            b += 1

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's source labels, and for each position how many earlier draws in the block share its source."""
        labels = np.repeat(np.arange(len(self.sizes)), self.block_counts)
        labels = np.random.default_rng([self.seed, 0, b]).permutation(labels)
        order = np.argsort(labels, kind="stable")
        firsts = np.concatenate([[0], np.cumsum(self.block_counts)[:-1]])
        earlier = np.empty(self.block, dtype=np.int64)
        earlier[order] = np.arange(self.block) - firsts[labels[order]]
        return labels, earlier

    def _indices(self, b: int, positions: np.ndarray) -> np.ndarray:
        """The dataset indices drawn at `positions` within block b."""
        labels, earlier = self._block(b)
        sources = labels[positions]
        ks = b * self.block_counts[sources] + earlier[positions]  # each draw's place in its source's walk
        out = np.empty(len(positions), dtype=np.int64)
        for s in np.unique(sources):
            at = np.flatnonzero(sources == s)
            epochs, within = np.divmod(ks[at], self.sizes[s])
            for epoch in np.unique(epochs):
                sel = epochs == epoch
                out[at[sel]] = self.offsets[s] + self._perm(int(s), int(epoch))[within[sel]]
        return out

    def _perm(self, s: int, epoch: int) -> np.ndarray:
        """Source s's order in its `epoch`-th pass; only the last one is kept, as a big source's is large."""
        cached = self._perms.get(s)
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, 1, s, epoch]).permutation(self.sizes[s]))
            self._perms[s] = cached
        return cached[1]


def _checked_sizes(source_sizes: list[int]) -> np.ndarray:
    if len(source_sizes) == 0:
        raise LauncherError("data.sources is empty: give at least one source")
    for s, size in enumerate(source_sizes):
        if size < 1:
            raise LauncherError(f"data.sources[{s}] has {size} examples: every source needs at least one")
    return np.asarray(source_sizes, dtype=np.int64)


def _checked_weights(weights: list[float], n: int) -> np.ndarray:
    if len(weights) != n:
        raise LauncherError(f"data.sources: {n} sources but {len(weights)} weights; give one weight per source")
    for s, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w <= 0:
            raise LauncherError(f"data.sources[{s}].weight={w}: weights must be positive numbers")
    return np.asarray(weights, dtype=np.float64)


class LengthGroupedSampler(Sampler[int]):
    """An epoch sampler whose global steps hold examples of similar length, to cut padding.

    Each epoch shuffles all indices, cuts them into megabatches of `megabatch_factor` global steps and
    sorts each megabatch by length, longest first, so neighbours in the list have similar lengths. The
    global steps (micro * num_replicas neighbours) are then put in a random order, so the longest steps
    do not always come first. Rank r takes positions r::num_replicas, as DistributedSampler does, so
    every rank's k-th micro-batch is a slice of global step k.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        num_replicas: int,
        rank: int,
        seed: int,
        micro: int,
        megabatch_factor: int = 50,
    ) -> None:
        _check_ranks(num_replicas, rank)
        if micro < 1 or megabatch_factor < 1:
            raise ValueError(f"micro={micro}, megabatch_factor={megabatch_factor}: both must be at least 1")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.micro = micro
        self.megabatch_factor = megabatch_factor
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def epoch_order(self) -> np.ndarray:
        """All ranks' indices for this epoch, global step after global step."""
        rng = np.random.default_rng([self.seed, self.epoch])
        step = self.micro * self.num_replicas
        # Drop the tail of the shuffle, not of the sorted list: dropped examples are random, not the shortest.
        perm = rng.permutation(len(self.lengths))[: len(self.lengths) // step * step]
        mega = step * self.megabatch_factor
        chunks = [perm[i : i + mega] for i in range(0, len(perm), mega)]
        order = np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")] for c in chunks] or [perm])
        steps = order.reshape(-1, step)
        return steps[rng.permutation(len(steps))].reshape(-1)

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order()[self.rank :: self.num_replicas][self.start :].tolist())

    def __len__(self) -> int:
        step = self.micro * self.num_replicas
        return max(0, len(self.lengths) // step * self.micro - self.start)


class PackedSampler(Sampler[tuple[int, ...]]):
    """This rank's packed rows of an epoch (tuples of record indices, for launcher.data.packing.PackedRows),
    from row `start` on. The epoch's plan (launcher.data.packing.pack_rows over the records' lengths) is
    dealt out row by row, rank r taking rows r, r + num_replicas, ..., cut to the same count on every rank.
    The same seed, lengths and budget give the same plan: a resume recomputes it and skips `start` rows."""

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        *,
        budget: int,
        num_replicas: int,
        rank: int,
        seed: int,
        images: Sequence[int] | np.ndarray | None = None,
        max_images: int | None = None,
    ) -> None:
        _check_ranks(num_replicas, rank)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.budget, self.num_replicas, self.rank, self.seed = budget, num_replicas, rank, seed
        self.images, self.max_images = images, max_images  # data.pack_max_images: images per row at most
        self.epoch = 0
        self.start = 0
        self._plan: tuple[int, list[list[int]]] | None = None  # (epoch, its rows for this rank)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rows(self) -> list[list[int]]:
        if self._plan is None or self._plan[0] != self.epoch:
            plan = pack_rows(
                self.lengths,
                self.budget,
                seed=self.seed,
                epoch=self.epoch,
                images=self.images,
                max_images=self.max_images,
            )
            usable = len(plan) // self.num_replicas * self.num_replicas
            self._plan = (self.epoch, plan[self.rank : usable : self.num_replicas])
        return self._plan[1]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return (tuple(row) for row in self.rows()[self.start :])

    def __len__(self) -> int:
        return max(0, len(self.rows()) - self.start)
