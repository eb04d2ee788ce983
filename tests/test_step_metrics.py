"""What a training step records: every step in metrics.jsonl, a W&B row per logger.log_every steps,
CPU time per step, and DeepSpeed's own gradient norm at ZeRO 0 in fp32."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.tracking.wandb_run import HistoryWindow

WANDB_CLI = Path(sys.executable).parent / "wandb"


# ----------------------------------------------------------------------------- which steps W&B gets
def test_rows_come_at_step_one_every_k_steps_and_on_evaluation_steps():
    window = HistoryWindow(every=5)
    logged = []
    for step in range(1, 13):
        metrics = {"train/loss": float(step), "train/lr": step / 100}
        if step == 7:
            metrics["eval/loss"] = 0.5
        if (row := window.add(step, metrics)) is not None:
            logged.append((step, row))
    final = window.flush()
    assert [step for step, _ in logged] == [1, 5, 7, 10]
    rows = dict(logged)
    assert rows[1] == {"train/loss": 1.0, "train/lr": 0.01}
    assert rows[5]["train/loss"] == pytest.approx((2 + 3 + 4 + 5) / 4)  # the mean of the window's steps
    assert rows[5]["train/lr"] == 0.05  # the latest value, not a mean
    assert rows[7] == {"train/loss": 6.5, "train/lr": 0.07, "eval/loss": 0.5}
    assert rows[10]["train/loss"] == pytest.approx(9.0)
    assert window.step == 12 and final == {"train/loss": 11.5, "train/lr": 0.12}
    assert window.flush() is None  # nothing left


def test_every_step_when_log_every_is_one_and_means_only_of_per_step_quantities():
    window = HistoryWindow(every=1)
    assert window.add(1, {"perf/step_time_s": 0.1}) == {"perf/step_time_s": 0.1}
    assert window.add(2, {"perf/step_time_s": 0.3}) == {"perf/step_time_s": 0.3}
    window = HistoryWindow(every=3)
    window.add(1, {})
    window.add(2, {"train/grad_norm": 1.0, "mem/peak_bytes": 10, "data/samples_a": 4})
    row = window.add(3, {"train/grad_norm": 3.0, "mem/peak_bytes": 12, "data/samples_a": 8})
    assert row == {"train/grad_norm": 2.0, "mem/peak_bytes": 12, "data/samples_a": 8}
    nan_window = HistoryWindow(every=2)
    nan_window.add(1, {})
    nan_window.add(2, {"train/grad_norm": math.nan})
    assert math.isnan(nan_window.flush() or math.nan)  # a NaN window mean stays NaN (no crash)


# ----------------------------------------------------------------------------- through train.py
def _history(run_dir: Path) -> list[dict]:
    (sync_dir,) = (run_dir / "wandb").glob("offline-run-*")
    out = subprocess.run(
        [str(WANDB_CLI), "leet", "inspect", "--json", str(sync_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [record["history"]["item"] for record in records if record["type"] == "history"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


QUICK = ["train.micro_batch_size=8", "train.eval_every=0", "data.eval_accuracy=false", "train.seed=1"]


@pytest.mark.slow
def test_a_run_logs_every_step_locally_and_window_means_to_wandb(run_train, tmp_path):
    run_dir = tmp_path / "run"
    done = run_train(f"hydra.run.dir={run_dir}", "train.max_steps=12", "logger=wandb", "logger.log_every=5", *QUICK)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _metrics(run_dir)
    assert [line["step"] for line in lines] == list(range(1, 13))
    for line in lines:  # each rank's CPU per loop iteration: the whole process, and its main thread
        assert 0 < line["perf/step_main_thread_cpu_s"] <= line["perf/step_cpu_s"] * 1.01
    history = _history(run_dir)
    steps = [int(row["trainer/step"]) for row in history if "train/loss" in row]
    assert steps == [1, 5, 10, 12]  # the last with the final evaluation
    by_step = {int(row["trainer/step"]): row for row in history if "train/loss" in row}
    window = [line["train/loss"] for line in lines[1:5]]
    assert float(by_step[5]["train/loss"]) == pytest.approx(sum(window) / len(window), rel=1e-9)
    assert float(by_step[12]["train/lr"]) == pytest.approx(lines[-1]["train/lr"])
    assert "eval/loss" in by_step[12]


@pytest.mark.slow
def test_zero0_fp32_grad_norm_is_the_one_deepspeed_clipped_by(run_train, tmp_path):
    """With clipping on, train/grad_norm is what DeepSpeed's clipping computed (kept, not recomputed);
    without clipping the launcher computes it. Step 1 is before any update: the two must agree."""
    norms = {}
    for clip in ("1.0", "0"):
        run_dir = tmp_path / f"clip{clip}"
        done = run_train(
            f"hydra.run.dir={run_dir}", "train.max_steps=2", "logger=none", f"train.grad_clip={clip}", *QUICK
        )
        assert done.returncode == 0, done.stderr[-3000:]
        norms[clip] = [line["train/grad_norm"] for line in _metrics(run_dir)]
    assert all(norm is not None and norm > 0 for norm in norms["1.0"] + norms["0"])
    assert norms["1.0"][0] == pytest.approx(norms["0"][0], rel=1e-6)
