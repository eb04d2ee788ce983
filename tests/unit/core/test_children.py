"""launcher.core.children: a child process that dies with its parent (ranks, DataLoader workers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.helpers import ROOT

PARENT = """
import subprocess, sys, time
from launcher.core.children import die_with_parent
preexec = die_with_parent if sys.argv[1] == "bound" else None
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=preexec)
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("bound", [True, False])
def test_a_child_dies_when_its_parent_is_killed(bound):
    """What a launcher killed by SIGKILL (or the out-of-memory killer) leaves: no rank, when they are bound."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "bound" if bound else "free"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        _, alive = psutil.wait_procs([child], timeout=10 if bound else 1)
        assert (alive == []) == bound
    finally:
        if child.is_running():
            child.kill()
