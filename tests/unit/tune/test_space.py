"""launcher.tune.space: the candidates of a tuning and the command line each adds to the job's."""

from __future__ import annotations

from launcher.config.schema import DeepSpeedPreset
from launcher.plan.memory import PRESETS
from launcher.tune.space import Candidate, base_overrides, default_micro_batch_sizes, search_space


def test_the_schema_lists_every_preset_the_planner_knows():
    assert [p.value for p in DeepSpeedPreset] == list(PRESETS)


def test_micro_batch_sizes_keep_the_global_batch_and_the_rest_is_said():
    candidates, left_out = search_space(
        ["z0", "z3"], ["fp32"], [16, 4, 8, 3, 32], [False, True], [None], global_batch=32, world_size=2
    )
    assert {(c.micro, c.accum) for c in candidates} == {(4, 4), (8, 2), (16, 1)}
    assert all(c.micro * c.accum * 2 == 32 for c in candidates)
    assert len(candidates) == 2 * 3 * 2
    # presets in the order given; within a group, micro batch sizes ascending
    assert [c.name for c in candidates[:3]] == ["z0-fp32-mb4", "z0-fp32-mb8", "z0-fp32-mb16"]
    assert candidates[3].name == "z0-fp32-mb4-gc" and candidates[6].preset == "z3"
    assert any("micro batch 3" in line and "no multiple" in line for line in left_out)
    assert any("micro batch 32" in line for line in left_out)


def test_nothing_fits_the_global_batch_leaves_no_candidate():
    candidates, left_out = search_space(["z0"], ["fp32"], [5, 0], [False], [None], global_batch=8, world_size=1)
    assert candidates == [] and len(left_out) == 2


def test_a_candidate_names_every_choice_it_makes():
    c = Candidate("z2_offload", "bf16", 4, 8, True, "sdpa")
    assert c.name == "z2_offload-bf16-mb4-gc-sdpa"
    line = c.overrides(64)
    assert line[:3] == ["deepspeed=z2_offload", "precision=bf16", "train.micro_batch_size=4"]
    assert "train.global_batch_size=64" in line and "train.grad_accum=null" in line
    assert "model.gradient_checkpointing=true" in line and "model.vision_gradient_checkpointing=true" in line
    assert "model.attn_implementation=sdpa" in line
    assert "model.attn_implementation=sdpa" not in Candidate("z0", "fp32", 4, 8, False).overrides(64)
    # a group: the candidates that differ only in micro batch size
    assert c.group == Candidate("z2_offload", "bf16", 8, 4, True, "sdpa").group
    assert c.group != Candidate("z2", "bf16", 4, 8, True, "sdpa").group


def test_the_base_job_loses_what_candidates_set_and_what_only_the_tuner_reads():
    given = [
        "model.hidden_size=512",
        "deepspeed=z3",
        "zero.stage=2",
        "precision=bf16",
        "train.micro_batch_size=8",
        "train.global_batch_size=32",
        "+train.grad_accum=2",
        "model.gradient_checkpointing=true",
        "model.attn_implementation=eager",
        "tune.memory_gb=1",
        "hydra.run.dir=x",
        "logger=none",
        "preflight=error",
        "data=llava_json",
    ]
    assert base_overrides(given, tunes_attention=False) == [
        "model.hidden_size=512",
        "model.attn_implementation=eager",
        "data=llava_json",
    ]
    assert "model.attn_implementation=eager" not in base_overrides(given, tunes_attention=True)


def test_the_default_micro_batch_sizes_are_half_the_jobs_its_own_and_double():
    assert default_micro_batch_sizes(8) == [4, 8, 16]
    assert default_micro_batch_sizes(1) == [1, 2]


def test_the_batching_axis_sets_grouping_and_packing_and_names_the_row_length():
    candidates, _ = search_space(
        ["z0"], ["fp32"], [2, 4], [False], [None], global_batch=8, world_size=1,
        batchings=[("pad", None), ("group", None), ("pack", 1024), ("pack", None)],
    )  # fmt: skip
    names = [c.name for c in candidates]
    assert names == [
        "z0-fp32-mb2-pad", "z0-fp32-mb4-pad", "z0-fp32-mb2-group", "z0-fp32-mb4-group",
        "z0-fp32-mb2-pack1024", "z0-fp32-mb4-pack1024", "z0-fp32-mb2-pack", "z0-fp32-mb4-pack",
    ]  # fmt: skip
    pad, group, pack = candidates[0].overrides(8), candidates[2].overrides(8), candidates[4].overrides(8)
    assert "data.group_by_length=false" in pad and "data.packing=false" in pad
    assert "data.group_by_length=true" in group and "data.packing=false" in group
    assert "data.packing=true" in pack and "data.pack_length=1024" in pack and "data.group_by_length=false" in pack
    assert not any(o.startswith("data.pack_length") for o in candidates[6].overrides(8))  # the job's own
    # a group (memory grows with micro batch only) and a checkpointing twin keep the batching apart
    assert candidates[4].group != candidates[6].group != candidates[0].group
    assert candidates[4].twin_key != Candidate("z0", "fp32", 2, 4, False, None, "pack", 2048).twin_key
    # without the axis, a candidate leaves the job's data settings alone
    assert not any(o.startswith("data.") for o in Candidate("z0", "fp32", 2, 4, False).overrides(8))


def test_tuning_batching_drops_the_jobs_own_grouping_and_packing_and_row_length_only_when_tuned():
    given = ["data.group_by_length=true", "data.packing=false", "data.pack_length=512", "data.max_length=256"]
    assert base_overrides(given, tunes_attention=False) == given
    assert base_overrides(given, tunes_attention=False, tunes_batching=True) == given[2:]
    assert base_overrides(given, tunes_attention=False, tunes_batching=True, tunes_pack_length=True) == given[3:]


def test_the_kernels_axis_sets_model_kernels_and_keeps_its_candidates_apart():
    """tune.kernels: each candidate with torch's kernels and with liger's (model.kernels)."""
    candidates, _ = search_space(
        ["z0"], ["bf16"], [1, 2], [False], [None], global_batch=4, world_size=1, kernels=["torch", "liger"]
    )
    assert [c.name for c in candidates] == [
        "z0-bf16-mb1-torch", "z0-bf16-mb2-torch", "z0-bf16-mb1-liger", "z0-bf16-mb2-liger"
    ]  # fmt: skip
    assert "model.kernels=liger" in candidates[2].overrides(4) and "model.kernels=torch" in candidates[0].overrides(4)
    assert candidates[0].group != candidates[2].group and candidates[0].twin_key != candidates[2].twin_key
    assert not any(o.startswith("model.kernels") for o in Candidate("z0", "bf16", 1, 4, False).overrides(4))
    given = ["model.kernels=liger", "data.max_length=256"]
    assert base_overrides(given, tunes_attention=False) == given  # the job's own, when not tuned
    assert base_overrides(given, tunes_attention=False, tunes_kernels=True) == given[1:]
