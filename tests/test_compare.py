"""Tests of launcher.compare on run directories built from the files a training job writes.

summary.json starts from rundir's own skeleton (the fields every run writes); metrics.jsonl and
.hydra/*.yaml are written by hand, as the input format itself, so these sweeps are what a real
multirun leaves on disk, minus the checkpoints.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher.compare import compare
from launcher.core.rundir import summary_skeleton

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
MIB = 2**20
BASE_CHOICES = {"comm": "default", "model": "tiny_llava", "data": "shapes", "hydra/launcher": "basic"}
ERROR = "offload=param needs ZeRO stage 3: set zero=stage3 or offload=optimizer"
# What the sweep fixture's runs are called (by job directory): the settings that tell them apart.
NAMES = {
    "0": "zero=stage2,offload=none,precision=bf16",
    "1": "zero=stage3,offload=none,precision=bf16",
    "2": "zero=stage2,offload=param,precision=bf16",
    "3": "zero=stage3,offload=none,precision=fp32",
    "10": "zero=stage2,offload=none,precision=fp32",
}
BY_THROUGHPUT = ["1", "0", "10", "3", "2"]  # sorted by samples/s, failed last


def write_run(
    run_dir: Path,
    *,
    overrides: list[str],
    choices: dict | None = None,
    summary: dict | None = None,
    metrics: list[dict] | None = None,
    hydra_choices: dict | None = None,
    extra_metrics_text: str = "",
) -> Path:
    """Write the files a job leaves in its run directory (only those given)."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if hydra_choices is not None:
        lines = ["hydra:", "  runtime:", "    choices:"]
        lines += [f"      {k}: {'null' if v is None else v}" for k, v in hydra_choices.items()]
        (run_dir / ".hydra" / "hydra.yaml").write_text("\n".join(lines) + "\n")
    if summary is not None:
        job = {"world_size": 1, "overrides": overrides, "choices": {**BASE_CHOICES, **(choices or {})}}
        full = {**summary_skeleton(job), "status": "completed", **summary}
        (run_dir / "summary.json").write_text(json.dumps(full))
    if metrics is not None or extra_metrics_text:
        text = "".join(json.dumps(m) + "\n" for m in metrics or [])
        (run_dir / "metrics.jsonl").write_text(text + extra_metrics_text)
    return run_dir


