"""Multirun sweeps end to end: W&B offline runs read back with W&B's own CLI, failures recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SHORT = ["train.max_steps=6", "train.eval_every=0", "data.eval_samples=8", "train.seed=2"]


def inspect_summary(run: Path, env: dict[str, str]) -> dict:
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--summary", "--json", str(run)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def inspect_run_record(run: Path, env: dict[str, str]) -> dict:
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    )
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return next(r for r in records if r.get("type") == "run")["run"]


def test_two_job_sweep_logs_comparable_wandb_runs(run_train, isolated_env, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_train("-m", "deepspeed=z0,z3", *SHORT, f"hydra.sweep.dir={sweep_dir}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    # The terminal ends with the comparison: a row per job, named by what differs, then where it is written.
    out = result.stdout.splitlines()
    assert out[-1] == f"comparison: {sweep_dir / 'compare.md'} (+ compare.csv, compare.png)"
    header = next(i for i, line in enumerate(out) if line.startswith("run ") and out[i + 1].startswith("---"))
    assert out[header].split()[:4] == ["run", "deepspeed", "zero", "status"]
    rows = sorted(line.split()[:5] for line in out[header + 2 : header + 4])
    assert rows == [
        ["deepspeed=z0", "z0", "stage0", "completed", "6"],
        ["deepspeed=z3", "z3", "stage3", "completed", "6"],
    ]
    groups = set()
    for job, stage in (("0", 0), ("1", 3)):
        run_dir = sweep_dir / job
        summary = json.loads((run_dir / "summary.json").read_text())
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
    sweep_dir = tmp_path / "sweep"
    result = run_train(
        "-m", "offload=none,param", "zero=stage2", "logger=none", *SHORT, f"hydra.sweep.dir={sweep_dir}", timeout=900
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    ok = json.loads((sweep_dir / "0" / "summary.json").read_text())
    failed = json.loads((sweep_dir / "1" / "summary.json").read_text())
    assert ok["status"] == "completed"
    assert failed["status"] == "failed" and "needs ZeRO stage 3" in failed["error"]
    report = (sweep_dir / "compare.md").read_text()
    assert "failed" in report and "needs ZeRO stage 3" in report
    assert "1 job(s) of the sweep failed" in result.stderr
    (failed_line,) = [line for line in result.stdout.splitlines() if line.startswith("offload=param failed: ")]
    assert "needs ZeRO stage 3" in failed_line  # under the table, named by what differs


def test_optuna_learning_rate_search_uses_the_objective(run_train, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_train(
        "-m",
        "experiment=lr_search",
        "hydra.sweeper.n_trials=2",
        "train.max_steps=5",
        "train.micro_batch_size=8",
        "logger=none",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    best = (sweep_dir / "optimization_results.yaml").read_text()
    eval_losses = [json.loads((sweep_dir / job / "summary.json").read_text())["eval_loss"] for job in ("0", "1")]
    assert f"best_value: {min(eval_losses)}" in best


def test_joblib_launcher_runs_jobs_in_parallel_processes(run_train, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = run_train(
        "-m",
        "deepspeed=z0,z2",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "train.max_steps=5",
        "train.micro_batch_size=8",
        "data.eval_accuracy=false",
        "logger=none",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stages = [json.loads((sweep_dir / job / "summary.json").read_text())["zero_stage"] for job in ("0", "1")]
    assert stages == [0, 2]
    assert (sweep_dir / "compare.md").is_file()
