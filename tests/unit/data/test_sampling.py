"""launcher.data.sampling: exact mixture ratios, resume equivalence, rank partition, and length grouping that
cuts padding (and the training loop's walk over both samplers, launcher.train.checkpoint.batches)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from launcher.core.errors import LauncherError
from launcher.data.sampling import LengthGroupedSampler, MixtureSampler, PackedSampler
from launcher.train import checkpoint


def take(sampler, n: int, start: int = 0) -> list[int]:
    sampler.start = start
    return list(itertools.islice(iter(sampler), n))


def reference_stream(sizes, block_counts, seed: int, block: int, n: int) -> list[int]:
    """The global stream as the spec describes it, draw by draw: the slow definition the sampler must match."""
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    drawn = [0] * len(sizes)
    out = []
    for g in range(n):
        b, j = divmod(g, block)
        labels = np.random.default_rng([seed, 0, b]).permutation(np.repeat(np.arange(len(sizes)), block_counts))
        s = int(labels[j])
        epoch, within = divmod(drawn[s], sizes[s])
        out.append(int(offsets[s] + np.random.default_rng([seed, 1, s, epoch]).permutation(sizes[s])[within]))
        drawn[s] += 1
    return out


# ----------------------------------------------------------------------------- MixtureSampler


def test_mixture_ratio_is_exact_in_every_full_block_and_random_within_it():
    sampler = MixtureSampler([10_000, 10_000], [3.0, 1.0], num_replicas=1, rank=0, seed=0)
    sources = np.array([sampler.source_of(i) for i in take(sampler, 2000)])
    assert abs(int((sources == 0).sum()) - 1500) <= 75
    for b in range(2):
        assert (sources[b * 1000 : (b + 1) * 1000] == 0).sum() == 750
    assert not (np.diff(sources[:1000]) >= 0).all()  # shuffled, not 750 zeros then 250 ones


@pytest.mark.parametrize(
    ("weights", "block", "expected"),
    [([3, 1], 1000, [750, 250]), ([1, 1, 1], 1000, [334, 333, 333]), ([0.5, 0.3, 0.2], 7, [4, 2, 1])],
)
def test_block_counts_by_largest_remainder(weights, block, expected):
    sampler = MixtureSampler([5] * len(weights), weights, num_replicas=1, rank=0, seed=0, block=block)
    assert sampler.block_counts.tolist() == expected


def test_stream_matches_the_draw_by_draw_definition():
    sizes, block = [5, 37, 200], 16
    sampler = MixtureSampler(sizes, [1.0, 2.0, 1.0], num_replicas=1, rank=0, seed=3, block=block)
    assert take(sampler, 500) == reference_stream(sizes, sampler.block_counts, 3, block, 500)


@pytest.mark.parametrize("num_replicas", [1, 2])
@pytest.mark.parametrize("k", [0, 1, 7, 8, 15, 16, 17, 40, 123, 1000])
def test_mixture_resume_at_start_equals_the_uninterrupted_stream(num_replicas, k):
    # Block 16 and a source of 5: resumes land inside blocks and across reshuffles of the small source.
    for rank in range(num_replicas):
        args = dict(num_replicas=num_replicas, rank=rank, seed=11, block=16)
        full = take(MixtureSampler([5, 37], [1.0, 1.5], **args), k + 300)
        assert take(MixtureSampler([5, 37], [1.0, 1.5], **args), 300, start=k) == full[k:]


def test_ranks_together_consume_the_global_stream_exactly_once():
    sizes, weights = [7, 50, 300], [2.0, 1.0, 1.0]
    whole = take(MixtureSampler(sizes, weights, num_replicas=1, rank=0, seed=5, block=10), 3 * 200)
    per_rank = [take(MixtureSampler(sizes, weights, num_replicas=3, rank=r, seed=5, block=10), 200) for r in range(3)]
    assert [x for step in zip(*per_rank, strict=True) for x in step] == whole


@pytest.mark.parametrize("draws", [0, 1, 9, 10, 11, 99, 100, 457])
def test_source_counts_match_counting_the_stream(draws):
    sampler = MixtureSampler([4, 20, 90], [1.0, 3.0, 2.0], num_replicas=1, rank=0, seed=2, block=10)
    brute = np.bincount([sampler.source_of(i) for i in take(sampler, draws)], minlength=3)
    assert sampler.source_counts(draws) == brute.tolist()


def test_source_counts_is_fast_for_millions_of_draws():
    sampler = MixtureSampler([100, 10**6], [1.0, 9.0], num_replicas=8, rank=0, seed=0)
    counts = sampler.source_counts(10**9 + 5)  # 10**6 blocks of [100, 900], then 5 draws into the next
    assert sum(counts) == 10**9 + 5
    assert 10**8 <= counts[0] <= 10**8 + 5
    assert sampler.source_counts(10**9) == [10**8, 9 * 10**8]


def test_resume_deep_into_the_stream_skips_in_blocks():
    sampler = MixtureSampler([100, 10**5], [1.0, 1.0], num_replicas=2, rank=1, seed=0)
    assert len(take(sampler, 10, start=10**9)) == 10  # iterating 10**9 items one by one would not finish


def test_small_source_repeats_each_element_equally_and_big_source_does_not_repeat():
    # Block 4 with equal weights: 2 draws per block from each source.
    sampler = MixtureSampler([3, 1000], [1.0, 1.0], num_replicas=1, rank=0, seed=9, block=4)
    stream = take(sampler, 4 * 150)  # 300 draws from each source: 100 passes over the small one
    small = [i for i in stream if i < 3]
    big = [i for i in stream if i >= 3]
    assert np.bincount(small).tolist() == [100, 100, 100]
    assert all(sorted(small[p : p + 3]) == [0, 1, 2] for p in range(0, 300, 3))  # each pass is a permutation
    assert len(set(big)) == len(big) == 300
    assert len({tuple(small[p : p + 3]) for p in range(0, 300, 3)}) > 1  # reshuffled between passes


def test_mixture_is_deterministic_and_depends_on_the_seed():
    def make(seed):
        return MixtureSampler([13, 400], [1.0, 4.0], num_replicas=2, rank=1, seed=seed, block=50)

    assert take(make(1), 2000) == take(make(1), 2000)
    assert take(make(1), 2000) != take(make(2), 2000)
    sampler = make(1)
    sampler.set_epoch(5)  # no epochs: the stream does not change
    assert take(sampler, 100) == take(make(1), 100)


def test_source_of_maps_indices_to_sources():
    sampler = MixtureSampler([3, 1, 4], [1.0, 1.0, 1.0], num_replicas=1, rank=0, seed=0)
    assert [sampler.source_of(i) for i in range(8)] == [0, 0, 0, 1, 2, 2, 2, 2]
    with pytest.raises(IndexError):
        sampler.source_of(8)


@pytest.mark.parametrize(
    ("sizes", "weights", "message"),
    [
        ([5, 5], [1.0, -1], r"data\.sources\[1\]\.weight=-1: weights must be positive"),
        ([5, 5], [0, 1.0], r"data\.sources\[0\]\.weight=0"),
        ([5, 5], [1.0, math.nan], r"data\.sources\[1\]\.weight=nan"),
        ([5, 5], [math.inf, 1.0], r"data\.sources\[0\]\.weight=inf"),
        ([5, 5], [1.0, "2"], r"data\.sources\[1\]\.weight=2"),
        ([5, 5], [1.0], r"data\.sources: 2 sources but 1 weights"),
        ([], [], r"data\.sources is empty"),
        ([5, 0], [1.0, 1.0], r"data\.sources\[1\] has 0 examples"),
        ([5, 5], [1.0, 1e-5], r"data\.sources\[1\]\.weight=1e-05: less than one draw in 1000"),
    ],
)
def test_bad_sources_raise_a_launcher_error_naming_data_sources(sizes, weights, message):
    with pytest.raises(LauncherError, match=message):
        MixtureSampler(sizes, weights, num_replicas=1, rank=0, seed=0)


def test_mixture_has_no_length():
    with pytest.raises(TypeError):
        len(MixtureSampler([5], [1.0], num_replicas=1, rank=0, seed=0))


def test_dataloader_iterates_the_infinite_stream_and_resumes_at_start():
    dataset = TensorDataset(torch.arange(12))
    micro = 4

    def loader(start):
        sampler = MixtureSampler([5, 7], [1.0, 2.0], num_replicas=2, rank=1, seed=4, block=6)
        sampler.start = start
        return DataLoader(dataset, batch_size=micro, sampler=sampler, drop_last=True)

    full = [b[0].tolist() for b in itertools.islice(loader(0), 10)]
    assert all(len(b) == micro for b in full)
    assert [b[0].tolist() for b in itertools.islice(loader(3 * micro), 7)] == full[3:]


def test_training_loop_resumes_the_mixture_where_it_stopped():
    dataset = TensorDataset(torch.arange(12))
    micro = 2

    def run(position, n):
        sampler = MixtureSampler([5, 7], [1.0, 2.0], num_replicas=1, rank=0, seed=4, block=6)
        loader = DataLoader(dataset, batch_size=micro, sampler=sampler, drop_last=True)
        return [b[0].tolist() for b in itertools.islice(checkpoint.batches(loader, sampler, position, micro), n)]

    full = run(checkpoint.DataPosition(), 20)
    position = checkpoint.DataPosition()
    first = run(position, 8)
    assert first + run(checkpoint.DataPosition(position.epoch, position.batches), 12) == full


# ----------------------------------------------------------------------------- LengthGroupedSampler


def grouped(lengths, *, num_replicas=1, rank=0, seed=0, micro=4, megabatch_factor=50, epoch=0, start=0):
    sampler = LengthGroupedSampler(
        lengths, num_replicas=num_replicas, rank=rank, seed=seed, micro=micro, megabatch_factor=megabatch_factor
    )
    sampler.set_epoch(epoch)
    sampler.start = start
    return sampler


def padding_waste(lengths: np.ndarray, per_rank: list[list[int]], micro: int) -> int:
    """Padding of every rank's micro-batches: each pads its items to its longest."""
    waste = 0
    for stream in per_rank:
        for batch in np.asarray(stream).reshape(-1, micro):
            waste += micro * lengths[batch].max() - lengths[batch].sum()
    return int(waste)


