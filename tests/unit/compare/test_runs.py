"""launcher.compare.runs: the runs a comparison reads, from run directories on disk (tests/unit/compare/
sweeps.py writes them as a job does) or from W&B's public API (stand-ins for its run objects: the API needs
a server), and how they are sorted and named."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.compare import runs
from launcher.compare.render import write_outputs
from launcher.compare.runs import RunRow
from tests.unit.compare.sweeps import BY_THROUGHPUT, ERROR, GIB, NAMES, write_run


def test_load_runs_reads_jobs_in_numeric_order(sweep: Path) -> None:
    rows = runs.load_runs([sweep])
    assert [r.name for r in rows] == ["0", "1", "2", "3", "10"]
    by_name = {r.name: r for r in rows}
    assert by_name["0"].settings["zero"] == "stage2"
    assert "hydra/launcher" not in by_name["0"].settings
    assert "hydra.run.dir" not in by_name["0"].settings
    assert by_name["2"].status == "failed" and by_name["2"].error == ERROR
    assert by_name["0"].source == str(sweep / "0") and by_name["0"].eval_accuracy == 0.5


def test_incomplete_run_is_read_from_metrics_and_hydra_yaml(sweep: Path) -> None:
    (row,) = runs.load_runs([sweep / "3"])
    assert row.status == "incomplete"
    assert row.steps == 5  # the truncated last line is skipped
    assert row.samples_per_sec == 20.0
    assert row.peak_memory_bytes == 2 * GIB
    assert row.final_loss == pytest.approx(2.2 / 5**0.5)
    assert len(row.curve) == 5
    assert row.settings["precision"] == "fp32" and "deepspeed" not in row.settings


def test_a_completed_runs_summary_is_final_and_a_failed_runs_last_metrics_show_how_far_it_got(tmp_path):
    metrics = [{"step": 1, "train/loss": 3.0, "eval/loss": 2.5}, {"step": 2, "train/loss": float("nan")}]
    done = write_run(tmp_path / "done", overrides=[], summary={"eval_loss": None, "final_loss": 1.0}, metrics=metrics)
    failure = {"status": "failed", "error": "a\nb", "steps": None}
    failed = write_run(tmp_path / "failed", overrides=[], summary=failure, metrics=metrics)
    done_row, failed_row = runs.load_runs([done, failed])
    assert done_row.eval_loss is None and done_row.final_loss == 1.0  # null: not defined, not "look it up"
    assert failed_row.eval_loss == 2.5 and failed_row.steps == 2 and failed_row.error == "a"
    assert failed_row.final_loss is None  # NaN is no number to show
    assert failed_row.curve == [(1, 3.0)]


def test_the_metrics_file_keeps_the_last_of_each_and_the_largest_peak(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "mem/peak_bytes": 5, "train/loss": 2.0}, {"step": 2, "mem/peak_bytes": 3}, [1, 2], "x"]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    last, curve = runs.read_metrics(path)
    assert last == {"step": 2, "mem/peak_bytes": 5, "train/loss": 2.0} and curve == [(1, 2.0)]
    assert runs.read_metrics(tmp_path / "missing.jsonl") == ({}, [])


def test_sorted_by_throughput_with_failed_last(sweep: Path) -> None:
    rows = runs.sort_rows(runs.load_runs([sweep]))
    assert [r.name for r in rows] == BY_THROUGHPUT


def test_runs_without_throughput_come_after_those_with_it() -> None:
    rows = [
        RunRow(name="a", source="a", status="completed"),
        RunRow(name="b", source="b", status="failed", samples_per_sec=99.0),
        RunRow(name="c", source="c", status="completed", samples_per_sec=1.0),
    ]
    assert [r.name for r in runs.sort_rows(rows)] == ["c", "a", "b"]


def test_only_differing_choices_become_columns(sweep: Path) -> None:
    rows = runs.load_runs([sweep])
    assert runs.differing_keys(rows) == ["zero", "offload", "precision"]
    names = runs.run_names(runs.sort_rows(rows), runs.differing_keys(rows))
    assert names == [NAMES[job] for job in BY_THROUGHPUT]


def _row(name: str, **settings: str) -> RunRow:
    return RunRow(name=name, source=name, status="completed", settings=settings)


def test_runs_are_named_by_the_settings_that_tell_them_apart() -> None:
    # A preset implies its ZeRO stage: the stage adds nothing to the names.
    presets = [_row("0", deepspeed="z0", zero="stage0"), _row("1", deepspeed="z2", zero="stage2")]
    assert runs.run_names(presets, ["deepspeed", "zero"]) == ["deepspeed=z0", "deepspeed=z2"]
    grid = [
        _row(str(i), deepspeed=d, zero=z, precision=p)
        for i, (d, z, p) in enumerate(
            [("z0", "stage0", "bf16"), ("z0", "stage0", "fp32"), ("z2", "stage2", "bf16"), ("z2", "stage2", "fp32")]
        )
    ]
    assert runs.run_names(grid, ["deepspeed", "zero", "precision"]) == [
        "deepspeed=z0,precision=bf16",
        "deepspeed=z0,precision=fp32",
        "deepspeed=z2,precision=bf16",
        "deepspeed=z2,precision=fp32",
    ]
    # The same settings twice (a repeated job): the directory name keeps the names unique.
    twice = [_row("0", zero="stage2"), _row("1", zero="stage2"), _row("2", zero="stage3")]
    assert runs.run_names(twice, ["zero"]) == ["zero=stage2 [0]", "zero=stage2 [1]", "zero=stage3"]
    # Nothing differs: each run keeps its own name.
    assert runs.run_names([_row("10-00-00", zero="stage2")], []) == ["10-00-00"]


def test_overrides_only_runs_do_not_invent_differences(tmp_path: Path) -> None:
    a = write_run(
        tmp_path / "a",
        overrides=["train.lr=1e-3", "paths.output_dir=/a", "+hf_token=abc"],
        choices={"zero": "stage2"},
        summary={"samples_per_sec": 2.0},
    )
    b = write_run(tmp_path / "b", overrides=["train.lr=3e-4", "paths.output_dir=/b"], metrics=[{"step": 1}])
    rows = runs.load_runs([a, b])
    # b knows no group choices: its missing "zero" is unknown, not a difference; its lr is one.
    assert runs.differing_keys(rows) == ["train.lr"]
    assert all("hf_token" not in r.settings and "paths.output_dir" not in r.settings for r in rows)


def test_not_a_run_dir_raises(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(runs.NotARunError, match="neither a run directory"):
        runs.load_runs([tmp_path / "empty"])
    with pytest.raises(runs.NotARunError, match="no such directory"):
        runs.load_runs([tmp_path / "missing"])
    assert runs.is_run_dir(write_run(tmp_path / "run", overrides=[]))  # .hydra/ alone makes a run


class WandbRunStandIn(SimpleNamespace):
    """Stands in for wandb.apis.public.Run (which needs a server): the attributes and method compare uses."""

    def scan_history(self, keys: list[str]):
        return [r for r in self.history if all(k in r for k in keys)]


def test_rows_from_wandb_runs(tmp_path: Path) -> None:
    finished = WandbRunStandIn(
        name="zero=stage3",
        url="https://example.invalid/e/p/runs/abc",
        state="finished",
        tags=["zero=stage3", "precision=bf16"],
        summary_metrics={
            "status": "completed",
            "samples_per_sec": 12.0,
            "peak_memory_bytes": GIB,
            "choices": {"zero": "stage3", "precision": "bf16"},
            "overrides": ["zero=stage3"],
            "trainer/step": 3,
        },
        history=[{"trainer/step": s, "train/loss": 1.0 / s} for s in (1, 2, 3)] + [{"eval/loss": 1.0}],
    )
    crashed = WandbRunStandIn(
        name="zero=stage2",
        url="https://example.invalid/e/p/runs/def",
        state="crashed",
        tags=["zero=stage2", "precision=bf16"],
        summary_metrics={"trainer/step": 7, "train/loss": 0.5, "perf/samples_per_sec": 20.0},
        history=[{"trainer/step": 7, "train/loss": 0.5}],
    )
    api = SimpleNamespace(runs=lambda path, filters: [finished, crashed] if filters == {"group": "g"} else [])
    rows = runs.fetch_wandb_rows("e/p", "g", api=api)
    assert [r.status for r in rows] == ["completed", "incomplete"]
    assert rows[0].curve == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert rows[0].source == "https://example.invalid/e/p/runs/abc"
    assert rows[1].steps == 7 and rows[1].final_loss == 0.5 and rows[1].samples_per_sec == 20.0
    assert rows[1].settings == {"zero": "stage2", "precision": "bf16"}  # from tags
    assert runs.differing_keys(rows) == ["zero"]
    assert [r.name for r in runs.sort_rows(rows)] == ["zero=stage2", "zero=stage3"]
    assert runs.fetch_wandb_rows("e/p", "other", api=api) == []
    # from here on W&B's rows are compared as local ones are (launcher.compare.render)
    text = write_outputs(rows, tmp_path, "e/p g", plot=False).read_text()
    assert text.startswith("# Run comparison: e/p g\n")
    assert "| run | zero | status |" in text and "## Incomplete runs" in text


def test_a_gpu_run_reads_host_memory_beside_device_memory():
    """An offload preset moves optimizer states to pinned host memory: a GPU run's row keeps both sides."""
    memory = {"peak_allocated_bytes": GIB, "device_used_bytes": 2 * GIB, "host_peak_bytes": 4 * GIB}
    summary = {"status": "completed", "peak_memory_bytes": 2 * GIB, "memory": {**memory, "pinned_host_bytes": GIB}}
    gpu = runs.build_row("z2", "z2", "completed", summary, {"deepspeed": "z2"}, [], {}, [])
    assert (gpu.peak_memory_bytes, gpu.host_memory_bytes, gpu.pinned_host_bytes) == (2 * GIB, 4 * GIB, GIB)
    from_metrics = runs.build_row(
        "z2", "z2", "failed", {}, {}, [], {"mem/device_used_bytes": 1, "mem/host_peak_bytes": 3}, []
    )
    assert from_metrics.host_memory_bytes == 3
    cpu = runs.build_row("cpu", "cpu", "completed", {"memory": {"host_peak_bytes": GIB}}, {}, [], {}, [])
    assert cpu.host_memory_bytes is None  # a CPU run's memory is peak_memory_bytes
