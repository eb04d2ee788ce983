"""The autotuner (launcher.tune): its decisions as pure functions, its bad input, and one real tuning.

The end-to-end test runs `python -m launcher.tune` on the built-in tiny model: real candidates (train.py's
own code, DeepSpeed, ranks as child processes), one forced over the memory budget and one forced to
crash (the fault hook, set for that candidate only), W&B offline read back with W&B's own CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.schema import DeepSpeedPreset
from launcher.plan.memory import PRESETS
from launcher.tune import tuner as tune
from launcher.tune.tuner import Candidate, Result, Tuning

MiB = 2**20


def result(preset="z0", micro=8, gc=False, precision="fp32", status="fits", rate=None, peak=None, planned=None, **kw):
    candidate = Candidate(preset, precision, micro, 32 // micro, gc)
    return Result(
        candidate,
        planned=None if planned is None else planned * MiB,
        status=status,
        samples_per_s=rate,
        peak=None if peak is None else peak * MiB,
        **kw,
    )


# ----------------------------------------------------------------------------- the space
def test_the_schema_lists_every_preset_the_planner_knows():
    assert [p.value for p in DeepSpeedPreset] == list(PRESETS)


def test_micro_batch_sizes_keep_the_global_batch_and_the_rest_is_said():
    candidates, left_out = tune.search_space(
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


def test_a_candidate_names_every_choice_it_makes():
    c = Candidate("z2_offload", "bf16", 4, 8, True, "sdpa")
    assert c.name == "z2_offload-bf16-mb4-gc-sdpa"
    line = c.overrides(64)
    assert line[:3] == ["deepspeed=z2_offload", "precision=bf16", "train.micro_batch_size=4"]
    assert "train.global_batch_size=64" in line and "train.grad_accum=null" in line
    assert "model.gradient_checkpointing=true" in line and "model.attn_implementation=sdpa" in line
    assert "model.attn_implementation=sdpa" not in Candidate("z0", "fp32", 4, 8, False).overrides(64)


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
    assert tune.base_overrides(given, tunes_attention=False) == [
        "model.hidden_size=512",
        "model.attn_implementation=eager",
        "data=llava_json",
    ]
    assert "model.attn_implementation=eager" not in tune.base_overrides(given, tunes_attention=True)


# ----------------------------------------------------------------------------- pruning and skipping
def test_prediction_calibrates_the_plan_by_the_nearest_measured_candidate_of_its_group():
    measured = result(micro=4, peak=900, planned=400)
    predicted, basis = tune.predict(Candidate("z0", "fp32", 16, 2, False), 550 * MiB, [measured])
    assert predicted == 1050 * MiB and "z0-fp32-mb4" in basis
    # another group: the plan plus the median offset of what was measured
    others = [measured, result("z2", micro=4, peak=1000, planned=300), result("z3", peak=2000, planned=300)]
    predicted, basis = tune.predict(Candidate("z1", "fp32", 8, 4, False), 100 * MiB, others)
    assert predicted == (100 + 700) * MiB and "offset" in basis
    # nothing measured (or only bounds: a dominated candidate's peak): the plan alone
    assert tune.predict(Candidate("z1", "fp32", 8, 4, False), 100 * MiB, [result(status="dominated", peak=5)]) == (
        100 * MiB,
        "plan alone",
    )


def test_pruning_keeps_a_margin_and_follows_a_smaller_micro_batch_that_did_not_fit():
    budget = 1000 * MiB
    measured = [result(micro=4, peak=900, planned=400)]
    big = Candidate("z0", "fp32", 8, 4, False)
    assert tune.prune_reason(big, 550 * MiB, measured, budget, margin=0.1) is None  # 1050 <= 1100
    reason = tune.prune_reason(big, 700 * MiB, measured, budget, margin=0.1)  # 1200 > 1100
    assert reason and "predicted 1200 MiB" in reason and "tune.margin=0.1" in reason
    over = [result(micro=4, status="does not fit", peak=1200)]
    assert "did not fit" in tune.prune_reason(big, None, over, budget, margin=0.1)
    assert tune.prune_reason(Candidate("z0", "fp32", 2, 16, False), None, over, budget, margin=0.1) is None
    assert tune.prune_reason(Candidate("z3", "fp32", 8, 4, False), None, over, budget, margin=0.1) is None


def test_a_candidate_is_dominated_only_by_a_faster_one_that_used_no_more_memory():
    fast_small = result(rate=100.0, peak=500)
    assert tune.dominating(80.0, 600 * MiB, [fast_small], margin=0.1) is fast_small
    assert tune.dominating(80.0, 400 * MiB, [fast_small], margin=0.1) is None  # it may end below 500 MiB
    assert tune.dominating(95.0, 600 * MiB, [fast_small], margin=0.1) is None  # within the noise margin
    assert tune.dominating(80.0, 600 * MiB, [result(status="dominated", rate=200.0, peak=10)], margin=0.1) is None


@pytest.mark.parametrize(
    ("twin_status", "skipped"),
    [("fits", True), ("dominated", True), ("does not fit", False), ("pruned", False), ("failed", False)],
)
def test_checkpointing_is_skipped_only_where_its_twin_without_it_fits_or_lost_to_one_that_does(twin_status, skipped):
    checkpointed = Candidate("z2", "fp32", 8, 4, True)
    results = [result("z2", 8, gc=False, status=twin_status, rate=30.0, peak=900)]
    reason = tune.skip_reason(checkpointed, results)
    assert (reason is not None) == skipped
    if skipped:
        assert reason.startswith("z2-fp32-mb8 (no gradient checkpointing) ") and "recomputation" in reason
    # Only the exact twin counts: another micro batch, preset or precision says nothing of this one.
    others = [
        result("z2", 4, status="fits", rate=30.0, peak=900),
        result("z0", 8, status="fits", rate=30.0, peak=900),
        result("z2", 8, precision="bf16", status="fits", rate=30.0, peak=900),
    ]
    assert tune.skip_reason(checkpointed, others) is None
    # A candidate without checkpointing is never skipped this way.
    assert tune.skip_reason(Candidate("z2", "fp32", 8, 4, False), results) is None


# ----------------------------------------------------------------------------- checking, choosing
def test_first_losses_are_compared_with_the_reference_of_the_same_precision_and_micro_batch():
    ref = result(losses=[2.0, 1.9, 1.8])
    close = result("z3", losses=[2.0001, 1.9, 1.8])  # 5e-5 relative
    off = result("z2", losses=[2.0, 1.9, 1.81])  # 5.6e-3 at step 3
    other_micro = result("z1", micro=4, losses=[2.5, 2.4, 2.3])  # its own reference
    bf16_ref, bf16 = result(precision="bf16", losses=[2.0]), result("z3", precision="bf16", losses=[2.02])
    wrong = tune.loss_mismatches([ref, close, off, other_micro, bf16_ref, bf16], 1e-4, 2e-2)
    assert set(wrong) == {"z2-fp32-mb8"} and "step 3" in wrong["z2-fp32-mb8"]
    assert tune.loss_mismatches([ref, result("z2", losses=[float("nan")])], 1e-4, 2e-2)


def test_the_pick_is_the_fastest_that_fits_and_the_front_has_no_dominated_point():
    rows = [
        result("z0", rate=100.0, peak=900),
        result("z2", rate=90.0, peak=700),
        result("z3", rate=60.0, peak=800),  # slower and bigger than z2: off the front
        result("z1", rate=150.0, peak=2000, status="does not fit"),
        result("z2_offload", rate=120.0, peak=600, status="wrong"),
    ]
    assert tune.pick(rows).name == "z0-fp32-mb8"
    assert [r.name for r in tune.pareto_front(rows)] == ["z2-fp32-mb8", "z0-fp32-mb8"]
    assert tune.pick([result(status="does not fit", rate=5.0)]) is None
    ordered = [r.status for r in tune.ordered(rows)]
    assert ordered == ["fits", "fits", "fits", "wrong", "does not fit"]


def test_the_planner_fit_recovers_ratios_per_component():
    rows = []
    for i, (states, acts, bufs) in enumerate([(100, 10, 5), (200, 40, 5), (100, 80, 20), (300, 20, 10), (50, 60, 30)]):
        r = result(micro=4 + i, peak=0)
        r.components = {"model states": states * MiB, "activations": acts * MiB, "step+buffers": bufs * MiB}
        r.planned = sum(r.components.values())
        r.peak = int((400 + 1.0 * states + 2.0 * acts + 0.5 * bufs) * MiB)
        rows.append(r)
    ratios, baseline = tune.planner_fit(rows)
    assert ratios == pytest.approx({"model states": 1.0, "activations": 2.0, "step+buffers": 0.5}, abs=1e-6)
    assert baseline == pytest.approx(400 * MiB, rel=1e-6)
    lines = tune.planner_lines(rows)
    assert "activations x2.00 (off > 10%)" in lines[0] and "model states x1.00," in lines[0]
    assert tune.planner_fit(rows[:2]) is None  # 2 candidates cannot tell a ratio from the baseline


def test_components_that_vary_together_are_fitted_together():
    """Model states and step buffers change only with the preset: fitted as one ratio."""
    rows = []
    for i, (states, acts) in enumerate([(100, 10), (100, 40), (300, 10), (300, 80), (200, 30)]):
        r = result(micro=4 + i, peak=0)
        r.components = {"model states": states * MiB, "activations": acts * MiB, "step+buffers": states // 10 * MiB}
        r.planned = sum(r.components.values())
        r.peak = int((400 + 1.5 * (states + states // 10) + 1.0 * acts) * MiB)
        rows.append(r)
    ratios, baseline = tune.planner_fit(rows)
    assert ratios == pytest.approx({"model states + step+buffers": 1.5, "activations": 1.0}, abs=1e-6)
    assert baseline == pytest.approx(400 * MiB, rel=1e-6)


def test_throughput_leaves_the_warm_up_steps_out():
    records = [
        {"step": 1, "perf/step_time_s": 5.0, "perf/tokens_per_sec": 10.0},
        {"step": 2, "perf/step_time_s": 1.0, "perf/tokens_per_sec": 300.0},
        {"step": 3, "perf/step_time_s": 3.0, "perf/tokens_per_sec": 100.0},
    ]
    samples, tokens, steps = tune.measure(records, warmup=1, global_batch=8)
    assert (samples, tokens, steps) == (pytest.approx(16 / 4), pytest.approx(600 / 4), 2)
    assert tune.measure(records[:1], warmup=1, global_batch=8) is None


def test_best_yaml_holds_the_job_and_the_candidate(tmp_path):
    base = ["model.hidden_size=128", "data=llava_json", "data.path=/d/x.json", "deepspeed_json=/d/ds.json"]
    t = Tuning(tmp_path, base, 32, 2, 2**30, "test")
    best = result("z2", micro=4, gc=True, rate=10.0, peak=100)
    text = tune.best_yaml(t, best)
    assert text.startswith("# @package _global_\n")
    assert "  - override /data: llava_json\n  - override /deepspeed: z2\n  - override /precision: fp32" in text
    assert "hidden_size: 128" in text and "micro_batch_size: 4" in text and "grad_accum: null" in text
    assert "gradient_checkpointing: true" in text and "path: /d/x.json" in text
    assert "deepspeed_json: /d/ds.json" in text and "override /deepspeed_json" not in text  # a value, not a group


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tune.measure_steps=0"], "tune.measure_steps=0 must be 1 or more"),
        (["tune.memory_gb=-1"], "tune.memory_gb=-1.0 must be positive"),
        (["tune.skip_margin=-0.1"], "tune.skip_margin=-0.1 must be positive"),
        (["tune.micro_batch_sizes=[5]", "train.micro_batch_size=4", "train.global_batch_size=8"], "no candidate"),
        (["tune.presets=[z9]"], "tune.presets"),
    ],
)
def test_bad_tune_settings_are_one_line(args, message, isolated_env, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "launcher.tune", "logger=none", f"tune.dir={tmp_path / 'tune'}", *args],
        capture_output=True,
        text=True,
        env=isolated_env,
        timeout=300,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode in (1, 2) and len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "tune" / "tune.md").exists()


# ----------------------------------------------------------------------------- a real tuning
def _inspect(run: Path, env: dict[str, str], *, summary: bool) -> dict:
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", *(["--summary"] if summary else []), "--json", str(run)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    if summary:
        return json.loads(out.stdout)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return next(r for r in records if r.get("type") == "run")["run"]


@pytest.mark.slow
def test_a_tuning_goes_on_past_a_candidate_over_budget_and_one_that_crashes(isolated_env, tmp_path):
    directory = tmp_path / "tune"
    env = {
        **isolated_env,
        # z2-fp32-mb8 holds 3000 MiB more from step 1 (over the 2.5 GiB budget); z2-fp32-mb4 crashes in step 2.
        tune.CANDIDATE_ENV: "z2-fp32-mb8:LAUNCHER_TEST_FAULT=0:1:alloc=3000;z2-fp32-mb4:LAUNCHER_TEST_FAULT=0:2",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "launcher.tune",
            "train.micro_batch_size=8",
            "train.global_batch_size=16",
            "tune.presets=[z0,z2]",
            "tune.precisions=[fp32]",
            "tune.micro_batch_sizes=[4,8]",
            "tune.gradient_checkpointing=[false]",
            "tune.memory_gb=2.5",
            "tune.early_skip=false",
            f"tune.dir={directory}",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["candidate"]: row for row in _csv(directory / "tune.csv")}
    assert {name: row["status"] for name, row in rows.items()} == {
        "z0-fp32-mb4": "fits",
        "z0-fp32-mb8": "fits",
        "z2-fp32-mb4": "failed",
        "z2-fp32-mb8": "does not fit",
    }
    assert "fault injected by LAUNCHER_TEST_FAULT on rank 0 at step 2" in rows["z2-fp32-mb4"]["note"]
    assert "> budget 2560 MiB" in rows["z2-fp32-mb8"]["note"]
    assert float(rows["z2-fp32-mb8"]["peak_mib"]) > 2560
    for name in ("z0-fp32-mb4", "z0-fp32-mb8"):
        assert float(rows[name]["samples_per_s"]) > 0 and int(rows[name]["measured_steps"]) == 4
        assert 300 < float(rows[name]["peak_mib"]) < 2560 and float(rows[name]["planned_mib"]) > 0
    # the same data order and seed: the two micro batch sizes see the same first batch (equal-length records)
    assert float(rows["z0-fp32-mb4"]["first_loss"]) == pytest.approx(float(rows["z0-fp32-mb8"]["first_loss"]), rel=1e-4)
    best = max(("z0-fp32-mb4", "z0-fp32-mb8"), key=lambda n: float(rows[n]["samples_per_s"]))
    report = (directory / "tune.md").read_text()
    assert f"**Pick: {best}**" in report and "best.yaml: verified" in report
    assert (directory / "tune.png").stat().st_size > 0 and not list(directory.glob("runs/*/model"))
    # best.yaml, composed by train.py itself, writes the candidate's DeepSpeed dict
    check = tmp_path / "check"
    again = subprocess.run(
        [sys.executable, "train.py", f"hydra.searchpath=[file://{directory}]", "experiment=best", "dry_run=true",
         f"hydra.run.dir={check}"],
        cwd=tune.ROOT, capture_output=True, text=True, env=isolated_env, timeout=300,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    planned = {r["name"]: r for r in json.loads((directory / "results.json").read_text())}[best]["ds_config"]
    assert json.loads((check / "ds_config.json").read_text()) == planned
    # W&B: one run per candidate in one group, and the report run with the table
    runs = {p.parent.parent.name: p for p in (directory / "wandb_runs").glob("*/wandb/offline-run-*")}
    assert set(runs) == {*rows, "report"}
    groups = {_inspect(path, isolated_env, summary=False)["run_group"] for path in runs.values()}
    assert len(groups) == 1 and groups.pop().startswith("tune-")
    assert _inspect(runs["z2-fp32-mb8"], isolated_env, summary=True)["summary"]["status"] == "does not fit"
    report_summary = _inspect(runs["report"], isolated_env, summary=True)["summary"]
    assert report_summary["pick"] == best and "tune/candidates" in report_summary


def _csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_the_ranks_are_told_from_their_launchers_and_their_dataloader_workers():
    rank = ["/v/bin/python", "-u", "-m", "launcher.launch.worker", "/runs/a"]
    agent = [
        "/v/bin/python",
        "-m",
        "launcher.launch.torchrun",
        "--nproc-per-node=2",
        "-m",
        "launcher.launch.worker",
        "/runs/a",
    ]
    assert tune._runs_module(rank, "launcher.launch.worker")
    assert not tune._runs_module(agent, "launcher.launch.worker")
    assert not tune._runs_module(["python", "train.py", "-m"], "launcher.launch.worker")
