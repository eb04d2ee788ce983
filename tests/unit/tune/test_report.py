"""launcher.tune.report: what a tuning writes (tune.md, tune.csv, tune.png, results.json, tuning.json and
experiment/best.yaml), from results made by hand."""

from __future__ import annotations

import csv
import json

import pytest
import yaml

from launcher.tune import report
from launcher.tune.decide import MiB, Result
from launcher.tune.report import CSV_COLUMNS, Tuning
from launcher.tune.space import Candidate


def result(preset="z0", micro=8, gc=False, precision="fp32", status="fits", rate=None, peak=None, planned=None, **kw):
    candidate = Candidate(preset, precision, micro, 32 // micro, gc)
    return Result(
        candidate,
        planned=None if planned is None else planned * MiB,
        status=status,
        tokens_per_s=rate,  # real tokens/s: what the tuner compares
        samples_per_s=None if rate is None else rate / 10,
        peak=None if peak is None else peak * MiB,
        **kw,
    )


@pytest.fixture
def tuning(tmp_path) -> Tuning:
    """A tuning of three candidates: one fits, one is faster and does not, one was pruned."""
    t = Tuning(tmp_path / "tune", ["model.hidden_size=128", "data=llava_json"], 32, 2, 1000 * MiB, "tune.memory_gb=1")
    t.results = [
        result("z0", micro=4, rate=10.0, peak=600, planned=500, losses=[2.5, 2.4], steps=4, wall_s=12.0),
        result("z1", micro=4, rate=20.0, peak=1200, planned=900, status="does not fit", note="over | budget"),
        result("z2", micro=8, status="pruned", planned=2000, note="predicted 2500 MiB"),
    ]
    t.left_out = ["micro batch 3: the global batch 32 is no multiple of micro batch x 2 rank(s)"]
    t.wall_s, t.cpu_s, t.best_check = 30.0, 50.0, "verified: it matches"
    return t


def test_best_yaml_holds_the_job_and_the_candidate(tmp_path):
    base = ["model.hidden_size=128", "data=llava_json", "data.path=/d/x.json", "deepspeed_json=/d/ds.json"]
    t = Tuning(tmp_path, base, 32, 2, 2**30, "test")
    best = result("z2", micro=4, gc=True, rate=10.0, peak=100)
    text = report.best_yaml(t, best)
    assert text.startswith("# @package _global_\n")
    assert "  - override /data: llava_json\n  - override /deepspeed: z2\n  - override /precision: fp32" in text
    assert "hidden_size: 128" in text and "micro_batch_size: 4" in text and "grad_accum: null" in text
    assert "gradient_checkpointing: true" in text and "path: /d/x.json" in text
    assert "deepspeed_json: /d/ds.json" in text and "override /deepspeed_json" not in text  # a value, not a group


def test_the_table_is_fastest_first_by_status_with_raw_figures(tuning):
    rows = report.table_rows(tuning.results, tuning.global_batch)
    assert [row["candidate"] for row in rows] == ["z0-fp32-mb4", "z1-fp32-mb4", "z2-fp32-mb8"]
    first = rows[0]
    assert (first["fits"], first["peak_mib"], first["planned_mib"], first["measured_over_planned"]) == (
        "yes",
        600.0,
        500.0,
        1.2,
    )
    assert first["first_loss"] == 2.5 and first["measured_steps"] == 4
    assert first["overrides"].startswith("deepspeed=z0 precision=fp32 train.micro_batch_size=4")
    assert [row["fits"] for row in rows[1:]] == ["no", "no (predicted)"]
    assert set(first) == set(CSV_COLUMNS)


def test_write_outputs_writes_every_file_and_best_yaml_for_the_pick(tuning):
    report.write_outputs(tuning)
    directory = tuning.directory
    with (directory / "tune.csv").open() as handle:
        records = list(csv.DictReader(handle))
    assert [r["candidate"] for r in records] == ["z0-fp32-mb4", "z1-fp32-mb4", "z2-fp32-mb8"]
    assert records[2]["samples_per_s"] == "" and records[1]["note"] == "over | budget"
    results = json.loads((directory / "results.json").read_text())
    assert [r["name"] for r in results] == [r.name for r in tuning.results]
    assert results[0]["candidate"] == {
        "preset": "z0",
        "precision": "fp32",
        "micro": 4,
        "accum": 8,
        "checkpointing": False,
        "attention": None,
        "batching": None,
        "pack_length": None,
        "kernels": None,
    }
    totals = json.loads((directory / "tuning.json").read_text())
    assert totals["pick"] == "z0-fp32-mb4" and totals["budget_bytes"] == 1000 * MiB and totals["world_size"] == 2
    assert (directory / "best.yaml").is_symlink() and (directory / "best.yaml").read_text() == (
        directory / "experiment" / "best.yaml"
    ).read_text()
    text = (directory / "tune.md").read_text()
    assert "**Pick: z0-fp32-mb4**: 10 real tokens/s (1.00 samples/s), peak 600 MiB per rank" in text
    assert "best.yaml: verified: it matches" in text and "left out: micro batch 3" in text
    assert "candidates: 3 (1 fits, 1 does not fit, 1 pruned)" in text
    assert "over \\| budget" in text  # a cell's | is escaped
    assert "## The planner, checked" in text
    assert f"python train.py hydra.searchpath=[file://{directory.resolve()}] experiment=best" in text
    report.write_outputs(tuning)  # written again as results come in: the link stays
    assert (directory / "best.yaml").is_symlink()


def test_a_tuning_without_a_pick_says_so_and_writes_no_best_yaml(tuning):
    tuning.results = tuning.results[1:]
    report.write_outputs(tuning)
    assert "**No candidate fits the budget**" in (tuning.directory / "tune.md").read_text()
    assert not (tuning.directory / "best.yaml").exists()
    assert json.loads((tuning.directory / "tuning.json").read_text())["pick"] is None


def test_describe_and_the_command_line(tuning):
    fits = tuning.results[0]
    assert report.describe(fits) == (
        "z0-fp32-mb4: fits: 10 real tokens/s (1.00 samples/s) over 4 steps, peak 600 MiB (planned 500) [12 s]"
    )
    fits.padding_frac = 0.125
    assert "10 real tokens/s (1.00 samples/s, 12.5% padding) over 4 steps" in report.describe(fits)
    assert report.describe(tuning.results[2]) == "z2-fp32-mb8: pruned: (planned 2000) [0 s]; predicted 2500 MiB"
    assert tuning.command_line(fits) == (
        "python train.py model.hidden_size=128 data=llava_json deepspeed=z0 precision=fp32 train.micro_batch_size=4 "
        "train.grad_accum=null train.global_batch_size=32 model.gradient_checkpointing=false "
        "model.vision_gradient_checkpointing=false"
    )


def test_the_picture_is_a_png(tuning):
    tuning.directory.mkdir(parents=True)
    report.write_plot(tuning, tuning.directory / "tune.png")
    assert (tuning.directory / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_tables_give_padding_and_mfu_as_shares_and_the_csv_as_fractions(tuning):
    tuning.results[0].padding_frac, tuning.results[0].mfu = 0.0125, 0.00342
    report.write_outputs(tuning)
    row = next(line for line in (tuning.directory / "tune.md").read_text().splitlines() if "| z0-fp32-mb4 |" in line)
    assert row.startswith("| z0-fp32-mb4 | fits | 10.0 | 1.0 | 1.2% | 0.34% | 600.0 |"), row
    with (tuning.directory / "tune.csv").open() as handle:
        first = next(csv.DictReader(handle))
    assert (float(first["padding_frac"]), float(first["mfu"])) == (0.0125, 0.00342)


def test_a_credential_in_the_job_reaches_neither_tune_md_nor_best_yaml(tuning):
    """tune.md shows it redacted; best.yaml reads it from the environment variable a resume would
    (launcher.core.credentials.recorded_override), so the experiment still runs it."""
    secret = "sk-" + "t" * 30
    tuning.base = [*tuning.base, f"+deepspeed_extra.comet.api_key={secret}"]
    report.write_outputs(tuning)
    for path in tuning.directory.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text(errors="replace"), path
    assert "+deepspeed_extra.comet.api_key=<redacted>" in (tuning.directory / "tune.md").read_text()
    best = yaml.safe_load((tuning.directory / "experiment" / "best.yaml").read_text())
    variable = "VLM_LAUNCHER_SECRET_DEEPSPEED_EXTRA_COMET_API_KEY"
    assert best["deepspeed_extra"]["comet"]["api_key"] == f"${{oc.decode:${{oc.env:{variable}}}}}"


def test_best_yaml_keeps_the_jobs_logger_and_preflight_which_candidates_leave_out(tuning):
    """Candidates run with logger=none and preflight=off; the pick runs the job as given (issue 28: the
    user's logger=none was dropped, so `experiment=best` logged to W&B)."""
    tuning.best_extra = ["logger=none", "preflight=error"]
    report.write_outputs(tuning)
    text = (tuning.directory / "experiment" / "best.yaml").read_text()
    assert "  - override /logger: none" in text and yaml.safe_load(text)["preflight"] == "error"
