"""launcher.compare.cli: `python -m launcher.compare` as `main(argv)` in this process (the subprocess itself
is in tests/e2e/test_tools.py): where the comparison goes, what the terminal shows, and its refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.compare.cli import main
from tests.unit.compare.sweeps import ERROR, NAMES


def test_cli_on_a_sweep(sweep: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([str(sweep)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["run", "zero", "offload", "precision", "status"]
    assert lines[2].split()[0] == NAMES["1"]
    assert f"{NAMES['2']} failed: {ERROR}" in lines
    assert (sweep / "compare.md").is_file() and (sweep / "compare.png").is_file()
    assert lines[-1] == f"comparison: {sweep / 'compare.md'} (+ compare.csv, compare.png)"
    assert (sweep / "compare.md").read_text().startswith("# Run comparison: 15-30-00\n")  # the sweep's name


def test_cli_on_a_list_of_runs_writes_next_to_them(sweep: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """Runs given one by one: the comparison goes into the directory that holds them, and says so."""
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main([str(sweep / "0"), str(sweep / "1"), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert (sweep / "compare.md").is_file() and not (sweep / "compare.png").exists()
    assert not list(here.iterdir())
    assert out.splitlines()[-1] == f"comparison: {sweep / 'compare.md'} (+ compare.csv)"
    # Two runs that differ only by zero stage: one differing column, and their names.
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["run", "zero", "status"]
    assert [line.split()[0] for line in lines[2:4]] == ["zero=stage3", "zero=stage2"]
    assert (sweep / "compare.md").read_text().startswith("# Run comparison: 2 runs\n")


def test_cli_out_writes_where_it_is_told(sweep: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([str(sweep / "0"), str(sweep / "1"), "--no-plot", "--out", "report"]) == 0
    assert (tmp_path / "report" / "compare.md").is_file() and not (sweep / "compare.md").exists()
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"comparison: {tmp_path / 'report' / 'compare.md'} (+ compare.csv)"


def test_cli_bad_path_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "not_a_run").mkdir()
    for path in (tmp_path / "not_a_run", tmp_path / "missing"):
        assert main([str(path)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1
        assert err.startswith("compare: error:") and str(path) in err


def test_cli_an_unwritable_output_is_one_line(sweep: Path, tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main([str(sweep), "--no-plot", "--out", str(blocker / "report")]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith(f"compare: error: cannot write to {blocker / 'report'}:") and len(err.strip().splitlines()) == 1
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give run/sweep directories or --wandb ENTITY/PROJECT (one of the two)"),
        (["--wandb", "e/p", "somewhere"], "give run/sweep directories or --wandb ENTITY/PROJECT (one of the two)"),
        (["--group", "g", "somewhere"], "--group only applies with --wandb"),
    ],
)
def test_cli_usage_errors_exit_2(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2 and message in capsys.readouterr().err