def test_grouping_by_length_cuts_padding():
    lengths = np.random.default_rng(0).integers(20, 401, size=10_000)
    micro, replicas = 8, 2
    per_rank = [list(grouped(lengths.tolist(), num_replicas=replicas, rank=r, micro=micro)) for r in range(replicas)]
    shuffled = np.random.default_rng(1).permutation(len(lengths))
    random_order = [shuffled[r::replicas].tolist() for r in range(replicas)]
    assert padding_waste(lengths, per_rank, micro) < 0.1 * padding_waste(lengths, random_order, micro)


def test_steps_are_sorted_longest_first_but_long_steps_are_not_all_first():
    lengths = np.random.default_rng(0).integers(20, 401, size=2000).tolist()
    sampler = grouped(lengths, micro=4, megabatch_factor=50)
    steps = np.reshape(sampler.epoch_order(), (-1, 4))
    assert all(lengths[a] >= lengths[b] for step in steps for a, b in itertools.pairwise(step))  # longest first
    step_max = [max(lengths[i] for i in step) for step in steps]
    assert not all(a >= b for a, b in itertools.pairwise(step_max[:50]))
    assert step_max.index(max(step_max)) != 0


def test_ranks_partition_the_epoch_and_drop_the_tail():
    lengths = list(range(1, 1003))  # 1002 = 62 global steps of 16, and 10 left over
    per_rank = [list(grouped(lengths, num_replicas=4, rank=r, micro=4, megabatch_factor=3)) for r in range(4)]
    assert all(len(stream) == 62 * 4 for stream in per_rank)
    everything = [i for stream in per_rank for i in stream]
    assert len(set(everything)) == len(everything) == 62 * 16


