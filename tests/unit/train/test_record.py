"""launcher.train.record: where a step's metrics go on rank 0 (metrics.jsonl every step, W&B a row per
logger.log_every steps through launcher.tracking.history.HistoryWindow, the progress), and the run's
final table."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.tracking.history import HistoryWindow
from launcher.train.record import Progress, Recorder, final_table
from tests.helpers import read_metrics

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


# ----------------------------------------------------------------------------- rank 0's outputs
METRICS = {"train/loss": 2.0, "train/lr": 1e-3, "perf/samples_per_sec": 8.0}


def test_rank_zero_writes_every_step_and_the_other_ranks_nothing(tmp_path):
    (tmp_path / "main").mkdir()  # made by the launcher before any rank starts
    main = Recorder(RunDir(tmp_path / "main"), main=True, wandb=None, total=3, log_every=10, wandb_every=5)
    for step in (1, 2, 3):
        main.record(step, {**METRICS, "train/loss": math.nan if step == 2 else 2.0})
    main.flush()
    assert main.finish(Summary(status="completed"), exit_code=0) is None  # no W&B: no line naming it
    main.close()
    main.close()
    rows = read_metrics(tmp_path / "main")
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[1]["train/loss"] is None  # NaN as null

    (tmp_path / "other").mkdir()
    other = Recorder(RunDir(tmp_path / "other"), main=False, wandb=None, total=3, log_every=10, wandb_every=5)
    other.record(1, METRICS)
    other.close()
    assert list((tmp_path / "other").iterdir()) == []


def test_progress_off_a_terminal_is_a_line_at_the_first_every_kth_and_last_step(caplog):
    progress = Progress(True, total=7, log_every=3)
    assert progress.bar is None  # pytest's stderr is no terminal
    with caplog.at_level(logging.INFO, logger="launcher"):
        for step in range(1, 8):
            progress.update(step, METRICS)
    lines = [record.getMessage() for record in caplog.records if record.name == "launcher"]
    assert [line.split(" |")[0] for line in lines] == ["step 1/7", "step 3/7", "step 6/7", "step 7/7"]
    assert lines[0] == "step 1/7 | loss 2.0000 | 8.0 samples/s | lr 1.00e-03"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="launcher"):
        Progress(False, total=7, log_every=3).update(1, METRICS)  # another rank: nothing
    assert caplog.records == []


def test_progress_off_a_terminal_says_the_time_left_and_speaks_at_least_every_minute(caplog):
    """A 6-minute silence between `step 1/100` and `step 100/100` (issue 44): a line at least every 60 s, each
    with the time left at the pace since the first step (whose start-up would skew it)."""
    now = [0.0]
    progress = Progress(True, total=100, log_every=100, every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="launcher"):
        progress.update(1, METRICS)  # the end of the first step, however long its start-up took
        for step in range(2, 101):
            now[0] = 7.0 * (step - 1)  # 7 s a step
            progress.update(step, METRICS)
    lines = [record.getMessage() for record in caplog.records if record.name == "launcher"]
    assert [int(line.split(" |")[0].split()[1].split("/")[0]) for line in lines] == [1, *range(10, 100, 9), 100]
    assert lines[0].endswith("lr 1.00e-03") and lines[-1].endswith("lr 1.00e-03")  # no pace yet / nothing left
    assert lines[1].endswith("lr 1.00e-03 | about 10 min left")  # 90 steps of 7 s
    assert lines[-2].endswith("| about 63 s left")


def test_the_final_table_says_how_the_run_ended_and_where_its_files_are(tmp_path):
    run_dir = RunDir(tmp_path)
    summary = Summary(status="completed", steps=20, wall_s=12.34, final_loss=1.23456, eval_loss=1.5, eval_accuracy=0.25)
    summary.samples_per_sec, summary.peak_memory_bytes = 10.25, 300 * 2**20
    summary.tokens_per_sec, summary.padding_frac, summary.mfu = 1234.5, 0.25, 0.0123
    table = final_table(summary, run_dir, "offline run abc: upload with `wandb sync x`")
    assert table.splitlines() == [
        "",
        "run summary: completed, 20 steps in 12.3 s",
        "  loss     1.2346 (held-out 1.5000, exact match 0.250)",
        "  speed    10.2 samples/s, peak memory 300 MiB",
        "  work     1,234 real tokens/s, 25% padding, MFU 1.2%",
        f"  run dir  {tmp_path} (train.log, summary.json, metrics.jsonl)",
        f"  model    {tmp_path / 'model'}",
        "  W&B      offline run abc: upload with `wandb sync x`",
    ]
    stopped = final_table(Summary(status="preempted", steps=3, wall_s=1.0), run_dir, None)
    assert "run summary: preempted, 3 steps in 1.0 s" in stopped and "model" not in stopped and "W&B" not in stopped
    assert "  loss     -\n" in stopped and "peak memory -" in stopped and "work" not in stopped
    summary.planned_memory_bytes = 1234 * 2**20  # the planner's figure stands beside a GPU's measured peak
    assert "peak memory 300 MiB\n" in final_table(summary, run_dir, None)  # a CPU's: its RSS, Python included
    summary.memory = {"peak_allocated_bytes": 280 * 2**20}
    assert "  speed    10.2 samples/s, peak memory 300 MiB (planned 1,234 MiB)" in final_table(summary, run_dir, None)


# ----------------------------------------------------------------------------- through a run
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


@pytest.mark.slow
def test_a_run_logs_every_step_locally_and_window_means_to_wandb(train_in_process, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("WANDB_DIR", str(run_dir))
    ran = train_in_process(
        "train.max_steps=12",
        "logger=wandb",
        "logger.log_every=5",
        "train.micro_batch_size=8",
        "train.eval_every=0",
        "data.eval_accuracy=false",
        "train.seed=1",
        run_dir=run_dir,
    )
    assert ran.outcome.status == "completed", ran.outcome.error
    lines = read_metrics(run_dir)
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
