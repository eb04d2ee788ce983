"""launcher.tracking.wandb_run: one W&B run per job, never fatal. W&B runs offline in the test's directory;
W&B's own CLI reads the runs back.

The oracle is ``wandb leet inspect``: ``--summary --json RUN`` prints one object (config, summary,
tags, state, run_id), ``--json RUN`` prints one record per line (the "run" record holds run_group,
job_type, display_name; "metric" records the step metric; "files" records the saved files).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.rundir import RunDir
from launcher.job.planning import plan_job
from launcher.tracking import wandb_run as wl
from launcher.tracking.wandb_run import WandbRun
from tests.helpers import ROOT, compose_typed, hydra_job

WANDB_CLI = Path(sys.executable).parent / "wandb"
SECRET = "s3cr3t-value-never-logged"
HF_SECRET = "hf_" + "A1b2C3d4" * 4


@pytest.fixture(scope="module", autouse=True)
def wandb_home(tmp_path_factory: pytest.TempPathFactory):
    """Keep W&B's directories in tmp for the whole module (W&B reads some of them once per process)."""
    home = tmp_path_factory.mktemp("wandb_home")
    env = {
        "WANDB_DIR": home / "dir",
        "WANDB_CACHE_DIR": home / "cache",
        "WANDB_CONFIG_DIR": home / "config",
        "WANDB_DATA_DIR": home / "data",
        "WANDB_ARTIFACT_DIR": home / "artifacts",
    }
    saved = {k: os.environ.get(k) for k in [*env, "WANDB_MODE", "WANDB_API_KEY", "NETRC", "WANDB_DISABLED"]}
    for key, path in env.items():
        path.mkdir()
        os.environ[key] = str(path)
    os.environ["NETRC"] = str(home / "no_netrc")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):
        os.environ.pop(key, None)
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def inspect_summary(run: WandbRun) -> dict:
    out = subprocess.run(
        [str(WANDB_CLI), "leet", "inspect", "--summary", "--json", str(run.sync_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return json.loads(out)


def inspect_records(run: WandbRun) -> tuple[list[dict], str]:
    out = subprocess.run(
        [str(WANDB_CLI), "leet", "inspect", "--json", str(run.sync_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()], out


def make_run_dir(tmp_path: Path) -> Path:
    """A run directory as the launcher leaves it before W&B starts."""
    run = RunDir(tmp_path / "outputs" / "2026-11-29" / "10-00-00")
    run.hydra.mkdir(parents=True)
    run.ds_config.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3}, "hf_token": SECRET}))
    run.config.write_text(f"model:\n  name: tiny_llava\n  hf_token: {SECRET}\ntrain:\n  lr: 0.001\n")
    return run.path


def sample_config() -> dict:
    return {
        "model": {"name": "tiny_llava", "hf_token": SECRET, "pad_token_id": 0},
        "wandb": {"api_key": SECRET, "project": "vlm"},
        "deepspeed": {"train_batch_size": 8, "zero_optimization": {"stage": 3}},
        "world_size": 1,
        "versions": wl.library_versions(),
        "git_commit": wl.git_commit(),
    }


SUMMARY = {
    "status": "completed",
    "steps": 3,
    "wall_s": 12.5,
    "final_loss": 0.25,
    "eval_loss": 0.5,
    "eval_accuracy": None,
    "samples_per_sec": 33.0,
    "peak_memory_bytes": 123456789,
    "zero_stage": 3,
    "choices": {"zero": "stage3", "precision": "bf16"},
    "overrides": ["zero=stage3", f"hf_token={SECRET}"],
    "error": None,
}


# --------------------------------------------------------------------------------------------------
# Without W&B


def test_the_config_w_and_b_records_is_redacted() -> None:
    config = {
        "wandb": {"api_key": "k", "project": "p", "wandb_key": "k"},
        "model": {"hf_token": "t", "pad_token_id": 0, "pad_token": "<pad>", "image_token_index": 5},
        "data": {"image_key": "image", "max_tokens": 64, "aws_secret_access_key": "x"},
        "db": {"password": "pw", "token": "t"},
        "overrides": ["zero=stage3", "+hf_token=t"],
        "hub": HF_SECRET,
        "unset_token": None,
    }
    redacted = wl.redact(config)  # launcher.core.credentials.redact, what WandbRun applies
    assert redacted == {
        "wandb": {"api_key": "<redacted>", "project": "p", "wandb_key": "<redacted>"},
        "model": {"hf_token": "<redacted>", "pad_token_id": 0, "pad_token": "<pad>", "image_token_index": 5},
        "data": {"image_key": "image", "max_tokens": 64, "aws_secret_access_key": "<redacted>"},
        "db": {"password": "<redacted>", "token": "<redacted>"},
        "overrides": ["zero=stage3", "+hf_token=<redacted>"],
        "hub": "<redacted>",
        "unset_token": None,
    }
    assert config["wandb"]["api_key"] == "k"  # a copy, the input is untouched


def test_library_versions_and_git_commit_never_raise(tmp_path: Path) -> None:
    versions = wl.library_versions()
    assert versions["python"] == sys.version.split()[0]
    assert versions["wandb"] == "0.31.0"
    assert wl.git_commit(tmp_path) is None  # not a repository
    assert wl.git_commit(tmp_path / "missing") is None

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("a")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    sha = wl.git_commit(tmp_path)
    assert sha is not None and len(sha) == 40
    (tmp_path / "f.txt").write_text("b")
    assert wl.git_commit(tmp_path) == f"{sha}+dirty"


def test_the_stored_run_id(tmp_path: Path) -> None:
    assert wl.read_run_id(tmp_path) is None
    RunDir(tmp_path).wandb_run_id.write_text("  \n")
    assert wl.read_run_id(tmp_path) is None
    RunDir(tmp_path).wandb_run_id.write_text("abc123\n")
    assert wl.read_run_id(tmp_path) == "abc123"


@pytest.mark.parametrize("module", ["launcher.tracking.wandb_run", "launcher.compare.cli"])
def test_modules_import_without_torch_or_wandb(module: str) -> None:
    code = (
        f"import sys, {module}; heavy = {{'torch', 'wandb', 'matplotlib', 'deepspeed'}} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_disabled_run_is_a_no_op(tmp_path: Path) -> None:
    run = WandbRun.start(tmp_path / "run", project="p", mode="disabled")
    assert not run.enabled and run.mode == "disabled"
    run.log({"train/loss": 1.0}, step=1)
    run.log_table("t", ["a"], [[1]])
    run.finish({"status": "completed"}, exit_code=0)
    assert not (tmp_path / "run").exists()
    assert run.describe() == "disabled run None"


def test_unresolved_mode_is_a_programming_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be resolved first"):
        WandbRun.start(tmp_path, project="p", mode="auto")


class BrokenRun:
    """A W&B run whose every call fails, as when the W&B service dies mid-training."""

    id = "broken01"
    dir = "/nonexistent"
    settings = None

    def log(self, *args, **kwargs):
        raise RuntimeError("wandb service is gone\nsecond line")

    def finish(self, *args, **kwargs):
        raise RuntimeError("still gone")

    @property
    def summary(self):
        raise RuntimeError("still gone")


def test_w_and_b_errors_disable_logging_instead_of_raising(tmp_path: Path, caplog) -> None:
    run = WandbRun(BrokenRun(), tmp_path, "offline")
    with caplog.at_level(logging.WARNING, logger="launcher.tracking.wandb_run"):
        run.log({"train/loss": 1.0}, step=1)
        run.log({"train/loss": 1.0}, step=2)
        run.finish({"status": "completed"}, exit_code=0)
    assert not run.enabled
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "W&B logging disabled after an error while logging metrics: RuntimeError: wandb service is gone"
    ]

    run = WandbRun(BrokenRun(), tmp_path, "offline")
    with caplog.at_level(logging.WARNING, logger="launcher.tracking.wandb_run"):
        run.finish({"status": "completed"}, exit_code=0)
    assert "W&B finish failed" in caplog.text


# --------------------------------------------------------------------------------------------------
# Offline runs, read back with `wandb leet inspect`


@pytest.mark.slow  # W&B offline runs, each read back by W&B's CLI (a subprocess)
def test_offline_run_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    run_dir = make_run_dir(tmp_path)
    # A secret given on the command line must not reach W&B's record of sys.argv either.
    monkeypatch.setattr(sys, "argv", ["train.py", "zero=stage3", f"hf_token={SECRET}"])
    started = time.perf_counter()
    run = WandbRun.start(
        run_dir,
        project="vlm-ds",
        mode="offline",
        group="sweep-15-30-00",
        name="deepspeed=z3,precision=bf16",
        tags=["zero=stage3", "precision=bf16"],
        config=sample_config(),
    )
    init_s = time.perf_counter() - started
    print(f"offline WandbRun.start took {init_s:.2f} s")
    assert init_s < 30
    assert sys.argv == ["train.py", "zero=stage3", f"hf_token={SECRET}"]  # put back after W&B recorded it
    assert run.enabled and run.mode == "offline"
    assert run.sync_dir is not None and run.sync_dir.parent == run_dir / "wandb"
    assert re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run.run_id}(-\d+)?", run.sync_dir.name)
    assert RunDir(run_dir).wandb_run_id.read_text().strip() == run.run_id

    for step in (1, 2, 3):
        run.log({"train/loss": 1.0 / step, "perf/samples_per_sec": 30.0 + step}, step=step)
    run.log({"eval/loss": 0.5, "eval/accuracy": 0.75}, step=3)
    run.finish(SUMMARY, exit_code=0)
    run.finish(SUMMARY, exit_code=0)  # a second call is harmless
    assert "wandb sync " + str(run.sync_dir) in capsys.readouterr().out

    summary = inspect_summary(run)
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["run_id"] == run.run_id and summary["project"] == "vlm-ds"
    assert summary["name"] == "deepspeed=z3,precision=bf16"
    assert summary["tags"] == ["zero=stage3", "precision=bf16"]
    config = summary["config"]
    assert config["deepspeed"]["zero_optimization"]["stage"] == 3
    assert config["model"]["hf_token"] == "<redacted>" and config["wandb"]["api_key"] == "<redacted>"
    assert config["model"]["pad_token_id"] == 0
    assert config["versions"]["wandb"] == "0.31.0"
    s = summary["summary"]
    assert s["status"] == "completed" and s["final_loss"] == 0.25 and s["peak_memory_bytes"] == 123456789
    assert s["trainer/step"] == 3 and s["train/loss"] == pytest.approx(1 / 3) and s["eval/accuracy"] == 0.75
    assert s["choices"] == {"zero": "stage3", "precision": "bf16"}
    assert s["overrides"] == ["zero=stage3", "hf_token=<redacted>"]
    assert "eval_accuracy" not in s  # None values are left out

    records, raw = inspect_records(run)
    (run_record,) = [r["run"] for r in records if r["type"] == "run"]
    assert run_record["run_group"] == "sweep-15-30-00"
    assert run_record["job_type"] == "train"
    assert run_record["display_name"] == "deepspeed=z3,precision=bf16"
    metrics = {
        r["metric"].get("glob_name") or r["metric"].get("name"): r["metric"] for r in records if r["type"] == "metric"
    }
    for namespace in ("train", "eval", "perf", "mem"):
        assert metrics[f"{namespace}/*"]["step_metric"] == "trainer/step"
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [h["trainer/step"] for h in history] == [1, 2, 3, 3]
    saved = {f["path"] for r in records if r["type"] == "files" for f in r["files"]["files"]}
    assert {"ds_config.json", "hydra_config.yaml"} <= saved
    environment = [r["environment"] for r in records if r["type"] == "environment" and "args" in r["environment"]]
    assert environment[0]["args"] == ["zero=stage3", "hf_token=<redacted>"]

    files = run.sync_dir / "files"
    assert json.loads((files / "ds_config.json").read_text())["hf_token"] == "<redacted>"
    assert "hf_token: <redacted>" in (files / "hydra_config.yaml").read_text()
    assert SECRET not in raw
    for path in (run_dir / "wandb").rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.slow  # W&B offline runs, each read back by W&B's CLI (a subprocess)
