"""tests/cpu_times.py: each test's CPU, its own and that of the processes it started, as a suite run writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.cpu_times import table
from tests.helpers import ROOT

SUITE = """
import subprocess
import sys


def test_starts_a_process_that_computes():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(10_000_000))"], check=True)


def test_computes_nothing():
    pass
"""


def test_each_test_has_its_own_and_its_processes_cpu(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    out = tmp_path / "times.jsonl"
    # A pytest of its own: none of this run's PYTEST_* (its options, xdist's worker name).
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.cpu_times"]
    command += [f"--cpu-times={out}", f"--rootdir={tmp_path}", "test_suite.py"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {record["test"]: record for record in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {f"test_suite.py::{name}" for name in ("test_starts_a_process_that_computes",
                                                                   "test_computes_nothing")}, records  # fmt: skip
    computes = records["test_suite.py::test_starts_a_process_that_computes"]
    idle = records["test_suite.py::test_computes_nothing"]
    assert computes["children_cpu_s"] > 0.2 and computes["wall_s"] > computes["self_cpu_s"], computes
    assert idle["children_cpu_s"] == 0 and idle["worker"] == "main", idle
    said = table(list(records.values()))
    assert said.startswith("2 tests: wall ") and "| test_suite.py | 2 |" in said
    # The costliest test first.
    tests = [line for line in said.splitlines() if line.startswith("| test_suite.py::")]
    assert tests[0].startswith("| test_suite.py::test_starts_a_process_that_computes |"), said
