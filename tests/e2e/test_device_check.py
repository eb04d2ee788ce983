"""bench/device_check.py in its CPU mode: the GPU check's steps and $OUT layout, run here end to end,
so that on a lent GPU machine only the device differs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

FILES = {"summary.md", "env.txt", "ops.txt", "pytest.txt", "train.md", "presets.md", "presets.jsonl", "log.txt"}
# Steps of each tiny run (the check's default is 10): the fewest after which the built-in job's loss has
# clearly fallen below its first (5.82 -> 5.56). The first step's learning rate is 0 (warm-up), and the
# second and third steps' losses are within the batches' noise of it.
TRAIN_STEPS = 4


def check(out, *args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "bench/device_check.py", "--cpu", "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def steps_of(summary: str) -> dict[str, str]:
    rows = [line.split(" | ") for line in summary.splitlines() if line.startswith("| ") and line.count("|") == 4]
    return {cells[0].strip("| "): cells[1] for cells in rows[1:]}


def test_the_cpu_mode_runs_every_step_and_writes_the_eight_files(isolated_env, tmp_path):
    out = tmp_path / "out"
    result = check(out, "--train-steps", str(TRAIN_STEPS), env=isolated_env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {path.name for path in out.iterdir()} == FILES  # the device tool brings back 8 files at most
    steps = steps_of((out / "summary.md").read_text())
    assert list(steps) == ["install", "env", "ops", "pytest", "train", "presets"]
    assert steps["install"].startswith("skipped in CPU mode")
    assert all(status.startswith("ok") for name, status in steps.items() if name != "install"), steps
    assert "cpu_adam: built" in (out / "ops.txt").read_text()
    assert "torch 2" in (out / "env.txt").read_text() and "deepspeed 0." in (out / "env.txt").read_text()
    train_rows = [line for line in (out / "train.md").read_text().splitlines() if line.startswith("| z")]
    assert [row.split(" | ")[0] for row in train_rows] == ["| z0-bf16", "| z3-fp32"]
    for row in train_rows:
        cells = row.split(" | ")
        first, last = (float(value) for value in cells[2].split(" -> "))
        assert cells[1] == "ok" and last < first, row
    presets = [json.loads(line) for line in (out / "presets.jsonl").read_text().splitlines()]
    assert [row["preset"] for row in presets] == ["z0"]
    assert all(row["status"] == "ok" and row["samples_per_sec"] > 0 for row in presets), presets
    assert "| z0 |" in (out / "presets.md").read_text()


def test_a_step_past_the_deadline_is_stopped_and_what_finished_is_kept(isolated_env, tmp_path):
    """The deadline stops a long run; the rows written before it stay, and the check says what it stopped."""
    out = tmp_path / "out"
    result = check(
        out, "--only", "train", "--train-steps", "100000", "--deadline-s", "40", env=isolated_env, timeout=300
    )
    assert result.returncode == 1
    steps = steps_of((out / "summary.md").read_text())
    assert steps["env"] == "ok" and steps["train"].startswith("FAILED"), steps
    train = (out / "train.md").read_text()
    assert "| z0-bf16 | stopped |" in train
    assert "[stopped after" in (out / "log.txt").read_text()
