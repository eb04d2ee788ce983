"""launcher.tune.decide: what the tuner decides from plans and measurements (pure): predictions, pruning,
skipping, dominance, the loss check, the Pareto front and the pick, and what the measurements say of the
planner."""

from __future__ import annotations

import pytest

from launcher.tune import decide
from launcher.tune.decide import MiB, Result
from launcher.tune.space import Candidate


def result(
    preset="z0", micro=8, gc=False, precision="fp32", status="fits", rate=None, peak=None, planned=None, kernels=None,
    **kw,
):  # fmt: skip
    candidate = Candidate(preset, precision, micro, 32 // micro, gc, kernels=kernels)
    return Result(
        candidate,
        planned=None if planned is None else planned * MiB,
        status=status,
        tokens_per_s=rate,  # real tokens/s: what the tuner compares
        samples_per_s=None if rate is None else rate / 10,
        peak=None if peak is None else peak * MiB,
        **kw,
    )


# ----------------------------------------------------------------------------- pruning and skipping
def test_prediction_calibrates_the_plan_by_the_nearest_measured_candidate_of_its_group():
    measured = result(micro=4, peak=900, planned=400)
    predicted, basis = decide.predict(Candidate("z0", "fp32", 16, 2, False), 550 * MiB, [measured])
    assert predicted == 1050 * MiB and "z0-fp32-mb4" in basis
    # another group: the plan plus the median offset of what was measured
    others = [measured, result("z2", micro=4, peak=1000, planned=300), result("z3", peak=2000, planned=300)]
    predicted, basis = decide.predict(Candidate("z1", "fp32", 8, 4, False), 100 * MiB, others)
    assert predicted == (100 + 700) * MiB and "offset" in basis
    # nothing measured (or only bounds: a dominated candidate's peak): the plan alone
    assert decide.predict(Candidate("z1", "fp32", 8, 4, False), 100 * MiB, [result(status="dominated", peak=5)]) == (
        100 * MiB,
        "plan alone",
    )


def test_pruning_keeps_a_margin_and_follows_a_smaller_micro_batch_that_did_not_fit():
    budget = 1000 * MiB
    measured = [result(micro=4, peak=900, planned=400)]
    big = Candidate("z0", "fp32", 8, 4, False)
    assert decide.prune_reason(big, 550 * MiB, measured, budget, margin=0.1) is None  # 1050 <= 1100
    reason = decide.prune_reason(big, 700 * MiB, measured, budget, margin=0.1)  # 1200 > 1100
    assert reason and "predicted 1200 MiB" in reason and "tune.margin=0.1" in reason
    over = [result(micro=4, status="does not fit", peak=1200)]
    assert "did not fit" in decide.prune_reason(big, None, over, budget, margin=0.1)
    assert decide.prune_reason(Candidate("z0", "fp32", 2, 16, False), None, over, budget, margin=0.1) is None
    assert decide.prune_reason(Candidate("z3", "fp32", 8, 4, False), None, over, budget, margin=0.1) is None


def test_a_candidate_is_dominated_only_by_a_faster_one_that_used_no_more_memory():
    fast_small = result(rate=100.0, peak=500)
    assert decide.dominating(80.0, 600 * MiB, [fast_small], margin=0.1) is fast_small
    assert decide.dominating(80.0, 400 * MiB, [fast_small], margin=0.1) is None  # it may end below 500 MiB
    assert decide.dominating(95.0, 600 * MiB, [fast_small], margin=0.1) is None  # within the noise margin
    assert decide.dominating(80.0, 600 * MiB, [result(status="dominated", rate=200.0, peak=10)], margin=0.1) is None


@pytest.mark.parametrize(
    ("twin_status", "skipped"),
    [("fits", True), ("dominated", True), ("does not fit", False), ("pruned", False), ("failed", False)],
)
def test_checkpointing_is_skipped_only_where_its_twin_without_it_fits_or_lost_to_one_that_does(twin_status, skipped):
    checkpointed = Candidate("z2", "fp32", 8, 4, True)
    results = [result("z2", 8, gc=False, status=twin_status, rate=30.0, peak=900)]
    reason = decide.skip_reason(checkpointed, results)
    assert (reason is not None) == skipped
    if skipped:
        assert reason.startswith("z2-fp32-mb8 (no gradient checkpointing) ") and "recomputation" in reason
    # Only the exact twin counts: another micro batch, preset or precision says nothing of this one.
    others = [
        result("z2", 4, status="fits", rate=30.0, peak=900),
        result("z0", 8, status="fits", rate=30.0, peak=900),
        result("z2", 8, precision="bf16", status="fits", rate=30.0, peak=900),
    ]
    assert decide.skip_reason(checkpointed, others) is None
    # A candidate without checkpointing is never skipped this way.
    assert decide.skip_reason(Candidate("z2", "fp32", 8, 4, False), results) is None


# ----------------------------------------------------------------------------- checking, choosing
def test_first_losses_are_compared_with_the_reference_of_the_same_precision_and_micro_batch():
    ref = result(losses=[2.0, 1.9, 1.8])
    close = result("z3", losses=[2.0001, 1.9, 1.8])  # 5e-5 relative
    off = result("z2", losses=[2.0, 1.9, 1.81])  # 5.6e-3 at step 3
    other_micro = result("z1", micro=4, losses=[2.5, 2.4, 2.3])  # its own reference
    bf16_ref, bf16 = result(precision="bf16", losses=[2.0]), result("z3", precision="bf16", losses=[2.02])
    wrong = decide.loss_mismatches([ref, close, off, other_micro, bf16_ref, bf16], 1e-4, 2e-2)
    assert set(wrong) == {"z2-fp32-mb8"} and "step 3" in wrong["z2-fp32-mb8"]
    assert decide.loss_mismatches([ref, result("z2", losses=[float("nan")])], 1e-4, 2e-2)


def test_the_pick_is_the_fastest_that_fits_and_the_front_has_no_dominated_point():
    rows = [
        result("z0", rate=100.0, peak=900),
        result("z2", rate=90.0, peak=700),
        result("z3", rate=60.0, peak=800),  # slower and bigger than z2: off the front
        result("z1", rate=150.0, peak=2000, status="does not fit"),
        result("z2_offload", rate=120.0, peak=600, status="wrong"),
    ]
    assert decide.pick(rows).name == "z0-fp32-mb8"
    assert [r.name for r in decide.pareto_front(rows)] == ["z2-fp32-mb8", "z0-fp32-mb8"]
    assert decide.pick([result(status="does not fit", rate=5.0)]) is None
    ordered = [r.status for r in decide.ordered(rows)]
    assert ordered == ["fits", "fits", "fits", "wrong", "does not fit"]
    # a tie in speed: the one with less memory
    assert decide.pick([result("z0", rate=50.0, peak=900), result("z2", rate=50.0, peak=700)]).name == "z2-fp32-mb8"


# ----------------------------------------------------------------------------- the planner, checked
def test_the_planner_fit_recovers_ratios_per_component():
    rows = []
    for i, (states, acts, bufs) in enumerate([(100, 10, 5), (200, 40, 5), (100, 80, 20), (300, 20, 10), (50, 60, 30)]):
        r = result(micro=4 + i, peak=0)
        r.components = {"model states": states * MiB, "activations": acts * MiB, "step+buffers": bufs * MiB}
        r.planned = sum(r.components.values())
        r.peak = int((400 + 1.0 * states + 2.0 * acts + 0.5 * bufs) * MiB)
        rows.append(r)
    ratios, baseline = decide.planner_fit(rows)
    assert ratios == pytest.approx({"model states": 1.0, "activations": 2.0, "step+buffers": 0.5}, abs=1e-6)
    assert baseline == pytest.approx(400 * MiB, rel=1e-6)
    lines = decide.planner_lines(rows)
    assert "activations x2.00 (off > 10%)" in lines[0] and "model states x1.00," in lines[0]
    assert decide.planner_fit(rows[:2]) is None  # 2 candidates cannot tell a ratio from the baseline


def test_components_that_vary_together_are_fitted_together():
    """Model states and step buffers change only with the preset: fitted as one ratio."""
    rows = []
    for i, (states, acts) in enumerate([(100, 10), (100, 40), (300, 10), (300, 80), (200, 30)]):
        r = result(micro=4 + i, peak=0)
        r.components = {"model states": states * MiB, "activations": acts * MiB, "step+buffers": states // 10 * MiB}
        r.planned = sum(r.components.values())
        r.peak = int((400 + 1.5 * (states + states // 10) + 1.0 * acts) * MiB)
        rows.append(r)
    ratios, baseline = decide.planner_fit(rows)
    assert ratios == pytest.approx({"model states + step+buffers": 1.5, "activations": 1.0}, abs=1e-6)
    assert baseline == pytest.approx(400 * MiB, rel=1e-6)


def test_without_a_fit_each_candidate_is_held_against_its_plan():
    rows = [result(micro=4, peak=1000, planned=500), result(micro=8, peak=530, planned=500)]
    for r in rows:
        r.components = {"model states": r.planned}
    lines = decide.planner_lines(rows)
    assert lines[0].startswith("measured/planned per component: not separable")
    assert lines[1] == "planner off by more than 10% (measured / planned): z0-fp32-mb4 x2.00"
    assert decide.planner_lines(rows[1:])[1] == "every measured peak is within 10% of planned"


# ----------------------------------------------------------------------------- noise
def test_step_spread_is_the_range_of_the_steps_over_their_median():
    assert decide.step_spread([100.0, 110.0, 90.0]) == pytest.approx(0.2)
    assert decide.step_spread([100.0]) is None and decide.step_spread([0.0, 100.0]) is None


def test_the_contenders_are_the_fastest_that_fit():
    slow, fast, faster = result(micro=4, rate=10), result(micro=8, rate=30), result(micro=16, rate=50)
    out = result(micro=2, status="does not fit", rate=99)
    assert decide.contenders([slow, out, fast, faster], 2) == [faster, fast]
    # One measured while other processes loaded the machine may be the fastest in truth: measured again too.
    slow.others_cpu = 0.9
    assert decide.contenders([slow, out, fast, faster], 2) == [faster, fast, slow]
    assert decide.contenders([slow, out, fast, faster], 1) == [faster, slow]
    stopped = result(micro=1, status="dominated", rate=20, others_cpu=0.3)  # stopped during a burst
    assert decide.contenders([slow, fast, faster, stopped], 1) == [faster, stopped]  # the faster figure first
    assert decide.contenders([slow, fast, faster, stopped], 2) == [faster, fast, stopped, slow]


def test_a_candidate_stopped_as_dominated_in_a_burst_gets_its_first_whole_run_from_the_confirmation():
    stopped = result(status="dominated", rate=20, peak=800, others_cpu=0.3)
    stopped.note = "z0-fp32-mb16 is faster (90 > 20 real tokens/s after 1 steps) with no more memory"
    decide.merge_rerun(stopped, result(rate=120, peak=850))
    assert stopped.status == "fits" and stopped.runs == [120.0] and stopped.tokens_per_s == 120
    assert stopped.peak == 850 * MiB and stopped.note.startswith("measured again: its first run, stopped as")
    decide.merge_rerun(stopped, result(rate=110, peak=850))
    assert stopped.runs == [120.0, 110.0] and stopped.tokens_per_s == pytest.approx(115.0)


def test_a_rerun_makes_the_candidate_the_median_of_its_runs_and_keeps_the_larger_peak():
    first = result(rate=100, peak=900, runs=[100.0])
    decide.merge_rerun(first, result(rate=40, peak=950, others_cpu=0.6))
    assert first.runs == [100.0, 40.0] and first.tokens_per_s == pytest.approx(70.0)
    assert first.samples_per_s == pytest.approx(7.0)  # scaled as the tokens: the same records
    assert first.peak == 950 * MiB and first.others_cpu == 0.6 and first.status == "fits"
    decide.merge_rerun(first, result(rate=90, peak=900))
    assert first.tokens_per_s == pytest.approx(90.0)  # median of 100, 40, 90


def test_a_rerun_that_does_not_fit_makes_the_candidate_no_pick():
    first = result(rate=100, peak=900, runs=[100.0])
    over = result(status="does not fit", peak=1100)
    over.note = "a rank reached 1100 MiB > budget 1000 MiB in step 3"
    decide.merge_rerun(first, over)
    assert first.status == "does not fit" and first.note == f"in confirmation run 2: {over.note}"
    assert first.peak == 1100 * MiB and decide.pick([first]) is None


def test_the_noise_lines_say_whether_the_pick_stands_clear_and_name_a_busy_machine():
    best = result(micro=16, rate=100, runs=[100.0, 96.0, 104.0])
    rival = result(micro=8, rate=80, runs=[80.0, 85.0, 70.0])
    lines = decide.noise_lines([best, rival])
    assert lines[0] == "z0-fp32-mb16: 3 runs, real tokens/s 100, 96, 104; median 100"
    assert "the pick is clear: every run of z0-fp32-mb16 beat every run of z0-fp32-mb8" in lines
    rival.runs = [80.0, 99.0, 70.0]  # a run of the rival reached the pick's median (98)
    rival.others_cpu = 0.55
    best.runs = [100.0, 96.0, 98.0]
    lines = decide.noise_lines([best, rival])
    assert lines[2].startswith("the fastest, z0-fp32-mb16, is within the noise of z0-fp32-mb8 (a run of theirs")
    assert "kept z0-fp32-mb16, no simpler configuration among them" in lines[2]
    assert lines[-1].startswith("the machine was busy: other processes used up to 55% of its CPUs before 1 candidate")
    assert decide.noise_lines([result(rate=10, others_cpu=0.1)]) == []  # one run, a quiet machine: nothing to say


def test_where_the_runs_cannot_tell_the_fastest_from_another_the_simpler_is_picked():
    """Issue 44: a pick only where it beats the next by more than the runs' spread; else the simpler one."""
    offload = result(preset="z2_offload", rate=100, peak=500, runs=[100.0, 90.0, 104.0])
    plain = result(preset="z0", rate=95, peak=900, runs=[95.0, 101.0, 93.0])  # a run reached 100, its median
    slow = result(preset="z0", micro=4, rate=60, peak=700, runs=[60.0, 61.0, 59.0])
    assert decide.fastest([offload, plain, slow]) is offload
    assert decide.within_noise([offload, plain, slow]) == [plain]
    assert decide.pick([offload, plain, slow]) is plain  # no offload: simpler
    lines = decide.noise_lines([offload, plain, slow])
    assert any("picked z0-fp32-mb8, the simplest configuration among them" in line for line in lines)
    plain.runs = [95.0, 99.0, 93.0]  # none reached the fastest's median: it is clear
    assert decide.pick([offload, plain, slow]) is offload
    lines = decide.noise_lines([offload, plain, slow])  # the runs overlap (90 < 99), but none reached 100
    assert "the pick stands: no run of z0-fp32-mb8 (the next) reached z2_offload-fp32-mb8's median (100)" in lines[-1]
    single = result(preset="z2_offload", rate=100, peak=500)  # measured once: nothing to tell apart
    assert decide.pick([single, result(preset="z0", rate=99, peak=900)]) is single


def test_where_the_runs_cannot_tell_liger_from_torch_torchs_kernels_are_picked():
    liger = result(rate=100, runs=[100.0, 96.0, 104.0], kernels="liger")
    torch_kernels = result(rate=98, runs=[98.0, 101.0, 95.0], kernels="torch")
    assert decide.pick([liger, torch_kernels]) is torch_kernels
    torch_kernels.runs = [98.0, 99.0, 95.0]  # none reached liger's median: liger is clearly faster
    assert decide.pick([liger, torch_kernels]) is liger


def test_one_burst_slowed_run_of_the_fastest_does_not_tie_it_with_everyone_and_batch_size_is_no_simplicity():
    """The burst test (bench/tune_noise.py): the fastest's runs 25506, 4053, 25565 (one in a burst); the next
    ones never reach 25506, so it stays the pick; a smaller micro batch is not a simpler configuration."""
    best = result(micro=32, rate=25506, peak=900, runs=[25506.0, 4053.0, 25565.0])
    smaller = result(micro=16, rate=7009, peak=600, runs=[21752.0, 7009.0, 5620.0])
    zero2 = result(preset="z2", micro=32, rate=20555, peak=700, runs=[20555.0, 20660.0, 4297.0])
    assert decide.within_noise([best, smaller, zero2]) == [] and decide.pick([best, smaller, zero2]) is best
    smaller.runs = [26000.0, 7009.0, 5620.0]  # now within the noise, but no simpler: the faster stays
    assert decide.within_noise([best, smaller, zero2]) == [smaller] and decide.pick([best, smaller, zero2]) is best
