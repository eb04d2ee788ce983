"""`python train.py` as a user runs it: exit codes, the one `error: ` line on stderr, no traceback.

A representative set, one case per kind of failure: every bad input itself is refused in-process in
tests/unit/launch/test_run.py (the launcher's `run_job`) and tests/unit/launch/test_cli.py (the checks
train.py makes before Hydra runs). None of these starts a rank.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core.rundir import RunDir
from tests.helpers import ROOT

# At exit, which train.py's end reaches through atexit (it skips the interpreter's teardown: launcher.core.children).
NO_HEAVY_IMPORTS = """
import atexit, runpy, sys

def heavy_imports():
    heavy = sorted(m for m in ("torch", "deepspeed", "transformers", "wandb") if m in sys.modules)
    print("HEAVY:", ",".join(heavy), file=sys.stderr, flush=True)

atexit.register(heavy_imports)
sys.argv = ["train.py", "--cfg", "job"]
runpy.run_path("train.py", run_name="__main__")
"""


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory but the log Hydra appends to and the lock (and room) a job takes in it."""
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name not in ("train.log", ".lock", ".reserve")
    }


def assert_one_clear_error(result: subprocess.CompletedProcess[str], message: str, code: int = 2) -> str:
    """Exit `code`, one line on stderr starting with "error: " that holds `message`, said once, no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, output[-3000:]
    assert message in error_lines[0], error_lines[0]
    assert "Traceback" not in output
    assert sum(message in line for line in output.splitlines()) == 1, output[-3000:]  # no echo of it
    return error_lines[0]


def assert_failed(run_dir: Path, message: str) -> None:
    """summary.json says failed with the line; nothing that looks like a plan or a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and message in summary["error"]
    for name in ("ds_config.json", "job.json", "model", "checkpoints"):
        assert not (run_dir / name).exists(), name


@pytest.fixture
def finished_copy(quick_run, tmp_path) -> Path:
    """A copy of the shared finished run (2 steps, checkpoint step2), for a command to be refused on."""
    copy = tmp_path / "finished"
    shutil.copytree(quick_run.run_dir, copy)
    return copy


# ----------------------------------------------------------------------------------------- compose time
@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("offload.optimizer=cpuu", "Invalid value 'cpuu', expected one of [none, cpu, nvme]"),
        ("deepspeed=z9", "Available options in 'deepspeed'"),
        ("zero.stag=3", "Key 'stag' not in 'ZeroConfig'"),
        (
            "data.sources=[{path: a.json, wieght: 2}]",
            "Could not override 'data.sources': Key 'wieght' not in 'SourceConfig'",
        ),
        ("data.sources=[{path: a.json, weight: abc}]", "Value 'abc' of type 'str' could not be converted to Float"),
    ],
    ids=["enum-typo", "unknown-preset", "misspelt-key", "mixture-source-key", "mixture-source-type"],
)
def test_a_compose_time_error_exits_1_before_anything_starts(run_train, tmp_path, arg, message):
    """One line (launcher.launch.cli.composition_refused): Hydra's own report is several, with an
    OmegaConf dump for a mixture source ("full_key: ..., object_type=SourceConfig")."""
    run_dir = tmp_path / "run"
    result = run_train(arg, "dry_run=true", f"hydra.run.dir={run_dir}", timeout=120)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not (run_dir / "summary.json").exists() and not (run_dir / "ds_config.json").exists()


