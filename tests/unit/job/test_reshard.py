"""launcher.job.reshard (pure): what a resume on another world size or ZeRO stage keeps, and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest

from launcher.core.checkpoints import CheckpointMarker
from launcher.core.errors import LauncherError
from launcher.job.reshard import Reshard, batch_overrides, reshard_for, resumed_batches

MARKER = CheckpointMarker(
    step=8, tag="step8", world_size=2, zero_stage=3, precision="fp32", global_batch=16, micro_batch=2
)


def marker(**changes) -> CheckpointMarker:
    return dataclasses.replace(MARKER, **changes)


def current(**changes):
    job = {"world_size": 1, "zero_stage": 2, "global_batch": 16, "offload_optimizer": None, "data": {}}
    return {**job, **changes}


def test_the_same_shape_is_a_plain_resume():
    assert reshard_for(MARKER, current(world_size=2, zero_stage=3)) is None


def test_another_world_size_or_stage_is_a_reshard_that_says_what_changes():
    reshard = reshard_for(MARKER, current())
    assert reshard == Reshard(2, 3, 2, 16, 1, 2)
    assert reshard.describe() == "2 rank(s) at ZeRO-3 -> 1 rank(s) at ZeRO-2"
    assert Reshard.from_json(reshard.to_json()) == reshard
    assert reshard.converts and not reshard.keeps_ranks
    # ZeRO-0 to ZeRO-0 on another world size: the one file holds everything; no conversion (any precision).
    zero0 = reshard_for(marker(zero_stage=0), current(world_size=4, zero_stage=0, precision="bf16"))
    assert zero0 is not None and not zero0.converts
    # Only the stage changes: the ranks keep their own random state.
    assert reshard_for(MARKER, current(world_size=2, zero_stage=1)).keeps_ranks


def test_offloading_the_optimizer_or_no_longer_is_a_reshard_too():
    """DeepSpeed's CPU Adam and torch's AdamW do not read each other's optimizer state."""
    offloaded = marker(offload_optimizer="cpu")
    reshard = reshard_for(offloaded, current(world_size=2, zero_stage=3))
    assert reshard is not None and reshard.converts and reshard.keeps_ranks
    assert reshard.describe() == ("2 rank(s) at ZeRO-3 with the optimizer offloaded (cpu) -> 2 rank(s) at ZeRO-3")
    assert Reshard.from_json(reshard.to_json()) == reshard
    assert reshard_for(offloaded, current(world_size=2, zero_stage=3, offload_optimizer="cpu")) is None
    # An older checkpoint, which does not record its offload: taken as unchanged.
    assert reshard_for(MARKER, current(world_size=2, zero_stage=3, offload_optimizer="cpu")) is None


@pytest.mark.parametrize(
    ("saved", "job", "message"),
    [
        (marker(global_batch=None), {}, "does not record its batch sizes"),
        (MARKER, {"offload_optimizer": "nvme"}, "with NVMe optimizer offload"),
        (MARKER, {"data": {"sources": [{"path": "a.json"}]}}, "cannot resume a mixture (data.sources)"),
        (MARKER, {"data": {"group_by_length": True}}, "cannot resume data.group_by_length=true"),
        (MARKER, {"data": {"streaming": True}}, "cannot resume data.streaming=true on another world size"),
        (MARKER, {"global_batch": 32}, "with another global batch: the checkpoint trained with 16"),
        (MARKER, {"zero_stage": 0, "precision": "bf16"}, "in bf16 to or from ZeRO-0"),
    ],
)
def test_what_cannot_continue_on_another_shape_is_one_line(saved, job, message):
    with pytest.raises(LauncherError) as refused:
        reshard_for(saved, current(**job))
    assert message in str(refused.value)
    assert "(2 rank(s) at ZeRO-3" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_data_ordered_per_rank_may_still_change_stage_on_the_same_ranks():
    job = current(world_size=2, zero_stage=2, data={"group_by_length": True, "sources": [{"path": "a"}]})
    assert reshard_for(MARKER, job) == Reshard(2, 3, 2, 16, 2, 2)


