"""Where a step's metrics go, on rank 0: metrics.jsonl (every step), W&B (a row per logger.log_every steps),
the progress on the terminal; and the run's one summary at the end."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any

from launcher.core.rundir import MetricsWriter, RunDir
from launcher.core.summary import Summary
from launcher.tracking.history import HistoryWindow
from launcher.tracking.wandb_run import WandbRun

log = logging.getLogger("launcher")


class Recorder:
    """Rank 0's outputs of a run (the other ranks' recorder keeps nothing and shows nothing)."""

    def __init__(
        self, run_dir: RunDir, *, main: bool, wandb: WandbRun | None, total: int, log_every: int, wandb_every: int
    ) -> None:
        self.run_dir = run_dir
        self.wandb = wandb
        # Opened after a resume truncated metrics.jsonl to its checkpoint's step.
        self.metrics: MetricsWriter | None = run_dir.metrics_writer() if main else None
        self.history = HistoryWindow(wandb_every) if wandb is not None else None
        self.progress = Progress(main, total, log_every)

    def record(self, step: int, metrics: dict[str, float]) -> None:
        if self.metrics is not None:
            self.metrics.write({"step": step, **metrics})
        if self.history is not None and (row := self.history.add(step, metrics)) is not None:
            self.wandb.log(row, step=step)
        self.progress.update(step, metrics)

    def flush(self) -> None:
        """W&B's row of the steps since its last one (a run that ends between rows)."""
        if self.history is not None and (row := self.history.flush()) is not None:
            self.wandb.log(row, step=self.history.step)

    def finish(self, summary: Summary, *, exit_code: int, hint: bool = False) -> str | None:
        """Flush and finish the W&B run with the summary's figures; the line naming it (None without W&B).

        `hint`: W&B's own line saying how to upload an offline run (a completed run's final table names it)."""
        if self.wandb is None:
            return None
        with contextlib.suppress(Exception):
            self.flush()
        self.wandb.finish(summary.to_json(), exit_code=exit_code, hint=hint)
        return self.wandb.describe()

    def close(self) -> None:
        self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None


class Progress:
    """A progress bar on a terminal; plain periodic log lines otherwise (CI, SLURM logs): at the first and last
    step, every `log_every` steps, and at least every `every_s` seconds, each after the first with the time
    left at the pace of the steps since the first (whose start-up work would skew it)."""

    def __init__(
        self, enabled: bool, total: int, log_every: int, *, every_s: float = 60.0, clock: Any = time.monotonic
    ) -> None:
        self.log_every = log_every
        self.total = total
        self.bar = None
        self.enabled = enabled
        self.every_s, self.clock = every_s, clock
        self.first: tuple[int, float] | None = None  # (step, time) of the first step seen
        self.last_line = 0.0
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        text = f"loss {metrics['train/loss']:.4f} | {metrics['perf/samples_per_sec']:.1f} samples/s"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)  # update() redraws, at most every 0.1 s
            self.bar.update(1)
            return
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        due = step % self.log_every == 0 or step in (1, self.total) or now - self.last_line >= self.every_s
        if due:
            self.last_line = now
            log.info("step %d/%d | %s | lr %.2e%s", step, self.total, text, metrics["train/lr"], self._left(step, now))

    def _left(self, step: int, now: float) -> str:
        """' | about 3 min left' from the pace since the first step seen; '' before a pace or at the end."""
        first_step, first_time = self.first or (step, now)
        if step <= first_step or step >= self.total:
            return ""
        left = (now - first_time) / (step - first_step) * (self.total - step)
        return f" | about {_duration(left)} left"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def final_table(summary: Summary, run_dir: RunDir, wandb_line: str | None) -> str:
    """The run's one summary for the terminal: how it ended, its figures, where its files are."""

    def figure(value: float | None, digits: int = 4) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    loss = figure(summary.final_loss)
    if summary.eval_loss is not None:
        held_out = f"held-out {figure(summary.eval_loss)}"
        if summary.eval_accuracy is not None:
            held_out += f", exact match {figure(summary.eval_accuracy, 3)}"
        if summary.eval_rewards_accuracy is not None:
            held_out += f", reward accuracy {figure(summary.eval_rewards_accuracy, 3)}"
        loss += f" ({held_out})"
    rows = [
        ("loss", loss),
        ("speed", f"{figure(summary.samples_per_sec, 1)} samples/s, peak memory {_peak(summary)}"),
        *_useful(summary),
        ("run dir", f"{run_dir.path} (train.log, summary.json, metrics.jsonl)"),
    ]
    if summary.status == "completed":
        rows.append(("model", str(run_dir.model)))
    if wandb_line:
        rows.append(("W&B", wandb_line))
    width = max(len(name) for name, _ in rows)
    title = f"run summary: {summary.status}, {summary.steps} steps in {summary.wall_s:.1f} s"
    return "\n".join(["", title, *(f"  {name:<{width}}  {value}" for name, value in rows)])


def _useful(summary: Summary) -> list[tuple[str, str]]:
    """The useful-work line: real tokens/s, the padding share, MFU (when the run measured them)."""
    if summary.tokens_per_sec is None or summary.padding_frac is None:
        return []
    text = f"{summary.tokens_per_sec:,.0f} real tokens/s, {summary.padding_frac:.0%} padding"
    if summary.mfu is not None:
        text += f", MFU {summary.mfu:.1%}"
    return [("work", text)]


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def _peak(summary: Summary) -> str:
    """The measured peak, and the planner's figure for the job where it made one and the two compare: on a
    GPU (a CPU's peak is the process's RSS, Python and its libraries included)."""
    on_gpu = "peak_allocated_bytes" in (summary.memory or {})
    if summary.planned_memory_bytes is None or not on_gpu:
        return _mib(summary.peak_memory_bytes)
    return f"{_mib(summary.peak_memory_bytes)} (planned {_mib(summary.planned_memory_bytes)})"
