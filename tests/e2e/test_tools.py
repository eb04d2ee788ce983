"""The tools' command lines as a user runs them: `python -m launcher.plan | tune | compare | export`, their
exit codes and one-line errors (a representative set; the rest runs in-process in tests/unit/<tool>/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, limit_file_size
from tests.unit.compare.sweeps import ERROR, NAMES, make_sweep


def tool(module: str, *args: str, env: dict[str, str], cwd: Path = ROOT, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"launcher.{module}", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        **kw,
    )


def assert_one_error_line(
    done: subprocess.CompletedProcess[str], code: int, message: str, prefix: str = "error: "
) -> None:
    assert done.returncode == code, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith(prefix)]
    assert len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_python_m_launcher_plan_on_the_built_in_model(isolated_env):
    done = tool("plan", "dist.nproc_per_node=2", env=isolated_env)
    assert done.returncode == 0, done.stderr
    assert "model tiny_llava:" in done.stdout and "job: 2 rank(s)" in done.stdout
    assert "MiB per device" in done.stdout  # a tiny model's table is in MiB
    import torch

    fastest = "bf16" if torch.cuda.is_available() else "fp32"  # on a CPU bf16 is slower (fastest_precisions)
    assert f"recommendation: deepspeed=z0 precision={fastest}" in done.stdout


@pytest.mark.slow  # an interpreter's start-up and imports
def test_python_m_launcher_tune_refuses_a_bad_setting_in_one_line(isolated_env, tmp_path):
    done = tool("tune", "logger=none", f"tune.dir={tmp_path / 'tune'}", "tune.measure_steps=0", env=isolated_env)
    assert_one_error_line(done, 2, "tune.measure_steps=0 must be 1 or more")
    assert not (tmp_path / "tune").exists()


@pytest.mark.slow  # an interpreter's start-up and imports
def test_python_m_launcher_compare_on_a_sweep_and_on_a_path_that_is_no_run(tmp_path):
    """Needs nothing of the environment but the package (no torch, no W&B, no display)."""
    sweep = make_sweep(tmp_path / "multirun" / "15-30-00")
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"}
    done = tool("compare", str(sweep), env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:5] == ["run", "zero", "offload", "precision", "status"]
    assert f"{NAMES['2']} failed: {ERROR}" in lines
    assert lines[-1] == f"comparison: {sweep / 'compare.md'} (+ compare.csv, compare.png)"
    assert (sweep / "compare.png").is_file()
    (tmp_path / "not_a_run").mkdir()
    for path in (tmp_path / "not_a_run", tmp_path / "missing"):
        done = tool("compare", str(path), env=env, cwd=tmp_path)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
        assert done.stderr.startswith("compare: error:") and str(path) in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # an interpreter's start-up and imports
def test_python_m_launcher_export_refuses_a_directory_that_is_no_run(isolated_env, tmp_path):
    assert_one_error_line(tool("export", str(tmp_path), env=isolated_env), 2, f"{tmp_path} is not a run directory")


@pytest.mark.slow
def test_a_disk_that_fills_during_an_export_is_one_line_and_leaves_nothing(quick_run, isolated_env, tmp_path):
    """A file size limit on the export's process, as a full disk would: exit 1, one line, no directory."""
    full = tmp_path / "full"
    done = tool("export", str(quick_run.run_dir), "--out", str(full), env=isolated_env,
                preexec_fn=limit_file_size(64 * 1024))  # fmt: skip
    assert_one_error_line(done, 1, f"cannot write the export {full}")
    assert not full.exists() and not list(tmp_path.glob(".full*"))
    assert not (quick_run.run_dir / "export").exists()
