"""A pytest plugin that says where the suite's CPU goes: each test's wall seconds, and the CPU seconds of the
process that ran it and of the processes it started (`--durations` gives wall only, and on a 2-core machine
the suite is CPU-bound: a test's wall says little of what it costs the other worker).

    python -m pytest -q -n 2 -p tests.cpu_times --cpu-times /tmp/cpu_times.jsonl
    python -m tests.cpu_times /tmp/cpu_times.jsonl          # the table: per file, then the costliest tests

One JSON object per test, appended as it ends, by the process that ran it (each xdist worker):

    {"test": ID, "worker": "gw0", "start": UNIX_S, "wall_s": S, "self_cpu_s": S, "children_cpu_s": S}

`children_cpu_s` counts the processes the test started and waited for, their own children included (a
`python train.py`, its torchrun and ranks): what the kernel adds to RUSAGE_CHILDREN when they are reaped.
A process left running past its test is counted by whichever test is running when it is reaped, if any.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cpu_times", "each test's wall and CPU seconds (tests/cpu_times.py)")
    group.addoption("--cpu-times", type=Path, help="append each test's wall and CPU seconds to this file (JSON lines)")


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = item.config.getoption("cpu_times")
    if path is None:
        yield
        return
    start, (own, children) = time.time(), _cpu()
    yield
    wall, (own_after, children_after) = time.time() - start, _cpu()
    record = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "start": round(start, 3),
        "wall_s": round(wall, 3),
        "self_cpu_s": round(own_after - own, 3),
        "children_cpu_s": round(children_after - children, 3),
    }
    with open(path, "a") as handle:  # one short line per write: appends from two workers do not interleave
        handle.write(json.dumps(record) + "\n")


def table(records: list[dict[str, Any]], top: int = 30) -> str:
    """Totals, then per test file and per test, the costliest in CPU first."""
    cpu = {id(r): r["self_cpu_s"] + r["children_cpu_s"] for r in records}
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for record in records:
        row = files[record["test"].split("::")[0]]
        row[0] += record["wall_s"]
        row[1] += record["self_cpu_s"]
        row[2] += record["children_cpu_s"]
        row[3] += 1
    lines = [
        f"{len(records)} tests: wall {sum(r['wall_s'] for r in records):,.0f} s, CPU {sum(cpu.values()):,.0f} s "
        f"({sum(r['children_cpu_s'] for r in records):,.0f} s of it in the processes they started)",
        "",
        "| file | tests | wall s | own CPU s | children CPU s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (wall, own, children, count) in sorted(files.items(), key=lambda kv: -(kv[1][1] + kv[1][2]))[:top]:
        lines.append(f"| {name} | {count} | {wall:,.0f} | {own:,.0f} | {children:,.0f} |")
    lines += ["", "| test | wall s | own CPU s | children CPU s |", "|---|---:|---:|---:|"]
    for record in sorted(records, key=lambda r: -cpu[id(r)])[:top]:
        lines.append(
            f"| {record['test']} | {record['wall_s']:,.1f} | {record['self_cpu_s']:,.1f} | "
            f"{record['children_cpu_s']:,.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(table([json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]))