def test_resume_continues_the_same_run(tmp_path: Path, capsys) -> None:
    run_dir = make_run_dir(tmp_path)
    first = WandbRun.start(run_dir, project="vlm-ds", mode="offline", group="g", config=sample_config())
    first.log({"train/loss": 1.0}, step=1)
    first.finish({"status": "preempted", "steps": 1}, exit_code=1)

    # Same run directory: the stored id is picked up.
    second = WandbRun.start(run_dir, project="vlm-ds", mode="offline", group="g", config=sample_config())
    assert second.run_id == first.run_id and second.sync_dir != first.sync_dir
    second.log({"train/loss": 0.5}, step=2)
    second.finish({"status": "completed", "steps": 2}, exit_code=0)
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"wandb sync {run_dir / 'wandb'}/offline-run-*-{first.run_id}*" in hint

    # A new run directory resuming by explicit id.
    other_dir = tmp_path / "resumed"
    third = WandbRun.start(other_dir, project="vlm-ds", mode="offline", resume_id=first.run_id)
    assert third.run_id == first.run_id
    assert RunDir(other_dir).wandb_run_id.read_text().strip() == first.run_id
    third.log({"train/loss": 0.25}, step=3)
    third.finish({"status": "completed"}, exit_code=0)

    summaries = [inspect_summary(r) for r in (first, second, third)]
    assert {s["run_id"] for s in summaries} == {first.run_id}
    assert [s["summary"]["trainer/step"] for s in summaries] == [1, 2, 3]
    assert [s["summary"]["status"] for s in summaries] == ["preempted", "completed", "completed"]
    assert summaries[0]["exit_code"] == 1


