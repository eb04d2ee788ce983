"""launcher.tracking.history: which steps W&B's history gets (a row at step 1, every `every` steps, on
evaluation steps and at the end), each the mean of its steps' per-step figures."""

from __future__ import annotations

import pytest

from launcher.tracking.history import HistoryWindow


def test_rows_come_at_step_1_every_n_steps_on_evaluation_steps_and_when_flushed():
    window = HistoryWindow(every=3)
    logged = {}
    for step in range(1, 9):
        metrics = {"train/loss": float(step), "train/lr": step / 10}
        if step == 5:
            metrics["eval/loss"] = 0.5
        row = window.add(step, metrics)
        if row is not None:
            logged[window.step] = row
    assert sorted(logged) == [1, 3, 5, 6]
    assert logged[3]["train/loss"] == pytest.approx(2.5)  # the mean of steps 2 and 3
    assert logged[3]["train/lr"] == 0.3  # the latest, not the mean
    assert logged[5]["eval/loss"] == 0.5 and logged[5]["train/loss"] == pytest.approx(4.5)
    last = window.flush()  # steps 7 and 8
    assert window.step == 8 and last["train/loss"] == pytest.approx(7.5)
    assert window.flush() is None  # nothing since


def test_per_step_figures_are_averaged_and_the_rest_keeps_its_latest_value():
    window = HistoryWindow(every=2)
    window.add(1, {"step_only": 1})
    window.add(2, {"perf/step_time_s": 1.0, "train/grad_norm": 2.0, "mem/peak_bytes": 10, "perf/note": "a"})
    window.add(3, {"perf/step_time_s": 3.0, "mem/peak_bytes": 20, "perf/note": "b"})
    row = window.add(4, {"perf/step_time_s": 5.0, "train/grad_norm": 4.0, "mem/peak_bytes": 15})
    assert row == {"perf/step_time_s": 4.0, "mem/peak_bytes": 15, "perf/note": "b", "train/grad_norm": 4.0}


def test_every_is_at_least_one():
    window = HistoryWindow(every=0)
    assert window.every == 1
    assert window.add(1, {"train/loss": 1.0}) == {"train/loss": 1.0}
    assert window.add(2, {"train/loss": 2.0}) == {"train/loss": 2.0}
