"""bench/device_check.py in its CPU mode: the GPU check's steps and $OUT layout, run here end to end,
so that on a lent GPU machine only the device differs; and what a check stopped at any moment keeps."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

FILES = {"summary.md", "env.txt", "ops.txt", "pytest.txt", "presets.jsonl", "log.txt", "runs.tar.gz"}
# Steps of each tiny run (the check's default is 10): the fewest after which the built-in job's loss has
# clearly fallen below its first (5.82 -> 5.56). The first step's learning rate is 0 (warm-up), and the
# second and third steps' losses are within the batches' noise of it.
TRAIN_STEPS = 4
# One test of the GPU suite, ZeRO-3 (partitioned, the stage the others' ZeRO-0-2 runs share their path with):
# the pytest step's path (a pytest of its own, its verdicts written as they come) is the same for one test or
# all. The GPU suite's other tests run on this CPU in this suite itself (tests/gpu, skipping what only CUDA
# has); two more here cost ~25 s of a 2-core machine's time and no path.
GPU_SUITE_REHEARSED = "-m gpu -k z3-bf16"


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


def test_the_cpu_mode_runs_every_step_and_writes_its_seven_files(isolated_env, tmp_path):
    out = tmp_path / "out"
    result = check(
        out, "--train-steps", str(TRAIN_STEPS), "--pytest-args", GPU_SUITE_REHEARSED, env=isolated_env, timeout=900
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {path.name for path in out.iterdir()} == FILES  # the device tool brings back 8 files at most
    summary = (out / "summary.md").read_text()
    steps = steps_of(summary)
    assert list(steps) == ["install", "env", "train", "ops", "pytest", "presets"]  # the cheapest evidence first
    assert steps["install"].startswith("skipped in CPU mode")
    assert all(status.startswith("ok") for name, status in steps.items() if name != "install"), steps
    assert "cpu_adam: built" in (out / "ops.txt").read_text()
    assert "torch 2" in (out / "env.txt").read_text() and "deepspeed 0." in (out / "env.txt").read_text()
    train_rows = [line for line in summary.splitlines() if re.match(r"\| z\d-", line)]  # the tiny runs' table
    assert [row.split(" | ")[0] for row in train_rows] == ["| z0-bf16", "| z3-fp32-dpo-live"]
    cells = [row.split(" | ") for row in train_rows]
    assert all(row[1] == "ok" for row in cells), train_rows
    first, last = (float(value) for value in cells[0][2].split(" -> "))
    assert last < first, train_rows[0]
    assert cells[1][2].startswith("0.693 -> "), train_rows[1]  # DPO starts at log 2: the reference is the policy
    accuracy = train_rows[1].split(" | ")[3]  # the DPO row's held-out reward accuracy, evaluated at its end
    assert 0 <= float(accuracy) <= 1 and train_rows[0].split(" | ")[3] == ""
    # The GPU suite rehearsed in this process's way (in-process jobs): what a CPU can run of it passes.
    verdicts = [json.loads(line) for line in (out / "pytest.txt").read_text().splitlines()]
    ended = {v["test"].split("::")[-1]: v["outcome"] for v in verdicts if v["outcome"] != "started"}
    assert ended == {"test_every_zero_stage_trains_with_its_memory_metrics[z3-bf16]": "passed"}, ended
    assert "## GPU tests (1 passed)" in summary
    presets = [json.loads(line) for line in (out / "presets.jsonl").read_text().splitlines()]
    assert [row["preset"] for row in presets] == ["z0"]
    assert all(row["status"] == "ok" and row["samples_per_sec"] > 0 for row in presets), presets
    assert "| z0 |" in summary
    with tarfile.open(out / "runs.tar.gz") as archive:  # every run's small files, no weights
        names = archive.getnames()
    assert "train/z0-bf16/summary.json" in names and "train/z3-fp32-dpo-live/metrics.jsonl" in names
    assert not any("/model/" in name or "/checkpoints/" in name for name in names)


def test_a_step_past_the_deadline_is_stopped_and_what_finished_is_kept(isolated_env, tmp_path):
    """The deadline stops a long run; the rows written before it stay, and the check says what it stopped."""
    out = tmp_path / "out"
    result = check(
        out, "--only", "train", "--train-steps", "100000", "--deadline-s", "40", env=isolated_env, timeout=300
    )
    assert result.returncode == 1
    summary = (out / "summary.md").read_text()
    steps = steps_of(summary)
    assert steps["env"] == "ok" and steps["train"].startswith("FAILED"), steps
    assert "| z0-bf16 | stopped |" in summary
    assert "[stopped after" in (out / "log.txt").read_text()


# A stand-in for the GPU suite: one test of each ending, the last running until the check is stopped.
SUITE = """
import os
import time
from pathlib import Path


def test_passes():
    pass


def test_fails():  # as a test of `python train.py` fails: the run's output in the assertion's message
    output = "step 1/20 | loss 5.8\\nerror: rank 0: step 1: AttributeError: 'NoneType' object has no attribute 'view'"
    assert output.endswith("completed"), output


def test_hangs_past_its_time_limit():
    time.sleep(600)


def test_runs_when_the_check_is_stopped():
    Path(os.environ["SUITE_RUNNING"]).write_text("running")
    time.sleep(600)
"""


def test_a_check_stopped_mid_suite_keeps_every_verdict_and_names_the_running_test(isolated_env, tmp_path):
    """What the GPU check could not do: pytest prints names and tracebacks only at its end, and a suite cut at
    its limit came back as `F.........s...`. Each verdict is in pytest.txt the moment its test ends, a hang
    past the time limit is a named failure, and a stop (the device tool's call at its limit) names the test
    it caught running as stopped."""
    suite, out, running = tmp_path / "suite" / "test_stand_in.py", tmp_path / "out", tmp_path / "running"
    suite.parent.mkdir()
    suite.write_text(SUITE)
    args = ["--cpu", "--out", str(out), "--only", "pytest", "--pytest-args", str(suite), "--test-timeout", "3"]
    check = subprocess.Popen(
        [sys.executable, "bench/device_check.py", *args],
        cwd=ROOT,
        env={**isolated_env, "SUITE_RUNNING": str(running)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while not running.exists():  # the check reached the last test: stop it there, as a call's limit would
        assert check.poll() is None and time.time() < deadline, check.stdout.read() if check.stdout else ""
        time.sleep(0.1)
    check.send_signal(signal.SIGTERM)
    output, _ = check.communicate(timeout=120)
    assert check.returncode == 128 + signal.SIGTERM, output[-3000:]
    verdicts = {}
    for line in (out / "pytest.txt").read_text().splitlines():
        record = json.loads(line)
        verdicts[record["test"].split("::")[-1]] = record
    assert {name: record["outcome"] for name, record in verdicts.items()} == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_hangs_past_its_time_limit": "failed",
        "test_runs_when_the_check_is_stopped": "stopped",
    }
    assert "AttributeError: 'NoneType' object has no attribute 'view'" in verdicts["test_fails"]["run_error"]
    assert verdicts["test_fails"]["traceback"] and verdicts["test_passes"]["seconds"] >= 0
    assert "ran past --test-timeout=3 s" in verdicts["test_hangs_past_its_time_limit"]["error"]
    summary = (out / "summary.md").read_text()
    assert steps_of(summary)["pytest"] == "stopped: the check got SIGTERM"
    assert "## GPU tests (1 passed, 2 failed, 1 stopped)" in summary
    assert "| test_stand_in.py::test_runs_when_the_check_is_stopped | stopped |" in summary
