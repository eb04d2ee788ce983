"""Multirun sweeps, `python train.py -m ...`, end to end: the comparison at the end, W&B offline runs
read back with W&B's own CLI, a failed job recorded while the sweep goes on (and the sweep's exit code),
Optuna's objective, and the joblib launcher. Two steps per job: enough for every figure compared."""

from __future__ import annotations

import json

import pytest

from tests.e2e.wandb_inspect import inspect_run_record, inspect_summary

pytestmark = pytest.mark.slow

STEPS = 2
SHORT = [f"train.max_steps={STEPS}", "train.eval_every=0", "data.eval_samples=8", "train.seed=2"]


def read(path) -> dict:
    return json.loads(path.read_text())


def test_a_sweep_in_parallel_processes_ends_with_its_comparison_and_comparable_wandb_runs(
    run_train, isolated_env, tmp_path
):
    """Two jobs at once (Hydra's joblib launcher, one process each), each a W&B run of the sweep's group."""
    sweep_dir = tmp_path / "sweep"
    result = run_train(
        "-m",
        "deepspeed=z0,z3",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        *SHORT,
        f"hydra.sweep.dir={sweep_dir}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The terminal ends with the comparison: a row per job, named by what differs, then where it is written.
    out = result.stdout.splitlines()
    assert out[-1] == f"comparison: {sweep_dir / 'compare.md'} (+ compare.csv, compare.png)"
    header = next(i for i, line in enumerate(out) if line.startswith("run ") and out[i + 1].startswith("---"))
    assert out[header].split()[:4] == ["run", "deepspeed", "zero", "status"]
    rows = sorted(line.split()[:5] for line in out[header + 2 : header + 4])
    assert rows == [
        ["deepspeed=z0", "z0", "stage0", "completed", str(STEPS)],
        ["deepspeed=z3", "z3", "stage3", "completed", str(STEPS)],
    ]
    groups = set()
    for job, stage in (("0", 0), ("1", 3)):
        run_dir = sweep_dir / job
        summary = read(run_dir / "summary.json")
        assert summary["zero_stage"] == stage
        (offline_run,) = (run_dir / "wandb").glob("offline-run-*")
        inspected = inspect_summary(offline_run, isolated_env)
        record = inspect_run_record(offline_run, isolated_env)
        groups.add(record["run_group"])
        assert record["job_type"] == "train"
        assert f"zero=stage{stage}" in inspected["tags"]
        assert f"deepspeed=z{stage}" in inspected["tags"]
        assert inspected["config"]["deepspeed"]["zero_optimization"]["stage"] == stage
        for key in ("final_loss", "eval_loss", "samples_per_sec", "tokens_per_sec", "peak_memory_bytes", "steps"):
            assert inspected["summary"][key] == pytest.approx(summary[key]), key
        assert inspected["summary"]["status"] == "completed"
    assert len(groups) == 1  # both jobs of the sweep share one W&B group
    report = (sweep_dir / "compare.md").read_text()
    assert "z0" in report and "z3" in report
    assert (sweep_dir / "compare.png").stat().st_size > 0 and (sweep_dir / "compare.csv").is_file()


def test_an_invalid_job_fails_and_the_sweep_goes_on(run_train, tmp_path):
    """... and a credential given to the sweep reaches neither its output (Hydra's "#0 : ..." lines) nor
    any file (Hydra's multirun.yaml, each job's .hydra/)."""
    sweep_dir = tmp_path / "sweep"
    secret = "sk-" + "s" * 30
    comet = ["+deepspeed_extra.comet.enabled=false", f"+deepspeed_extra.comet.api_key={secret}"]
    result = run_train(
        "-m", "offload=none,param", "zero=stage2", "logger=none", *SHORT, *comet, f"hydra.sweep.dir={sweep_dir}",
        timeout=900,
    )  # fmt: skip
    assert secret not in result.stdout + result.stderr and "comet.api_key=<redacted>" in result.stdout
    leaks = [p for p in sweep_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaks and (sweep_dir / "multirun.yaml").is_file()
    assert result.returncode == 1  # launcher.compare.sweep.failed_sweep_line, asked once Hydra is done
    assert "Traceback" not in result.stderr
    ok = read(sweep_dir / "0" / "summary.json")
    failed = read(sweep_dir / "1" / "summary.json")
    assert ok["status"] == "completed"
    assert failed["status"] == "failed" and "needs ZeRO stage 3" in failed["error"]
    report = (sweep_dir / "compare.md").read_text()
    assert "failed" in report and "needs ZeRO stage 3" in report
    assert "error: 1 job(s) of the sweep failed (job 1; errors above)" in result.stderr.splitlines()
    (failed_line,) = [line for line in result.stdout.splitlines() if line.startswith("offload=param failed: ")]
    assert "needs ZeRO stage 3" in failed_line  # under the table, named by what differs


def test_optuna_learning_rate_search_uses_the_objective(run_train, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_train(
        "-m",
        "experiment=lr_search",
        "hydra.sweeper.n_trials=2",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=8",
        "logger=none",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = (sweep_dir / "optimization_results.yaml").read_text()
    eval_losses = [read(sweep_dir / job / "summary.json")["eval_loss"] for job in ("0", "1")]
    assert f"best_value: {min(eval_losses)}" in best