def test_each_ranks_micro_batch_is_a_slice_of_the_same_global_step():
    lengths = np.random.default_rng(3).integers(20, 401, size=800)
    per_rank = [list(grouped(lengths.tolist(), num_replicas=2, rank=r, micro=4, megabatch_factor=10)) for r in range(2)]
    order = grouped(lengths.tolist(), num_replicas=2, micro=4, megabatch_factor=10).epoch_order().reshape(-1, 8)
    for k, step in enumerate(order):
        assert sorted(per_rank[0][4 * k : 4 * k + 4] + per_rank[1][4 * k : 4 * k + 4]) == sorted(step.tolist())


@pytest.mark.parametrize("start", [0, 1, 5, 37, 100, 123, 124, 500])
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_grouped_resume_at_start_is_the_tail_of_the_epoch(start, num_replicas):
    lengths = np.random.default_rng(5).integers(20, 401, size=500).tolist()
    for rank in range(num_replicas):
        full = list(grouped(lengths, num_replicas=num_replicas, rank=rank, epoch=2))
        resumed = grouped(lengths, num_replicas=num_replicas, rank=rank, epoch=2, start=start)
        assert list(resumed) == full[start:]
        assert len(resumed) == len(full[start:])


def test_grouped_is_deterministic_and_epochs_differ():
    lengths = np.random.default_rng(6).integers(20, 401, size=1000).tolist()
    assert list(grouped(lengths, seed=1, epoch=3)) == list(grouped(lengths, seed=1, epoch=3))
    assert list(grouped(lengths, seed=1, epoch=3)) != list(grouped(lengths, seed=1, epoch=4))
    assert list(grouped(lengths, seed=1, epoch=3)) != list(grouped(lengths, seed=2, epoch=3))