@pytest.mark.slow  # starts W&B (its service process: seconds)
def test_an_offline_run_prints_nothing_and_the_run_summary_names_it(tmp_path: Path, monkeypatch, capfd) -> None:
    """W&B's banner and its history/summary block at the end stay off the terminal (about 40 lines);
    the launcher's run summary carries `describe()`: the run and how to upload it."""
    monkeypatch.delenv("WANDB_SILENT", raising=False)
    run = WandbRun.start(make_run_dir(tmp_path), project="vlm-ds", mode="offline")
    run.log({"train/loss": 1.0}, step=1)
    run.finish(SUMMARY, exit_code=0, hint=False)
    out, err = capfd.readouterr()
    assert "wandb" not in (out + err).lower(), out + err
    assert run.describe() == f"offline run {run.run_id}: upload with `wandb sync {run.sync_dir}`"
    assert run.url is None  # offline: no address (W&B would warn when asked for one)


@pytest.mark.slow  # starts W&B (its service process: seconds)
def test_online_without_credentials_logs_offline(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="launcher.tracking.wandb_run"):
        run = WandbRun.start(tmp_path / "run", project="p", mode="online")
    assert run.mode == "offline" and run.enabled
    assert "no credentials" in caplog.text
    run.finish({}, exit_code=0)


