"""Which steps W&B's history gets: a row every `logger.log_every` steps, each the mean of its steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class HistoryWindow:
    """Which steps W&B's history gets, and what: a row at step 1, every `every` steps, on evaluation
    steps and when flushed at the end. Each row holds the mean over the steps since the previous row
    of the per-step quantities (loss, gradient norm, throughput, step time, CPU time) and the latest
    value of the rest (learning rate, peak memory, cumulative counts). metrics.jsonl keeps every step.

    Why not every step: one W&B log call cost ~1 ms of a rank's CPU (under cProfile) and more in W&B's
    service process, several % of a small model's step (BENCHMARKS.md, launcher overhead); the mean
    over the window also shows the trend with less noise, as the HF Trainer's logging_steps does."""

    MEAN_PREFIXES = ("train/loss", "train/grad_norm", "perf/")

    def __init__(self, every: int) -> None:
        self.every = max(1, int(every))
        self.step: int | None = None  # the step a row logged now is logged at
        self._rows: list[Mapping[str, Any]] = []

    def add(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any] | None:
        """Take one step's metrics; the row to log at this step, or None."""
        self._rows.append(metrics)
        self.step = step
        if step == 1 or step % self.every == 0 or any(key.startswith("eval/") for key in metrics):
            return self.flush()
        return None

    def flush(self) -> dict[str, Any] | None:
        """The row of the steps taken since the last row (None when there are none)."""
        rows, self._rows = self._rows, []
        if not rows:
            return None
        keys = dict.fromkeys(key for row in rows for key in row)
        merged: dict[str, Any] = {}
        for key in keys:
            values = [row[key] for row in rows if key in row]
            mean = key.startswith(self.MEAN_PREFIXES) and all(isinstance(v, int | float) for v in values)
            merged[key] = sum(values) / len(values) if mean else values[-1]
        return merged
