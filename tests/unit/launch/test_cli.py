"""launcher.launch.cli: what train.py checks on its command line before Hydra runs, as functions.

`refused_run_dir(argv)` is the one line train.py prints (after "error: ", exit code 2) for a run
directory that cannot be made, or that holds a finished run; `local_rank_dropped(argv)` takes DeepSpeed's
`--local_rank` out of the arguments Hydra parses. The same lines as train.py prints them are in
tests/e2e/test_cli.py, with the directory another job holds (which needs another process).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.launch.cli import local_rank_dropped, refused_run_dir, slurm_missing


@pytest.fixture
def a_file(tmp_path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("a regular file where a directory is expected")
    return path


def test_a_run_dir_under_a_file_is_refused_and_nothing_is_made(a_file):
    line = refused_run_dir(["train.py", "logger=none", f"hydra.run.dir={a_file}/run"])
    assert line == (
        f"hydra.run.dir={a_file}/run: cannot create it ({a_file} is a file, not a directory); "
        "choose a directory you can write"
    )
    assert a_file.is_file()


def test_a_run_dir_in_proc_is_refused():
    line = refused_run_dir(["train.py", "hydra.run.dir=/proc/launcher-test/run"])
    assert line is not None
    assert line.startswith(
        "hydra.run.dir=/proc/launcher-test/run: cannot create it (cannot create a directory in /proc"
    )
    assert not Path("/proc/launcher-test").exists()


@pytest.mark.parametrize("flag", ["-m", "--multirun"])
def test_a_sweep_dir_under_a_file_is_refused(a_file, flag):
    line = refused_run_dir(["train.py", flag, f"hydra.sweep.dir={a_file}/sweep", "dry_run=true"])
    assert line is not None and line.startswith(f"hydra.sweep.dir={a_file}/sweep: cannot create it ({a_file} is a file")


def test_an_interpolated_run_dir_is_checked_up_to_where_the_interpolation_starts(a_file, tmp_path):
    line = refused_run_dir(["train.py", f"hydra.run.dir={a_file}/runs/${{now:%H-%M-%S}}"])
    assert line is not None and f"cannot create it ({a_file} is a file, not a directory)" in line
    assert refused_run_dir(["train.py", f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S}}"]) is None
    assert not (tmp_path / "runs").exists()  # an interpolated directory is Hydra's to make


def test_a_command_that_runs_no_job_is_not_checked(a_file):
    for flag in ("--cfg", "--help", "--info"):
        argv = ["train.py", flag, "job", f"hydra.run.dir={a_file}/run"] if flag == "--cfg" else ["train.py", flag]
        assert refused_run_dir(argv) is None


def test_a_new_run_dir_is_claimed_for_the_job(tmp_path):
    run_dir = tmp_path / "run"
    assert refused_run_dir(["train.py", "logger=none", f"hydra.run.dir={run_dir}"]) is None
    assert (run_dir / ".lock").read_text().strip().isdigit()  # this process's id: it holds the lock


@pytest.fixture
def finished(tmp_path) -> Path:
    """A run directory as a finished run leaves it (what the check looks at: its metrics and checkpoints)."""
    run_dir = tmp_path / "finished"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- logger=none\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run_dir / "checkpoints" / "step2").mkdir(parents=True)
    (run_dir / "checkpoints" / "step2" / "launcher_complete.json").write_text("{}")
    (run_dir / "summary.json").write_text('{"status": "completed"}')
    return run_dir


def test_a_new_job_in_a_finished_runs_directory_is_refused_and_leaves_it_as_it_was(finished):
    """Without resume=, a job would append to the old run's metrics and sit next to its checkpoints."""
    before = _files(finished)
    line = refused_run_dir(["train.py", "logger=none", f"hydra.run.dir={finished}"])
    assert line == (
        f"hydra.run.dir={finished} already holds a run (metrics.jsonl, checkpoints): continue it with "
        f"resume={finished} (or resume=auto), or choose a new directory"
    )
    assert _files(finished) == before
    # Continuing it is what the line suggests: accepted here (the resume itself decides what runs).
    assert refused_run_dir(["train.py", f"hydra.run.dir={finished}", "resume=auto"]) is None
    assert refused_run_dir(["train.py", f"resume={finished}"]) is None
    assert _files(finished) == before


def _files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name not in (".lock", ".reserve")
    }


@pytest.mark.parametrize(
    ("given", "value", "kept"),
    [
        (["--local_rank=0", "dry_run=true"], "0", ["dry_run=true"]),
        (["dry_run=true", "--local-rank=3"], "3", ["dry_run=true"]),
        (["--local_rank", "1", "dry_run=true"], "1", ["dry_run=true"]),
        (["dry_run=true", "logger=none"], None, ["dry_run=true", "logger=none"]),
    ],
    ids=["equals", "dash", "separate-value", "absent"],
)
def test_deepspeeds_local_rank_argument_is_taken_out_of_hydras_arguments(given, value, kept):
    argv = ["train.py", *given]
    assert local_rank_dropped(argv) == value
    assert argv == ["train.py", *kept]  # in place: what Hydra parses next


def test_a_new_job_in_a_directory_holding_what_no_run_wrote_is_refused_and_leaves_it_untouched(tmp_path):
    """A folder with a user's model/ and notes (e.g. also given as model.path) as hydra.run.dir: a run would
    replace model/ at its end and write its summary.json over theirs. An empty folder, or one a refused job
    left (.hydra/, summary.json, train.log), is fine; resume= is not checked (it continues a run)."""
    folder = tmp_path / "mine"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "NOTES.txt").write_text("my notes")
    (folder / "summary.json").write_text('{"mine": true}')
    before = _files(folder)
    line = refused_run_dir(["train.py", "logger=none", f"hydra.run.dir={folder}"])
    assert line == (
        f"hydra.run.dir={folder} holds what no run of this launcher wrote (model): a new run would write model/ "
        "and summary.json beside or over it; choose a new or empty directory"
    )
    assert _files(folder) == before and not (folder / ".lock").exists()
    (folder / "NOTES.txt").write_text("x")
    assert "(NOTES.txt, model)" in refused_run_dir(["train.py", f"hydra.run.dir={folder}"])
    refused_before = tmp_path / "refused"
    (refused_before / ".hydra").mkdir(parents=True)
    (refused_before / "summary.json").write_text('{"status": "failed"}')
    (refused_before / "train.log").write_text("error: ...")
    assert refused_run_dir(["train.py", f"hydra.run.dir={refused_before}"]) is None
    (tmp_path / "empty").mkdir()
    assert refused_run_dir(["train.py", f"hydra.run.dir={tmp_path / 'empty'}"]) is None


def test_a_slurm_sweep_from_a_machine_without_slurm_is_one_line(tmp_path, monkeypatch):
    """submitit raised "Could not detect srun" and Hydra printed 25 lines of traceback (issue 44)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun here
    line = slurm_missing(["train.py", "-m", "dist=slurm", "dist.nnodes=2"])
    assert line.startswith("dist=slurm submits each job to SLURM, and this machine has no SLURM (no srun on PATH)")
    assert slurm_missing(["train.py", "dist=slurm"]) is None  # one job: an srun task of the user's own sbatch
    assert slurm_missing(["train.py", "-m", "dist=slurm", "--cfg", "job"]) is None  # prints, submits nothing
    assert slurm_missing(["train.py", "-m", "dist=slurm", "hydra/launcher=submitit_local"]) is None  # runs here
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    assert slurm_missing(["train.py", "-m", "dist=slurm"]) is None  # a login node
