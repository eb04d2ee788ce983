"""Nothing lost, nothing silent: one job per run directory, finished runs stay finished, valid JSON.

Each case runs `python train.py` as a user would (subprocesses), except the pure record tests.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.rundir import RunDir, Summary
from tests.conftest import ROOT
from tests.test_bad_input import _files

SHORT = ["logger=none", "train.micro_batch_size=4", "train.eval_every=0", "data.eval_accuracy=false"]


# ----------------------------------------------------------------------------- records
def test_summary_and_metrics_are_valid_json_without_nan(tmp_path):
    run_dir = RunDir(tmp_path)
    summary = Summary(status="failed", final_loss=math.nan, eval_loss=math.inf, objective=-math.inf)
    summary.extra["grad_norms"] = [1.0, math.nan]
    run_dir.write_summary(summary)
    data = json.loads(run_dir.summary.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert (data["final_loss"], data["eval_loss"], data["objective"], data["grad_norms"]) == (
        None,
        None,
        None,
        [1.0, None],
    )
    run_dir.append_metrics({"step": 1, "train/loss": math.nan, "train/grad_norm": 2.5})
    line = json.loads(run_dir.metrics.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
    assert line == {"step": 1, "train/loss": None, "train/grad_norm": 2.5}
    assert Summary.from_json(data).to_json() == data  # the record round-trips, extras included


def test_a_run_directory_is_owned_by_one_process_at_a_time(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from launcher.core.rundir import RunDir; "
            f"assert RunDir(Path({str(run_dir.path)!r})).claim() is None; print('held', flush=True); time.sleep(30)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        assert f"another job (pid {holder.pid}) is running in it" == run_dir.claim()
    finally:
        holder.kill()
        holder.wait()
    assert run_dir.claim() is None  # the kernel released the dead job's lock
    assert run_dir.claim() is None  # and claiming again in the same process is a no-op


# ----------------------------------------------------------------------------- end to end
def _train(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_jobs_into_one_directory_one_is_refused_the_other_intact(isolated_env, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SHORT, "train.max_steps=20", f"hydra.run.dir={run_dir}"]
    first = _train(*args, env=isolated_env)
    time.sleep(0.5)
    second = _train(*args, env=isolated_env)
    _, second_err = second.communicate(timeout=600)
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err[-3000:]
    assert second.returncode == 2
    errors = [line for line in second_err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: hydra.run.dir={run_dir}: another job (pid {first.pid}) is running in it; wait for it to "
                      "end, or choose another directory"]  # fmt: skip
    assert "Traceback" not in second_err
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 21))  # one line per step, from one job
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run that completed its 4 steps, with its final checkpoint."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env["VLM_LAUNCHER_CACHE"] = str(ROOT / "outputs" / "cache")
    result = subprocess.run(
        [sys.executable, "train.py", *SHORT, "train.max_steps=4", "train.save_every=2", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["resume={run}"], 0, "resume: {run} already finished at step 4 (train.max_steps=4); nothing to train"),
        (["resume=auto", "hydra.run.dir={run}"], 0, "resume: {run} already finished at step 4"),
        (
            ["resume={run}", "train.max_steps=2"],
            2,
            "error: train.max_steps=2 is below step 4 of the checkpoint step4 this resume continues",
        ),
    ],
    ids=["resume-dir", "resume-auto", "fewer-steps"],
)
def test_resuming_a_finished_run_leaves_it_as_it_was(run_train, finished, tmp_path, args, code, message):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = _files(run)
    result = run_train(*[arg.format(run=run) for arg in args], timeout=300)
    assert result.returncode == code, result.stderr[-3000:]
    assert message.format(run=run) in result.stderr
    assert "Traceback" not in result.stderr
    assert _files(run) == before  # summary, metrics, checkpoints, model, .hydra: untouched


@pytest.mark.slow
def test_a_dry_run_of_a_resume_leaves_the_runs_command_line_and_the_next_resume_trains(run_train, finished, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = _files(run)
    dry = run_train(f"resume={run}", "train.max_steps=6", "dry_run=true", timeout=300)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"dry run: wrote {run / 'ds_config.json'}; nothing trained" in dry.stderr
    after = _files(run)
    assert {name: data for name, data in after.items() if name != "ds_config.json"} == {
        name: data for name, data in before.items() if name != "ds_config.json"
    }  # .hydra/, summary, metrics, checkpoints: untouched; the plan shown is written, as a dry run does
    real = run_train(f"resume={run}", "train.max_steps=6", timeout=600)
    assert real.returncode == 0, real.stderr[-3000:]
    assert _summary(run)["steps"] == 6 and _summary(run)["resumed_from_step"] == 4


# ----------------------------------------------------------------------------- how a job ends
def _wait_for(predicate, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.05)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_while_the_job_is_planned_is_recorded(isolated_env, tmp_path, signum):
    """Stopped before any rank started: summary "interrupted", exit 143, one line, no traceback."""
    import signal

    run_dir = tmp_path / "run"
    job = _train(*SHORT, "train.max_steps=5", f"hydra.run.dir={run_dir}", env=isolated_env)
    _wait_for(lambda: (run_dir / ".hydra" / "config.yaml").exists())  # Hydra is done: run_job plans now
    time.sleep(1.0)  # into the plan (DeepSpeed's import and the memory estimate take seconds)
    job.send_signal(getattr(signal, signum))
    _, err = job.communicate(timeout=300)
    summary = _summary(run_dir)
    if summary["status"] == "preempted":  # the ranks had started already: they stopped cleanly instead
        assert job.returncode == 143
        return
    assert job.returncode == 143, err[-3000:]
    assert f"error: stopped by {signum} before training started; start the job again" in err
    assert "Traceback" not in err
    assert summary["status"] == "interrupted" and signum in summary["error"]


@pytest.mark.slow
def test_a_signal_while_the_model_loads_stops_at_the_first_step_with_a_checkpoint(isolated_env, tmp_path):
    import signal

    run_dir = tmp_path / "run"
    job = _train(*SHORT, "train.max_steps=50", f"hydra.run.dir={run_dir}", env=isolated_env)
    _wait_for(lambda: (run_dir / "job.json").exists())  # the plan is written: the rank is starting
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    summary = _summary(run_dir)
    assert summary["status"] == "preempted" and summary["steps"] >= 1
    assert (run_dir / "checkpoints" / f"step{summary['steps']}" / "launcher_complete.json").is_file()


@pytest.mark.slow
def test_a_rank_killed_by_the_kernel_is_recorded_and_leaves_no_process(isolated_env, tmp_path):
    """What the out-of-memory killer does: SIGKILL to the rank. The launcher records it; nothing lingers."""
    import psutil

    run_dir = tmp_path / "run"
    job = _train(*SHORT, "train.max_steps=500", "data.num_workers=2", f"hydra.run.dir={run_dir}", env=isolated_env)
    _wait_for(lambda: (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip())
    launcher = psutil.Process(job.pid)
    rank = next(p for p in launcher.children() if "launcher.launch.worker" in " ".join(p.cmdline()))
    family = [rank, *rank.children(recursive=True)]  # the rank and its DataLoader workers
    rank.kill()
    _, err = job.communicate(timeout=300)
    assert job.returncode == 1, err[-3000:]
    line = "a rank was killed by SIGKILL (the kernel's out-of-memory killer sends it when memory runs out"
    assert line in err and "Traceback" not in err
    summary = _summary(run_dir)
    assert summary["status"] == "failed" and line in summary["error"]
    _, alive = psutil.wait_procs(family, timeout=15)
    assert alive == []


# ----------------------------------------------------------------------------- credentials
@pytest.mark.slow
def test_credentials_reach_no_file_a_run_writes(isolated_env, tmp_path):
    """Fake credentials in deepspeed_extra, Hydra's env_set and the environment; every file is grepped
    (checkpoints, the final model, Hydra's files, W&B's offline run). That the ranks put the real
    values back is `test_the_ranks_get_the_real_values_back`."""
    comet_key = "sk-" + "c" * 32
    hf_token = "hf_" + "h" * 30
    wandb_key = "w" * 40
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "train.py",
            "train.max_steps=2",
            "train.save_every=1",
            "train.micro_batch_size=4",
            "train.eval_every=0",
            "data.eval_accuracy=false",
            "+deepspeed_extra.comet.enabled=false",
            f"+deepspeed_extra.comet.api_key={comet_key}",
            f"+hydra.job.env_set.HF_TOKEN={hf_token}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=ROOT,
        env={**isolated_env, "WANDB_API_KEY": wandb_key, "WANDB_DIR": str(run_dir)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert any(path.suffix == ".pt" for path in files) and any("wandb" in path.parts for path in files)
    for path in files:
        content = path.read_bytes()
        for secret in (comet_key, hf_token, wandb_key):
            assert secret.encode() not in content, f"{secret[:6]}... in {path.relative_to(run_dir)}"
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert ds_config["comet"]["api_key"] == "<redacted>"


def test_the_ranks_get_the_real_values_back(tmp_path, monkeypatch):
    """What the launcher writes and hands over, and what a rank rebuilds from it, as the recipe does."""
    from launcher.config.precision import Device
    from launcher.config.ds_config import build_ds_config
    from launcher.core import credentials
    from tests.conftest import compose_plain

    base = tmp_path / "ds.json"
    base.write_text(json.dumps({"wandb": {"enabled": False, "api_key": "sk-" + "b" * 30}}))
    overrides = [f"deepspeed_json={base}", "+deepspeed_extra.comet.enabled=false", "+deepspeed_extra.comet.api_key=k1"]
    cfg = compose_plain(overrides)
    from launcher.job.spec import load_deepspeed_json

    device = Device("cpu", bf16=True, fp16=False)
    real = build_ds_config(cfg, world_size=1, hidden_size=64, device=device, base=load_deepspeed_json(str(base)))
    on_disk = json.loads(json.dumps(credentials.split(real)[0]))
    assert on_disk["comet"]["api_key"] == on_disk["wandb"]["api_key"] == "<redacted>"
    public_cfg, cfg_secrets = credentials.split(cfg)
    assert public_cfg["deepspeed_extra"]["comet"]["api_key"] == "<redacted>"
    monkeypatch.setenv(*next(iter(credentials.for_ranks(cfg_secrets).items())))
    rank_cfg = credentials.restore(json.loads(json.dumps(public_cfg)), credentials.from_environment())
    assert rank_cfg == cfg
    assert credentials.restore(on_disk, credentials.of_deepspeed_dict(rank_cfg)) == real


@pytest.mark.slow
def test_a_resume_that_fails_to_load_leaves_the_runs_summary_alone(run_train, finished, tmp_path):
    """Damage the file sizes cannot show (a marker written before they were recorded): DeepSpeed's load
    fails on the rank, one line names the checkpoint, and the run's summary still says "completed"."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    marker = run / "checkpoints" / "step4" / "launcher_complete.json"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}))
    states = next((run / "checkpoints" / "step4").glob("mp_rank_00_model_states.pt"))
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    summary_before = (run / "summary.json").read_bytes()
    result = run_train(f"resume={run}", "train.max_steps=6", timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"cannot load checkpoint {run}/checkpoints/step4" in errors[0]
    assert "Traceback" not in result.stderr
    assert (run / "summary.json").read_bytes() == summary_before
