"""A per-step watchdog: a rank whose train step outlives `dist.step_timeout_s` ends itself, with its stacks.

Under ZeRO-3, ranks that disagree on what to run (one skips a collective the others entered) block
forever in gloo/nccl; the collectives' own timeout (dist.timeout_s) is half an hour, and what it then
reports does not say where each rank was. The watchdog fires much sooner, while the main thread is
still blocked: it writes every thread's Python stack to `errors/rank<R>_stacks.txt`, records the
rank's one-line error (which the launcher shows), and ends the process with `os._exit`, because a
thread stuck in a collective cannot be unwound by an exception.

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

from launcher.errors import ERRORS_DIR, LauncherError, TrainingFailed, record_rank_error


class StepWatchdog:
    """Ends this rank when one step runs longer than `timeout_s` seconds (0 or None: never, no thread).

    One daemon thread sleeps on a condition until the armed step's deadline; it runs whether the main
    thread is blocked in C (a collective, a socket, `time.sleep`: they release the GIL) or busy in
    Python (the interpreter hands the GIL over every switch interval).
    """

    def __init__(
        self, run_dir: Path, rank: int, timeout_s: float | None, *, launch: str | None = None, announce: bool = False
    ) -> None:
        if timeout_s is not None and timeout_s < 0:
            raise LauncherError(
                f"dist.step_timeout_s={timeout_s} must be a number of seconds, or 0/null to turn the watchdog off"
            )
        self.run_dir, self.rank, self.launch = Path(run_dir), rank, launch
        # Print the line too: under SLURM each task is its own launcher, and none is left to read errors/.
        self.announce = announce
        self.timeout_s = float(timeout_s or 0)
        self._condition = threading.Condition()
        self._armed: tuple[int, float] | None = None  # (step, monotonic deadline) while a step runs
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Watch the body as step `step`; disarmed when it ends, by returning or by raising."""
        if self._thread is None:
            yield
            return
        with self._condition:
            self._armed = (step, time.monotonic() + self.timeout_s)
            self._condition.notify()
        try:
            yield
        finally:
            with self._condition:
                self._armed = None  # the thread wakes at the old deadline, finds nothing armed, sleeps on

    def close(self) -> None:
        """Stop the thread (a no-op when there is none, or when already closed)."""
        if self._thread is None:
            return
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        with self._condition:
            while not self._closed:
                if self._armed is None:
                    self._condition.wait()
                    continue
                step, deadline = self._armed
                left = deadline - time.monotonic()
                if left > 0:
                    self._condition.wait(left)
                else:
                    self._end_rank(step)  # under the lock: the main thread cannot start another step meanwhile

    def _end_rank(self, step: int) -> None:
        """Record the hang (stacks, one line for the launcher) and end the process; never returns."""
        code = TrainingFailed.exit_code
        try:
            stacks = self.run_dir / ERRORS_DIR / f"rank{self.rank}_stacks.txt"
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
