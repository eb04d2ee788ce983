"""launcher.compare.render: the comparison written out (terminal table, compare.md, compare.csv,
compare.png), from the sweep of tests/unit/compare/sweeps.py."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from launcher.compare import render
from launcher.compare.runs import build_row, load_runs
from tests.unit.compare.sweeps import BY_THROUGHPUT, ERROR, GIB, MIB, NAMES, make_sweep, write_run


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the sweep, its compare.md): one comparison written, read by the tests that only read it."""
    sweep = make_sweep(tmp_path_factory.mktemp("compared") / "15-30-00")
    return sweep, render.write_comparison(sweep)


def test_csv_has_raw_numbers_and_errors(compared: tuple[Path, Path]) -> None:
    sweep, md = compared
    with (sweep / "compare.csv").open() as f:
        records = list(csv.DictReader(f))
    assert [r["run"] for r in records] == [NAMES[job] for job in BY_THROUGHPUT]
    assert list(records[0])[:5] == ["run", "zero", "offload", "precision", "status"]
    first = records[0]
    assert first["peak_memory_bytes"] == str(900 * MIB)
    assert (first["padding_frac"], first["mfu"]) == ("0.125", "0.0375")  # the useful-work figures, raw
    assert float(first["samples_per_sec"]) == 55.5
    assert float(first["wall_s"]) == 3725.0
    assert first["eval_loss"] == ""
    assert records[-1]["status"] == "failed" and records[-1]["error"] == ERROR
    assert md == sweep / "compare.md"


def test_markdown_has_table_units_and_failed_error(compared: tuple[Path, Path]) -> None:
    sweep, md = compared
    text = md.read_text()
    assert text.startswith(f"# Run comparison: {sweep.name}\n")
    assert "| run | zero | offload | precision | status |" in text
    assert "1.50 GiB" in text and "900 MiB" in text
    assert "1h 02m" in text and "1m 15s" in text
    assert "## Failed runs" in text and ERROR in text
    assert "## Incomplete runs" in text
    assert "![" in text and "compare.png" in text
    table_lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [line.split("|")[1].strip() for line in table_lines[1:]] == [NAMES[job] for job in BY_THROUGHPUT]
    assert f"- run {NAMES['2']} ({sweep / '2'}): {ERROR}" in text
    assert f"- run {NAMES['3']} ({sweep / '3'})" in text  # incomplete


def test_png_is_a_valid_image(compared: tuple[Path, Path]) -> None:
    png = compared[0] / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 800 and height > 500


def test_write_comparison_to_another_directory(sweep: Path, tmp_path: Path) -> None:
    md = render.write_comparison(sweep, out_dir=tmp_path / "report")
    assert md == tmp_path / "report" / "compare.md"
    assert {p.name for p in md.parent.iterdir()} == {"compare.md", "compare.csv", "compare.png"}
    assert not (sweep / "compare.md").exists()


def test_without_the_picture_only_the_table_files(sweep: Path, tmp_path: Path) -> None:
    md = render.write_outputs(load_runs([sweep]), tmp_path / "out", "t", plot=False)
    assert {p.name for p in md.parent.iterdir()} == {"compare.md", "compare.csv"} and "![" not in md.read_text()
    assert render.written_line(md, plot=False) == f"comparison: {md} (+ compare.csv)"
    assert render.written_line(md) == f"comparison: {md} (+ compare.csv, compare.png)"


def test_the_terminal_table_aligns_numbers_and_ends_with_the_errors(sweep: Path) -> None:
    lines = render.terminal_table(load_runs([sweep])).splitlines()
    assert lines[0].split()[:5] == ["run", "zero", "offload", "precision", "status"]
    assert set(lines[1]) <= {"-", " "}
    assert [line.split()[0] for line in lines[2:7]] == [NAMES[job] for job in BY_THROUGHPUT]
    assert lines[-1] == f"{NAMES['2']} failed: {ERROR}"
    width = len(lines[0])
    assert lines[2].endswith("1h 02m") and len(lines[2]) == width  # right-aligned to the header's end
    assert lines[0].split()[-6:-2] == ["tokens/s", "padding", "MFU", "peak"] and "12%  3.8%" in lines[2]


@pytest.mark.parametrize(
    ("n", "text"),
    [(None, "-"), (512, "512 B"), (900 * MIB, "900 MiB"), (int(1.5 * GIB), "1.50 GiB"), (40 * GIB, "40.0 GiB")],
)
def test_human_bytes(n: int | None, text: str) -> None:
    assert render.human_bytes(n) == text


def test_human_seconds() -> None:
    assert [render.human_seconds(s) for s in (None, 4.2, 75, 3725)] == ["-", "4.2 s", "1m 15s", "1h 02m"]


def test_default_output_directory(sweep: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert render.default_out_dir([sweep]) == sweep  # a sweep directory: into it
    assert render.default_out_dir([sweep / "0", sweep / "10"]) == sweep  # its runs: the same place
    assert render.default_out_dir([sweep / "0"]) == sweep  # one run: next to it
    other = write_run(tmp_path / "runs" / "2026-11-30" / "09-00-00", overrides=[], metrics=[{"step": 1}])
    assert render.default_out_dir([sweep / "0", other]) == tmp_path  # runs of different days: their parent
    monkeypatch.chdir(tmp_path)
    assert render.default_out_dir([Path("/"), sweep]) == tmp_path  # nothing in common: the current directory


def test_gpu_runs_show_host_memory_beside_device_memory():
    """An offload preset moves optimizer states to pinned host memory: the table shows both sides."""

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
    headers, cells = render.table(rows, ["deepspeed"])
    assert headers[-3:] == ["peak mem", "host mem", "wall"]
    assert [cell[-2] for cell in cells] == ["4.00 GiB (256 MiB pinned)", "30.0 GiB (12.0 GiB pinned)"]
    assert "host mem: a GPU run's peak host resident set" in render.render_markdown(rows, ["deepspeed"], "t", None)
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
    assert "host mem" not in render.table([cpu], [])[0] and cpu.host_memory_bytes is None


def test_preference_runs_show_their_held_out_reward_accuracy():
    """A DPO run's summary holds eval_rewards_accuracy: the table adds a `reward acc` column after exact match."""

    def row(name: str, summary: dict):
        return build_row(name, name, "completed", {"status": "completed", **summary}, {"loss": name}, [], {}, [])

    rows = [row("dpo", {"eval_loss": 0.56, "eval_rewards_accuracy": 0.9922}), row("sft", {"eval_loss": 0.4})]
    headers, cells = render.table(rows, ["loss"])
    at = headers.index("eval acc") + 1
    assert headers[at] == "reward acc"
    assert [cell[at] for cell in cells] == ["0.992", "-"]
    assert "reward acc: the share of held-out preference pairs" in render.render_markdown(rows, ["loss"], "t", None)
    assert "reward acc" not in render.table([rows[1]], [])[0]