def test_training_loop_walks_grouped_epochs_and_resumes_mid_epoch():
    lengths = np.random.default_rng(7).integers(20, 401, size=50).tolist()
    dataset = TensorDataset(torch.arange(50))
    micro = 4

    def run(position, n):
        sampler = grouped(lengths, seed=3, micro=micro, megabatch_factor=2)
        loader = DataLoader(dataset, batch_size=micro, sampler=sampler, drop_last=True)
        return [b[0].tolist() for b in itertools.islice(checkpoint.batches(loader, sampler, position, micro), n)]

    full = run(checkpoint.DataPosition(), 30)  # 12 batches per epoch: crosses two epoch boundaries
    assert full[:12] != full[12:24]
    position = checkpoint.DataPosition()
    first = run(position, 17)
    assert (position.epoch, position.batches) == (1, 5)
    assert first + run(checkpoint.DataPosition(1, 5), 13) == full


@pytest.mark.parametrize(("num_replicas", "rank"), [(0, 0), (2, 2), (2, -1)])
def test_a_rank_outside_the_group_is_refused(num_replicas, rank):
    with pytest.raises(ValueError, match=rf"rank={rank} and num_replicas={num_replicas}: need 0 <= rank"):
        MixtureSampler([5], [1.0], num_replicas=num_replicas, rank=rank, seed=0)
    with pytest.raises(ValueError, match=rf"rank={rank} and num_replicas={num_replicas}: need 0 <= rank"):
        grouped([1, 2, 3], num_replicas=num_replicas, rank=rank)
    with pytest.raises(ValueError, match="micro=0, megabatch_factor=50: both must be at least 1"):
        grouped([1, 2, 3], micro=0)


def test_packed_rows_are_dealt_to_the_ranks_once_each_and_resume_from_any_row():
    lengths = np.random.default_rng(1).integers(20, 401, 600)
    for world in (1, 2, 3):
        samplers = [PackedSampler(lengths, budget=1024, num_replicas=world, rank=r, seed=4) for r in range(world)]
        shares = [list(sampler) for sampler in samplers]
        assert len({len(share) for share in shares}) == 1  # every rank the same number of rows
        records = [i for share in shares for row in share for i in row]
        assert len(records) == len(set(records))  # no record twice in an epoch
        assert all(sum(lengths[list(row)]) <= 1024 for share in shares for row in share)
        samplers[0].start = 5
        assert list(samplers[0]) == shares[0][5:] and len(samplers[0]) == len(shares[0]) - 5
        samplers[0].set_epoch(1)
        samplers[0].start = 0
        assert list(samplers[0]) != shares[0]  # another epoch, another plan
