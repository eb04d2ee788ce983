"""A per-step watchdog: a rank whose train step outlives `dist.step_timeout_s` ends itself, with its stacks.

Under ZeRO-3, ranks that disagree on what to run (one skips a collective the others entered) block
forever in gloo/nccl; the collectives' own timeout (dist.timeout_s) is half an hour, and what it then
reports does not say where each rank was. The watchdog fires much sooner, while the main thread is
still blocked: it writes every thread's Python stack to `errors/rank<R>_stacks.txt`, records the
rank's one-line error (which the launcher shows), and ends the process with `os._exit`, because a
thread stuck in a collective cannot be unwound by an exception.

It also keeps `errors/rank<R>.in_step` holding the step in flight (blank between steps), so that
when a rank dies by a signal, recording nothing, the launcher can still name the step.

    watchdog = StepWatchdog(run_dir, rank, cfg.dist.step_timeout_s)
    with watchdog.step(step):
        metrics = train_step(session, step)
    watchdog.close()
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from launcher.core.errors import TrainingFailed
from launcher.core.rank_errors import record_rank_error
from launcher.core.rundir import RunDir


class StepWatchdog:
    """Ends this rank when one step runs longer than `timeout_s` seconds (0 or None: never, no thread).

    One daemon thread wakes every `poll_s` (a quarter of the timeout, at most 1 s) and ends the rank
    when the armed step is past its deadline; it runs whether the main thread is blocked in C (a
    collective, a socket, `time.sleep`: they release the GIL) or busy in Python (the interpreter hands
    the GIL over every switch interval). Arming and disarming are plain assignments: waking the thread
    at every step instead cost a thread switch per step, measurable on a small model's step.
    """

    def __init__(
        self, run_dir: Path, rank: int, timeout_s: float | None, *, launch: str | None = None, announce: bool = False
    ) -> None:
        self.run_dir, self.rank, self.launch = RunDir(Path(run_dir)), rank, launch
        # Print the line too: under SLURM each task is its own launcher, and none is left to read errors/.
        self.announce = announce
        self.timeout_s = float(timeout_s or 0)
        self.poll_s = min(1.0, self.timeout_s / 4)
        self._armed: tuple[int, float] | None = None  # (step, monotonic deadline) while a step runs
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._in_step = self.run_dir.in_step(rank)
        self._in_step.parent.mkdir(parents=True, exist_ok=True)
        self._in_step_fd: int | None = os.open(self._in_step, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._mark(None)
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Watch the body as step `step`; disarmed when it ends, by returning or by raising."""
        self._mark(step)
        self._armed = (step, time.monotonic() + self.timeout_s)  # one assignment: the thread reads it
        try:
            yield
        finally:
            self._armed = None
            self._mark(None)

    def _mark(self, step: int | None) -> None:
        """Write the step in flight into this rank's file: one write in place, no new file (cheap per step)."""
        if self._in_step_fd is not None:
            os.pwrite(self._in_step_fd, f"{'' if step is None else step:<20}\n".encode(), 0)

    def close(self) -> None:
        """Stop the thread and remove the step file (a no-op when already closed)."""
        if self._in_step_fd is not None:
            os.close(self._in_step_fd)
            self._in_step_fd = None
            self._in_step.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # only when empty: a run that failed keeps its records
                self._in_step.parent.rmdir()
        if self._thread is None:
            return
        self._closed.set()
        self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            armed = self._armed
            # The step had run past its deadline when read: end the rank even if it finishes meanwhile.
            if armed is not None and time.monotonic() >= armed[1]:
                self._end_rank(armed[0])

    def _end_rank(self, step: int) -> None:
        """Record the hang (stacks, one line for the launcher) and end the process; never returns."""
        code = TrainingFailed.exit_code
        try:
            stacks = self.run_dir.rank_stacks(self.rank)
            stacks.parent.mkdir(parents=True, exist_ok=True)
            with stacks.open("w") as out:
                faulthandler.dump_traceback(out, all_threads=True)
            message = (
                f"step {step} did not finish within dist.step_timeout_s={self.timeout_s:g} s "
                f"(ranks stuck waiting for each other: a hang); this rank's Python stacks are in {stacks}; "
                "raise dist.step_timeout_s if steps are legitimately this slow"
            )
            record_rank_error(self.run_dir, self.rank, message, code, stacks.read_text(), launch=self.launch)
            if self.announce:
                print(f"error: rank {self.rank}: {message}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)  # even when the records could not be written (a full disk): a hung rank must end