# ----------------------------------------------------------------------------------------- the launcher
def test_a_config_core_refusal_is_one_line_exit_2_and_no_plan(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("zero=stage2", "offload=param", "dry_run=true", f"hydra.run.dir={run_dir}", timeout=120)
    message = "parameter offload (offload_param.device=cpu) needs ZeRO stage 3"
    assert_one_clear_error(result, message)
    assert_failed(run_dir, message)


def test_a_data_file_refusal_names_the_file_and_line(run_train, tmp_path):
    path = tmp_path / "data" / "train.json"
    path.parent.mkdir()
    path.write_text('[{"image": "images/ok.png",]')
    run_dir = tmp_path / "run"
    result = run_train("data=llava_json", f"data.path={path}", "logger=none", f"hydra.run.dir={run_dir}", timeout=120)
    message = f"{path}:1: malformed JSON"
    assert_one_clear_error(result, message)
    assert_failed(run_dir, message)


def test_a_refused_resume_leaves_the_run_as_it_was(run_train, finished_copy):
    """Hydra runs a resume in the run's own directory; nothing there changes until the resume is accepted."""
    before = _files(finished_copy)
    result = run_train(f"resume={finished_copy}", "precision=bf16", timeout=120)
    assert_one_clear_error(
        result,
        f"cannot resume {finished_copy}/checkpoints/step2: the job differs from the one that saved it "
        "(precision fp32 -> bf16)",
    )
    assert _files(finished_copy) == before  # its .hydra/ files and summary.json untouched


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["zero=stage2", "offload=param", "dry_run=true"], 2, "needs ZeRO stage 3"),
        (["zero.stag=3"], 1, "Could not override 'zero.stag'"),
    ],
    ids=["launcher-refusal", "compose-error"],
)
def test_hydra_full_error_shows_the_traceback(run_train, tmp_path, args, code, message):
    result = run_train(*args, f"hydra.run.dir={tmp_path / 'run'}", env={"HYDRA_FULL_ERROR": "1"}, timeout=120)
    assert result.returncode == code, result.stderr[-3000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert message in result.stderr


# ----------------------------------------------------------------------------------------- run directories
def test_an_unwritable_run_dir_is_one_line_and_nothing_is_made(run_train, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("a regular file where a directory is expected")
    result = run_train("logger=none", f"hydra.run.dir={a_file}/run", timeout=120)
    line = assert_one_clear_error(result, f"hydra.run.dir={a_file}/run: cannot create it ({a_file} is a file")
    assert line.endswith("choose a directory you can write")
    assert a_file.is_file()


def test_a_second_job_in_a_run_dir_another_job_holds_is_refused_and_leaves_it_alone(run_train, tmp_path):
    run_dir = RunDir(tmp_path / "run")
    assert run_dir.claim() is None  # this test's process is the job that holds it
    (run_dir.path / "metrics.jsonl").write_text('{"step": 1}\n')
    before = _files(run_dir.path)
    result = run_train("logger=none", "dry_run=true", f"hydra.run.dir={run_dir.path}", timeout=120)
    line = assert_one_clear_error(result, f"hydra.run.dir={run_dir.path}: another job (pid ")
    assert line == (
        f"error: hydra.run.dir={run_dir.path}: another job (pid {os.getpid()}) is running in it; "
        "wait for it to end, or choose another directory"
    )
    assert _files(run_dir.path) == before


def test_a_new_job_in_a_finished_runs_directory_is_refused(run_train, finished_copy):
    before = _files(finished_copy)
    result = run_train("logger=none", f"hydra.run.dir={finished_copy}", timeout=120)
    line = assert_one_clear_error(result, f"hydra.run.dir={finished_copy} already holds a run")
    assert f"continue it with resume={finished_copy}" in line
    assert _files(finished_copy) == before


# ----------------------------------------------------------------------------------------- what succeeds
def test_cfg_job_prints_the_config_without_heavy_imports():
    result = subprocess.run(
        [sys.executable, "-c", NO_HEAVY_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "zero:\n  stage: 0" in result.stdout
    assert "HEAVY: \n" in result.stderr or result.stderr.rstrip().endswith("HEAVY:")


def test_a_dry_run_with_deepspeeds_local_rank_argument_prints_the_final_json(run_train, tmp_path):
    """DeepSpeed's launcher appends --local_rank=N, which Hydra's parser would refuse."""
    run_dir = tmp_path / "run"
    result = run_train(
        "--local_rank=0", "deepspeed=z3_offload", "precision=bf16", "dry_run=true", f"hydra.run.dir={run_dir}"
    )
    assert result.returncode == 0, result.stderr
    written = json.loads((run_dir / "ds_config.json").read_text())
    printed = json.loads(result.stdout[result.stdout.index("{") :])
    assert printed == written
    assert written["zero_optimization"]["stage"] == 3 and written["bf16"]["enabled"] is True
    assert f"dry run: wrote {run_dir / 'ds_config.json'}; nothing trained" in result.stderr
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "job.json").exists()  # trains nothing