@pytest.mark.slow
def test_unreachable_server_falls_back_to_offline(tmp_path: Path, monkeypatch, caplog) -> None:
    # Credentials present, server unreachable (a closed local port): online init times out.
    monkeypatch.setenv("WANDB_API_KEY", "a" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    assert wl.resolve_mode("auto", os.environ, wl.has_credentials()) == "online"
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="launcher.tracking.wandb_run"):
        run = WandbRun.start(tmp_path / "run", project="p", mode="online", group="g", init_timeout_s=2)
    assert time.perf_counter() - started < 60
    assert run.enabled and run.mode == "offline"
    assert "W&B online init failed" in caplog.text and "logging offline instead" in caplog.text
    run.log({"train/loss": 1.0}, step=1)
    run.finish({"status": "completed"}, exit_code=0)
    summary = inspect_summary(run)
    assert summary["run_id"] == run.run_id and summary["summary"]["status"] == "completed"


# --------------------------------------------------------------------------------------------------
# The run of a job


JOB = ["logger=wandb", "logger.mode=offline", "logger.tags=[nightly]", "deepspeed=z3", "precision=bf16",
       "dist.nproc_per_node=2", f"+deepspeed_extra.comet.api_key={SECRET}", "hydra.job.num=0"]  # fmt: skip


