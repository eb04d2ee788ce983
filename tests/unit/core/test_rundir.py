"""launcher.core.rundir: every path of a run directory, its records, and one job owning it at a time."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.core.checkpoints import CheckpointMarker, prune, write_marker
from launcher.core.errors import LauncherError
from launcher.core.rundir import RunDir, directory_problem
from launcher.core.summary import Summary
from tests.helpers import ROOT


def strict(text: str):
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))


def test_the_paths_of_a_run_directory(tmp_path):
    run = RunDir(tmp_path)
    assert (run.config, run.hydra_config, run.overrides) == (
        tmp_path / ".hydra" / "config.yaml",
        tmp_path / ".hydra" / "hydra.yaml",
        tmp_path / ".hydra" / "overrides.yaml",
    )
    assert (run.job, run.ds_config, run.metrics, run.summary) == (
        tmp_path / "job.json",
        tmp_path / "ds_config.json",
        tmp_path / "metrics.jsonl",
        tmp_path / "summary.json",
    )
    assert run.marker("step4") == tmp_path / "checkpoints" / "step4" / "launcher_complete.json"
    assert run.latest == tmp_path / "checkpoints" / "latest"
    assert run.universal("step4") == tmp_path / "checkpoints" / "universal" / "step4"
    assert (run.rank_error(1), run.rank_traceback(1), run.rank_stacks(1), run.in_step(1)) == (
        tmp_path / "errors" / "rank1.json",
        tmp_path / "errors" / "rank1.txt",
        tmp_path / "errors" / "rank1_stacks.txt",
        tmp_path / "errors" / "rank1.in_step",
    )
    assert (run.stop_file.name, run.wandb_run_id.name, run.lock.name, run.model.name) == (
        "stop_requested",
        "wandb_run_id",
        ".lock",
        "model",
    )


def test_summary_and_metrics_are_valid_json_without_nan(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.write_summary(Summary(status="failed", final_loss=math.nan, eval_loss=math.inf, objective=-math.inf))
    data = strict(run_dir.summary.read_text())
    assert (data["final_loss"], data["eval_loss"], data["objective"]) == (None, None, None)
    assert run_dir.read_summary() == Summary.from_json(data)
    with run_dir.metrics_writer() as writer:
        writer.write({"step": 1, "train/loss": math.nan, "train/grad_norm": 2.5})
        assert strict(run_dir.metrics.read_text()) == {"step": 1, "train/loss": None, "train/grad_norm": 2.5}  # flushed
        writer.write({"step": 2, "train/loss": 1.0})
    lines = run_dir.metrics.read_text().splitlines()
    assert [strict(line)["step"] for line in lines] == [1, 2]


def test_a_summary_that_cannot_be_read_is_none(tmp_path):
    run_dir = RunDir(tmp_path)
    assert run_dir.read_summary() is None
    run_dir.summary.write_text('{"status": "comp')  # half-written by hand (the launcher writes atomically)
    assert run_dir.read_summary() is None


def test_the_last_recorded_step_is_read_from_the_tail_past_a_line_a_kill_cut(tmp_path):
    """What a failed run's summary gives as its steps: the last whole line of metrics.jsonl (a long file
    read from its end; a kill mid-write leaves a cut line, which is passed over)."""
    run_dir = RunDir(tmp_path)
    assert run_dir.last_recorded_step() == 0  # no metrics yet
    with run_dir.metrics_writer() as writer:
        for step in range(1, 3001):
            writer.write({"step": step, "train/loss": 1.0 / step, "padding": "x" * 40})
    assert run_dir.last_recorded_step() == 3000
    with run_dir.metrics.open("a") as file:
        file.write('{"step": 3001, "train/lo')
    assert run_dir.last_recorded_step() == 3000


def test_the_command_line_is_recorded_and_read_back(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    assert not run_dir.is_run()
    run_dir.write_hydra_files({"train": {"lr": 0.001}}, {"runtime": {"choices": {"deepspeed": "z2"}}}, ["deepspeed=z2"])
    assert run_dir.is_run() and run_dir.read_overrides() == ["deepspeed=z2"]
    assert "lr: 0.001" in run_dir.config.read_text()
    assert run_dir.hydra_config.read_text().startswith("hydra:\n")


def test_skipped_records_are_one_line_each_and_no_file_when_none(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.write_skipped_records(
        [{"file": "a.json", "record": 3, "reason": "too long"}, {"file": Path("b"), "record": 1}]
    )
    assert [json.loads(line)["file"] for line in run_dir.skipped_records.read_text().splitlines()] == ["a.json", "b"]
    run_dir.write_skipped_records([])
    assert not run_dir.skipped_records.exists()


def _python(code: str, **kwargs) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, **kwargs)


def test_a_run_directory_is_owned_by_one_process_at_a_time(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    holder = _python(
        "import time; from pathlib import Path; from launcher.core.rundir import RunDir; "
        f"assert RunDir(Path({str(run_dir.path)!r})).claim() is None; print('held', flush=True); time.sleep(30)",
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run_dir.claim() == (
            f"another job (pid {holder.pid}) is running in it; wait for it to end, or choose another directory"
        )
    finally:
        holder.kill()
        holder.wait()
    assert run_dir.claim() is None  # the kernel released the dead job's lock
    assert run_dir.claim() is None  # and claiming again in the same process is a no-op


@pytest.mark.parametrize(("used", "kept"), [(False, False), (True, True)])
def test_a_directory_made_by_a_claim_and_never_used_is_removed_at_exit(tmp_path, used, kept):
    path = tmp_path / "new"
    write = f"(Path({str(path)!r}) / 'summary.json').write_text('{{}}')" if used else "None"
    claim = f"from pathlib import Path; from launcher.core.rundir import RunDir; RunDir(Path({str(path)!r})).claim()"
    child = _python(f"{claim}; {write}")
    assert child.wait(timeout=60) == 0
    assert path.exists() == kept


def test_a_directory_that_cannot_be_made_is_named(tmp_path):
    assert directory_problem(tmp_path / "a" / "b") is None
    assert not (tmp_path / "a").exists()  # probing creates nothing
    (tmp_path / "file").write_text("")
    assert directory_problem(tmp_path / "file" / "run") == f"{tmp_path / 'file'} is a file, not a directory"
    assert directory_problem(Path("/proc/1/run")).startswith("cannot create a directory in /proc/1")


def test_a_stage_model_is_a_folder_of_the_run_dirs_stages_never_a_path(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    assert run_dir.stage_model("align-v1.5_b") == tmp_path / "run" / "stages" / "align-v1.5_b"
    for name in ("../../escaped", "/home/me/victim", "..", "a/b", ""):
        with pytest.raises(ValueError, match="is a path, not a name"):
            run_dir.stage_model(name)


def test_a_directory_that_cannot_be_written_is_refused_with_the_reason_not_a_traceback(tmp_path):
    """A resume into a run dir on a read-only disk raised OSError at `.lock` (issue 42): a real read-only
    mount where this machine allows one; always, a `.lock` that cannot be opened for writing."""
    blocked = tmp_path / "blocked"
    (blocked / ".lock").mkdir(parents=True)
    said = RunDir(blocked).claim()
    assert said == "cannot write in it (Is a directory): make it writable, or choose another directory"

    readonly = tmp_path / "readonly"
    readonly.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("no read-only mount here (mount needs privileges)")
    try:
        said = RunDir(readonly / "run").claim()
        assert said == "cannot write in it (Read-only file system): make it writable, or choose another directory"
    finally:
        subprocess.run(["umount", str(readonly)], check=True)


def _listing(root: Path) -> dict[str, str]:
    """Every file under `root`, by relative path, with a hash of its bytes: what must not change."""
    files = (path for path in root.rglob("*") if path.is_file())
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def test_a_link_planted_in_the_run_dir_is_refused_at_the_start_and_where_a_run_writes(tmp_path):
    """A symlink in the run dir would let a save replace (or a prune delete) a folder outside it (issue 42):
    the start names it in one line, and every write that replaces a folder checks its path again."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "NOTES.txt").write_text("mine")
    (victim / "model.safetensors").write_bytes(b"\0" * 64)
    before = _listing(victim)

    run_dir = RunDir(tmp_path / "run")
    (run_dir.checkpoints / "step6").mkdir(parents=True)
    write_marker(run_dir, CheckpointMarker(step=6, tag="step6"))
    (run_dir.path / "here").mkdir()
    (run_dir.path / "inside_link").symlink_to(run_dir.path / "here")  # a link that stays inside is fine
    logs = run_dir.path / "wandb" / "offline-run-1" / "logs"
    logs.mkdir(parents=True)
    (tmp_path / "core-debug.log").write_text("")
    (logs / "debug-core.log").symlink_to(tmp_path / "core-debug.log")  # W&B's own, as W&B 0.2x makes it
    assert run_dir.link_outside() is None
    assert run_dir.inside(run_dir.path / "inside_link" / "x") == run_dir.path / "inside_link" / "x"

    (run_dir.checkpoints / "step4").symlink_to(victim)  # as a crashed save would have left it
    said = run_dir.claim()
    assert said is not None and said.startswith(f"{run_dir.checkpoints / 'step4'} leads to {victim}, outside the run")
    assert "remove the link" in said and "hydra.run.dir=PATH" in said
    with pytest.raises(LauncherError, match=r"step4 leads to .*victim, outside the run directory"):
        run_dir.inside(run_dir.checkpoint("step4"))
    with pytest.raises(LauncherError, match="outside the run directory"):
        prune(run_dir, keep=1)  # step4, incomplete and older than step6, would be deleted through the link
    (run_dir.checkpoints / "step4").unlink()

    (run_dir.path / "model").symlink_to(victim)  # the final model's folder, replaced at the end of a run
    with pytest.raises(LauncherError, match="model leads to"):
        run_dir.inside(run_dir.model)
    (run_dir.path / "model").unlink()
    (run_dir.path / "stages").symlink_to(tmp_path)  # a folder above the write point counts too
    with pytest.raises(LauncherError, match="stages/sft leads to"):
        run_dir.inside(run_dir.stage_model("sft"))
    assert _listing(victim) == before