def test_the_global_batch_is_kept_by_adjusting_accumulation():
    assert batch_overrides(16, 2, 1, {}) == [
        "train.micro_batch_size=2",
        "train.grad_accum=null",
        "train.global_batch_size=16",
    ]
    assert batch_overrides(16, 2, 4, {"train.micro_batch_size": "4"})[0] == "train.micro_batch_size=4"
    assert batch_overrides(16, 2, 4, {"train.global_batch_size": 16})[2] == "train.global_batch_size=16"
    # A given accumulation sets the micro batch; both given must multiply to the global batch.
    assert batch_overrides(16, 2, 2, {"train.grad_accum": "2"})[0] == "train.micro_batch_size=4"
    assert batch_overrides(16, 2, 2, {"train.grad_accum": "2", "train.micro_batch_size": "4"})[0].endswith("=4")
    with pytest.raises(LauncherError, match=r"train.grad_accum=3: the checkpoint's global batch 16 is no multiple"):
        batch_overrides(16, 2, 2, {"train.grad_accum": "3"})
    with pytest.raises(LauncherError, match=r"micro_batch_size=2 x train.grad_accum=2 x 2 rank\(s\) is not"):
        batch_overrides(16, 2, 2, {"train.grad_accum": "2", "train.micro_batch_size": "2"})


def test_a_global_batch_that_cannot_be_kept_names_the_micro_batches_that_can():
    with pytest.raises(LauncherError, match=r"global batch 16 cannot be kept on 2 rank\(s\) with micro batch 16"):
        batch_overrides(16, 16, 2, {})
    with pytest.raises(LauncherError, match=r"give train.micro_batch_size=2 or 4 or 8$"):
        batch_overrides(16, 16, 2, {})
    with pytest.raises(LauncherError, match="choose a world size that divides it"):
        batch_overrides(4, 4, 3, {})
    with pytest.raises(LauncherError, match=r"global_batch_size=32: a resume keeps the checkpoint's"):
        batch_overrides(16, 2, 1, {"train.global_batch_size": 32})


@pytest.mark.parametrize(
    ("batches", "saved_micro", "saved_ranks", "micro", "ranks", "expected"),
    [
        (8, 2, 2, 2, 1, 16),  # 32 samples drawn: 16 micro-batches of 2 on one rank
        (16, 2, 1, 2, 2, 8),
        (8, 2, 2, 4, 2, 4),
        (0, 2, 2, 2, 1, 0),
    ],
)
def test_each_rank_resumes_where_all_ranks_together_had_drawn(
    batches, saved_micro, saved_ranks, micro, ranks, expected
):
    assert resumed_batches(batches, saved_micro, saved_ranks, micro, ranks) == expected


def test_a_position_between_micro_batches_is_refused():
    with pytest.raises(LauncherError, match="no whole number of micro batches of 4 on 2 rank"):
        resumed_batches(3, 2, 1, 4, 2)


def test_the_same_samples_make_each_global_step_on_any_world_size():
    """The premise of resumed_batches: the samplers deal one shuffled order, rank r taking every
    world_size-th sample, so step s's samples (all ranks together) do not depend on the world size."""
    from launcher.train.checkpoint import ResumableSampler

    records, global_batch = list(range(64)), 8

    def steps(world_size: int) -> list[set[int]]:
        per_rank = [
            list(ResumableSampler(records, num_replicas=world_size, rank=r, shuffle=True, seed=5))
            for r in range(world_size)
        ]
        share = global_batch // world_size
        return [
            {index for order in per_rank for index in order[s * share : (s + 1) * share]}
            for s in range(len(records) // global_batch)
        ]

    assert steps(1) == steps(2) == steps(4)