def planned_job(run_dir: Path, overrides: list[str] = JOB):
    """The job `train.py OVERRIDES` plans, as a job of a sweep (its W&B group the sweep's)."""
    hydra = dataclasses.replace(hydra_job(overrides, run_dir), multirun=True, group="sweep-2026-11-29-15-30-00")
    return plan_job(compose_typed(overrides), hydra, validate=False)


def test_job_config_is_the_config_plus_what_the_launcher_derived(tmp_path: Path) -> None:
    job = planned_job(tmp_path / "run")
    config = wl.job_config(job)
    assert config["deepspeed"] == job.ds_config and config["deepspeed"]["zero_optimization"]["stage"] == 3
    assert config["world_size"] == 2 and config["train"]["max_steps"] == job.max_steps
    assert config["effective_batch"] == {
        "train_batch_size": job.global_batch,
        "micro_batch_per_gpu": job.micro_batch,
        "gradient_accumulation_steps": job.ds_config["gradient_accumulation_steps"],
    }
    assert config["job"]["multirun"] is True and config["job"]["overrides"] == JOB
    assert config["job"]["choices"]["deepspeed"] == "z3" and config["versions"]["python"]


@pytest.mark.slow  # W&B offline runs, each read back by W&B's CLI (a subprocess)
def test_start_for_job_builds_the_run_from_the_job(tmp_path: Path, monkeypatch) -> None:
    run_dir = make_run_dir(tmp_path)
    job = planned_job(run_dir)
    run = wl.start_for_job(job)
    assert run is not None and run.mode == "offline"
    run.finish({"status": "completed"}, exit_code=0)

    summary = inspect_summary(run)
    assert summary["name"] == "deepspeed=z3,dist.nproc_per_node=2,precision=bf16"
    assert summary["tags"][:4] == ["deepspeed=z3", "zero=stage3", "offload=none", "precision=bf16"]
    assert "model=tiny_llava" in summary["tags"] and summary["tags"][-1] == "nightly"
    config = summary["config"]
    assert config["deepspeed"]["zero_optimization"]["stage"] == 3
    assert config["effective_batch"]["train_batch_size"] == job.global_batch and config["world_size"] == 2
    assert config["deepspeed_extra"]["comet"]["api_key"] == "<redacted>" and config["versions"]["python"]
    assert config["deepspeed"]["comet"]["api_key"] == "<redacted>"
    records, raw = inspect_records(run)
    (run_record,) = [r["run"] for r in records if r["type"] == "run"]
    assert run_record["run_group"] == "sweep-2026-11-29-15-30-00" and run_record["job_type"] == "train"
    assert SECRET not in raw

    # resumed by id: the same run continues
    again = wl.start_for_job(job, resume_id=run.run_id)
    assert again is not None and again.run_id == run.run_id
    again.finish({"status": "completed"}, exit_code=0)

    disabled = ["logger.mode=disabled" if o.startswith("logger.mode=") else o for o in JOB]
    assert wl.start_for_job(planned_job(tmp_path / "off", disabled)) is None
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wl.start_for_job(planned_job(tmp_path / "other")) is None