def loss_lines(steps: int, start: float, samples_per_sec: float, peak: int) -> list[dict]:
    lines = []
    for step in range(1, steps + 1):
        lines.append(
            {
                "step": step,
                "train/loss": start / step**0.5,
                "train/lr": 1e-3,
                "perf/samples_per_sec": samples_per_sec,
                "mem/peak_bytes": peak - (steps - step) * MIB,
            }
        )
    lines.append({"step": steps, "eval/loss": start / steps**0.5 + 0.1, "eval/accuracy": 0.5})
    return lines


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A 5-job sweep over zero x offload x precision: 3 completed, 1 failed, 1 killed hard."""
    root = tmp_path / "multirun" / "2026-11-29" / "15-30-00"
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    write_run(
        root / "0",
        overrides=["zero=stage2", "precision=bf16", "hydra.run.dir=/x/0"],
        choices={"zero": "stage2", "offload": "none", "precision": "bf16"},
        summary={
            "steps": 20,
            "wall_s": 75.0,
            "final_loss": 0.8,
            "eval_loss": 0.9,
            "eval_accuracy": 0.5,
            "samples_per_sec": 40.0,
            "tokens_per_sec": 4000.0,
            "peak_memory_bytes": int(1.5 * GIB),
        },
        metrics=loss_lines(20, 2.0, 40.0, int(1.5 * GIB)),
    )
    write_run(
        root / "1",
        overrides=["zero=stage3", "precision=bf16"],
        choices={"zero": "stage3", "offload": "none", "precision": "bf16"},
        summary={
            "steps": 20,
            "wall_s": 3725.0,
            "final_loss": 0.7,
            "samples_per_sec": 55.5,
            "tokens_per_sec": 5550.0,
            "peak_memory_bytes": 900 * MIB,
        },
        metrics=loss_lines(20, 1.8, 55.5, 900 * MIB),
    )
    write_run(
        root / "2",
        overrides=["zero=stage2", "offload=param", "precision=bf16"],
        choices={"zero": "stage2", "offload": "param", "precision": "bf16"},
        summary={"status": "failed", "error": ERROR},
    )
    write_run(
        root / "3",
        overrides=["zero=stage3", "precision=fp32"],
        hydra_choices={
            **BASE_CHOICES,
            "zero": "stage3",
            "offload": "none",
            "precision": "fp32",
            "deepspeed": None,
        },
        metrics=loss_lines(5, 2.2, 20.0, 2 * GIB)[:-1],
        extra_metrics_text='{"step": 6, "train/lo',  # killed mid-write
    )
    write_run(
        root / "10",
        overrides=["zero=stage2", "precision=fp32"],
        choices={"zero": "stage2", "offload": "none", "precision": "fp32"},
        summary={
            "steps": 20,
            "wall_s": 95.0,
            "final_loss": 0.85,
            "samples_per_sec": 30.0,
            "peak_memory_bytes": 2 * GIB,
        },
        metrics=loss_lines(20, 2.1, 30.0, 2 * GIB),
    )
    return root


def test_load_runs_reads_jobs_in_numeric_order(sweep: Path) -> None:
    rows = compare.load_runs([sweep])
    assert [r.name for r in rows] == ["0", "1", "2", "3", "10"]
    by_name = {r.name: r for r in rows}
    assert by_name["0"].settings["zero"] == "stage2"
    assert "hydra/launcher" not in by_name["0"].settings
    assert "hydra.run.dir" not in by_name["0"].settings
    assert by_name["2"].status == "failed" and by_name["2"].error == ERROR


def test_incomplete_run_is_read_from_metrics_and_hydra_yaml(sweep: Path) -> None:
    (row,) = compare.load_runs([sweep / "3"])
    assert row.status == "incomplete"
    assert row.steps == 5  # the truncated last line is skipped
    assert row.samples_per_sec == 20.0
    assert row.peak_memory_bytes == 2 * GIB
    assert row.final_loss == pytest.approx(2.2 / 5**0.5)
    assert len(row.curve) == 5
    assert row.settings["precision"] == "fp32" and "deepspeed" not in row.settings


def test_sorted_by_throughput_with_failed_last(sweep: Path) -> None:
    rows = compare.sort_rows(compare.load_runs([sweep]))
    assert [r.name for r in rows] == ["1", "0", "10", "3", "2"]


def test_runs_without_throughput_come_after_those_with_it(tmp_path: Path) -> None:
    rows = [
        compare.RunRow(name="a", source="a", status="completed"),
        compare.RunRow(name="b", source="b", status="failed", samples_per_sec=99.0),
        compare.RunRow(name="c", source="c", status="completed", samples_per_sec=1.0),
    ]
    assert [r.name for r in compare.sort_rows(rows)] == ["c", "a", "b"]


def test_only_differing_choices_become_columns(sweep: Path) -> None:
    rows = compare.load_runs([sweep])
    assert compare.differing_keys(rows) == ["zero", "offload", "precision"]
    names = compare.run_names(compare.sort_rows(rows), compare.differing_keys(rows))
    assert names == [NAMES[job] for job in BY_THROUGHPUT]


def _row(name: str, **settings: str) -> compare.RunRow:
    return compare.RunRow(name=name, source=name, status="completed", settings=settings)


def test_runs_are_named_by_the_settings_that_tell_them_apart() -> None:
    # A preset implies its ZeRO stage: the stage adds nothing to the names.
    presets = [_row("0", deepspeed="z0", zero="stage0"), _row("1", deepspeed="z2", zero="stage2")]
    assert compare.run_names(presets, ["deepspeed", "zero"]) == ["deepspeed=z0", "deepspeed=z2"]
    grid = [
        _row(str(i), deepspeed=d, zero=z, precision=p)
        for i, (d, z, p) in enumerate(
            [("z0", "stage0", "bf16"), ("z0", "stage0", "fp32"), ("z2", "stage2", "bf16"), ("z2", "stage2", "fp32")]
        )
    ]
    assert compare.run_names(grid, ["deepspeed", "zero", "precision"]) == [
        "deepspeed=z0,precision=bf16",
        "deepspeed=z0,precision=fp32",
        "deepspeed=z2,precision=bf16",
        "deepspeed=z2,precision=fp32",
    ]
    # The same settings twice (a repeated job): the directory name keeps the names unique.
    twice = [_row("0", zero="stage2"), _row("1", zero="stage2"), _row("2", zero="stage3")]
    assert compare.run_names(twice, ["zero"]) == ["zero=stage2 [0]", "zero=stage2 [1]", "zero=stage3"]
    # Nothing differs: each run keeps its own name.
    assert compare.run_names([_row("10-00-00", zero="stage2")], []) == ["10-00-00"]


def test_overrides_only_runs_do_not_invent_differences(tmp_path: Path) -> None:
    a = write_run(
        tmp_path / "a",
        overrides=["train.lr=1e-3", "paths.output_dir=/a", "+hf_token=abc"],
        choices={"zero": "stage2"},
        summary={"samples_per_sec": 2.0},
    )
    b = write_run(tmp_path / "b", overrides=["train.lr=3e-4", "paths.output_dir=/b"], metrics=[{"step": 1}])
    rows = compare.load_runs([a, b])
    # b knows no group choices: its missing "zero" is unknown, not a difference; its lr is one.
    assert compare.differing_keys(rows) == ["train.lr"]
    assert all("hf_token" not in r.settings and "paths.output_dir" not in r.settings for r in rows)


def test_csv_has_raw_numbers_and_errors(sweep: Path) -> None:
    md = compare.write_comparison(sweep)
    with (sweep / "compare.csv").open() as f:
        records = list(csv.DictReader(f))
    assert [r["run"] for r in records] == [NAMES[job] for job in BY_THROUGHPUT]
    assert list(records[0])[:5] == ["run", "zero", "offload", "precision", "status"]
    first = records[0]
    assert first["peak_memory_bytes"] == str(900 * MIB)
    assert float(first["samples_per_sec"]) == 55.5
    assert float(first["wall_s"]) == 3725.0
    assert first["eval_loss"] == ""
    assert records[-1]["status"] == "failed" and records[-1]["error"] == ERROR
    assert md == sweep / "compare.md"


def test_markdown_has_table_units_and_failed_error(sweep: Path) -> None:
    text = compare.write_comparison(sweep).read_text()
    assert "| run | zero | offload | precision | status |" in text
    assert "1.50 GiB" in text and "900 MiB" in text
    assert "1h 02m" in text and "1m 15s" in text
    assert "## Failed runs" in text and ERROR in text
    assert "## Incomplete runs" in text
    assert "![" in text and "compare.png" in text
    table_lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [line.split("|")[1].strip() for line in table_lines[1:]] == [NAMES[job] for job in BY_THROUGHPUT]
    assert f"- run {NAMES['2']} ({sweep / '2'}): {ERROR}" in text


def test_png_is_a_valid_image(sweep: Path) -> None:
    compare.write_comparison(sweep)
    png = sweep / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 800 and height > 500


def test_write_comparison_to_another_directory(sweep: Path, tmp_path: Path) -> None:
    md = compare.write_comparison(sweep, out_dir=tmp_path / "report")
    assert md == tmp_path / "report" / "compare.md"
    assert {p.name for p in md.parent.iterdir()} == {"compare.md", "compare.csv", "compare.png"}
    assert not (sweep / "compare.md").exists()


def test_not_a_run_dir_raises(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(compare.NotARunError, match="neither a run directory"):
        compare.load_runs([tmp_path / "empty"])
    with pytest.raises(compare.NotARunError, match="no such directory"):
        compare.load_runs([tmp_path / "missing"])


@pytest.mark.parametrize(
    ("n", "text"),
    [(None, "-"), (512, "512 B"), (900 * MIB, "900 MiB"), (int(1.5 * GIB), "1.50 GiB"), (40 * GIB, "40.0 GiB")],
)
def test_human_bytes(n: int | None, text: str) -> None:
    assert compare.human_bytes(n) == text


def test_human_seconds() -> None:
    assert [compare.human_seconds(s) for s in (None, 4.2, 75, 3725)] == ["-", "4.2 s", "1m 15s", "1h 02m"]


class FakeWandbRun(SimpleNamespace):
    """Stands in for wandb.apis.public.Run: the attributes and method compare uses."""

    def scan_history(self, keys: list[str]):
        return [r for r in self.history if all(k in r for k in keys)]


def test_rows_from_wandb_runs_share_the_local_path(tmp_path: Path) -> None:
    finished = FakeWandbRun(
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
    crashed = FakeWandbRun(
        name="zero=stage2",
        url="https://example.invalid/e/p/runs/def",
        state="crashed",
        tags=["zero=stage2", "precision=bf16"],
        summary_metrics={"trainer/step": 7, "train/loss": 0.5, "perf/samples_per_sec": 20.0},
        history=[{"trainer/step": 7, "train/loss": 0.5}],
    )
    api = SimpleNamespace(runs=lambda path, filters: [finished, crashed] if filters == {"group": "g"} else [])
    rows = compare.fetch_wandb_rows("e/p", "g", api=api)
    assert [r.status for r in rows] == ["completed", "incomplete"]
    assert rows[0].curve == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert rows[1].steps == 7 and rows[1].final_loss == 0.5 and rows[1].samples_per_sec == 20.0
    assert rows[1].settings == {"zero": "stage2", "precision": "bf16"}  # from tags
    assert compare.differing_keys(rows) == ["zero"]
    text = compare.write_outputs(rows, tmp_path, "e/p g").read_text()
    assert "| run | zero | status |" in text and "## Incomplete runs" in text
    assert [r.name for r in compare.sort_rows(rows)] == ["zero=stage2", "zero=stage3"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.compare", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"},
    )


def test_cli_on_a_sweep(sweep: Path, tmp_path: Path) -> None:
    result = run_cli(str(sweep), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:5] == ["run", "zero", "offload", "precision", "status"]
    assert lines[2].split()[0] == NAMES["1"]
    assert f"{NAMES['2']} failed: {ERROR}" in lines
    assert (sweep / "compare.md").is_file() and (sweep / "compare.png").is_file()
    assert lines[-1] == f"comparison: {sweep / 'compare.md'} (+ compare.csv, compare.png)"


def test_cli_on_a_list_of_runs_writes_next_to_them(sweep: Path, tmp_path: Path) -> None:
    """Runs given one by one: the comparison goes into the directory that holds them, and says so."""
    here = tmp_path / "here"
    here.mkdir()
    result = run_cli(str(sweep / "0"), str(sweep / "1"), "--no-plot", cwd=here)
    assert result.returncode == 0, result.stderr
    assert (sweep / "compare.md").is_file() and not (sweep / "compare.png").exists()
    assert not list(here.iterdir())
    assert result.stdout.splitlines()[-1] == f"comparison: {sweep / 'compare.md'} (+ compare.csv)"
    # Two runs that differ only by zero stage: one differing column, and their names.
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["run", "zero", "status"]
    assert [line.split()[0] for line in lines[2:4]] == ["zero=stage3", "zero=stage2"]


def test_default_output_directory(sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert compare.default_out_dir([sweep]) == sweep  # a sweep directory: into it
    assert compare.default_out_dir([sweep / "0", sweep / "10"]) == sweep  # its runs: the same place
    assert compare.default_out_dir([sweep / "0"]) == sweep  # one run: next to it
    other = write_run(tmp_path / "runs" / "2026-11-30" / "09-00-00", overrides=[], metrics=[{"step": 1}])
    assert compare.default_out_dir([sweep / "0", other]) == tmp_path  # runs of different days: their parent
    monkeypatch.chdir(tmp_path)
    assert compare.default_out_dir([Path("/"), sweep]) == tmp_path  # nothing in common: the current directory


def test_cli_out_writes_where_it_is_told(sweep: Path, tmp_path: Path) -> None:
    result = run_cli(str(sweep / "0"), str(sweep / "1"), "--no-plot", "--out", "report", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "report" / "compare.md").is_file() and not (sweep / "compare.md").exists()
    assert result.stdout.splitlines()[-1] == f"comparison: {tmp_path / 'report' / 'compare.md'} (+ compare.csv)"


def test_cli_bad_path_exits_2_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "not_a_run").mkdir()
    for path in (tmp_path / "not_a_run", tmp_path / "missing"):
        result = run_cli(str(path), cwd=tmp_path)
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert result.stderr.startswith("compare: error:") and str(path) in result.stderr


def test_gpu_runs_show_host_memory_beside_device_memory(tmp_path):
    """An offload preset moves optimizer states to pinned host memory: the table shows both sides."""
    from launcher.compare.compare import build_row, render_markdown, table

    def gpu_row(name: str, device: int, host: int, pinned: int):
        summary = {
            "status": "completed",
            "peak_memory_bytes": device,
            "memory": {
                "peak_allocated_bytes": device // 2,
                "device_used_bytes": device,
                "host_peak_bytes": host,
                "pinned_host_bytes": pinned,
            },
        }
        return build_row(name, name, "completed", summary, {"deepspeed": name}, [], {}, [])

    rows = [gpu_row("z2", 20 * GIB, 4 * GIB, GIB // 4), gpu_row("z2_offload", 8 * GIB, 30 * GIB, 12 * GIB)]
    headers, cells = table(rows, ["deepspeed"])
    assert headers[-3:] == ["peak mem", "host mem", "wall"]
    assert [cell[-2] for cell in cells] == ["4.00 GiB (256 MiB pinned)", "30.0 GiB (12.0 GiB pinned)"]
    assert "host mem: a GPU run's peak host resident set" in render_markdown(rows, ["deepspeed"], "t", None)
    cpu = build_row(
        "cpu",
        "cpu",
        "completed",
        {"status": "completed", "peak_memory_bytes": GIB, "memory": {"host_peak_bytes": GIB}},
        {},
        [],
        {},
        [],
    )
    assert "host mem" not in table([cpu], [])[0] and cpu.host_memory_bytes is None
