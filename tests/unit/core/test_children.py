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


# An entry point's end as the module sees it: an atexit handler, a thread still writing, Python's and C's
# buffered output into a pipe, and a module-level object whose finalizer only the interpreter's teardown runs.
ENDING = """
import atexit, contextlib, ctypes, sys, threading, time
from pathlib import Path
from launcher.core.children import exit_without_teardown

out, how, wrap = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "wrapped"

class Torn:
    def __del__(self):
        print("torn down", file=sys.stderr, flush=True)

kept = Torn()
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
print("buffered", end="")
ctypes.CDLL(None).printf(b"from C")

def end():
    if how == "code":
        sys.exit(3)
    if how == "message":
        sys.exit("a message")

with exit_without_teardown() if wrap else contextlib.nullcontext():
    end()
"""


@pytest.mark.parametrize(("how", "status"), [("return", 0), ("code", 3), ("message", 1)])
@pytest.mark.parametrize("wrapped", [True, False])
def test_an_entry_point_ends_as_python_would_but_without_the_teardown(tmp_path, how, status, wrapped):
    """launcher.core.children.exit_without_teardown, around train.py's, a rank's and the commands' bodies: the
    same exit status, output, atexit handlers and waited-for threads as Python's own exit; only the
    interpreter's teardown (here a module global's finalizer; in a rank ~1.6 CPU s, bench/process_end.py)
    is left out."""
    done = subprocess.run(
        [sys.executable, "-c", ENDING, str(tmp_path), how, "wrapped" if wrapped else "plain"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == status
    assert done.stdout == "bufferedfrom C"  # Python's buffer and C's, both flushed into the pipe
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"  # the exit waited for the thread, as Python's does
    said = done.stderr.splitlines()
    assert ("a message" in said) == (how == "message")
    assert ("torn down" in said) == (not wrapped)
