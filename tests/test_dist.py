"""The `dist` group: rank environments and launcher commands (fast), and each launcher end to end (slow).

Multi-node runs are simulated on this machine: two torchrun "nodes" of one rank each meeting at
127.0.0.1, DeepSpeed's launcher with a hostfile naming localhost, two `srun`-like tasks given SLURM's
variables, and Hydra's submitit launcher (its local executor) starting one task per rank. Each must
train ZeRO-3 to exactly the losses of one node with two ranks.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.core.errors import LauncherError
from launcher.job.spec import HydraJob, plan_job
from launcher.launch.ranks import deepspeed_command, free_port, launch, slurm_rank_env, torchrun_command
from tests.conftest import ROOT, compose_config
from tests.test_train_e2e import losses, summary

# ----------------------------------------------------------------------------- rank environments


def _scheduler_env(monkeypatch, variables: dict[str, str]) -> None:
    """Exactly these SLURM_/SUBMITIT_ variables (none of the machine's own)."""
    import os

    for name in list(os.environ):
        if name.startswith(("SLURM_", "SUBMITIT_")):
            monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def test_slurm_rank_mapping_from_a_slurm_environment(monkeypatch):
    """Task 5 of 8 (2 nodes x 4): rank, local rank, world size, master = first host of the node list."""
    _scheduler_env(
        monkeypatch,
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_NODEID": "1",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NODELIST": "gpu[007-008]",
        },
    )
    env = slurm_rank_env(compose_config(["dist=slurm"]))
    assert env == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": str(20000 + 4242),
    }
    # A port given by the user wins; every task computes the same one either way.
    assert slurm_rank_env(compose_config(["dist=slurm", "dist.master_port=12345"]))["MASTER_PORT"] == "12345"


def test_submitit_local_rank_mapping(monkeypatch):
    _scheduler_env(
        monkeypatch,
        {
            "SUBMITIT_EXECUTOR": "local",
            "SUBMITIT_LOCAL_JOB_ID": "777",
            "SUBMITIT_LOCAL_NTASKS": "2",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_GLOBALID": "1",
            "SUBMITIT_LOCAL_LOCALID": "1",
        },
    )
    env = slurm_rank_env(compose_config(["dist=slurm"]))
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1", "2", "20777")


def test_slurm_without_a_slurm_environment_is_one_clear_error(monkeypatch):
    _scheduler_env(monkeypatch, {})
    with pytest.raises(LauncherError, match="no SLURM task environment"):
        slurm_rank_env(compose_config(["dist=slurm"]))


def test_slurm_task_count_must_match_the_planned_world_size(monkeypatch, tmp_path):
    _scheduler_env(
        monkeypatch,
        {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},
    )
    with pytest.raises(LauncherError, match=r"SLURM started 4 tasks, but the job was planned for .* = 2"):
        _launch(["dist=slurm", "dist.nproc_per_node=2"], tmp_path)


def test_slurm_preset_drives_the_submitit_launcher():
    cfg = compose_config(["dist=slurm", "dist.nnodes=2", "dist.nproc_per_node=8"])
    assert cfg.dist.launcher == "slurm"
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        full = compose(
            "config", overrides=["dist=slurm", "dist.nnodes=2", "dist.nproc_per_node=8"], return_hydra_config=True
        )
    launcher = full.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)


# ----------------------------------------------------------------------------- launcher commands
def _launch(overrides: list[str], run_dir: Path):
    """Plan the job of OVERRIDES, as train.py does, and hand it to the launcher."""
    cfg = compose_config(overrides)
    return launch(cfg, plan_job(cfg, HydraJob(run_dir=run_dir, overrides=tuple(overrides))))


def test_torchrun_command_for_one_node_of_several():
    cfg = compose_config(["dist=torchrun", "dist.nnodes=4", "dist.nproc_per_node=8", "dist.node_rank=2"])
    command = torchrun_command(cfg, Path("/shared/run"), 29500)
    assert command[1:3] == ["-m", "launcher.launch.torchrun"]
    for flag in ("--nnodes=4", "--nproc-per-node=8", "--node-rank=2", "--master-addr=127.0.0.1", "--master-port=29500"):
        assert flag in command
    assert command[-3:] == ["-m", "launcher.launch.worker", "/shared/run"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dist=torchrun", "dist.node_rank=2"], "dist.node_rank=2 must be between 0 and dist.nnodes-1=1"),
        (["dist=torchrun", "dist.master_port=null"], "needs the same port on every node"),
        (["dist.nnodes=2"], "dist=local runs on this machine only"),
        (["dist=deepspeed"], "dist=deepspeed needs dist.hostfile=PATH"),
        (
            ["dist=deepspeed", "dist.hostfile=/nonexistent/hostfile"],
            "dist.hostfile=/nonexistent/hostfile: no such file",
        ),
    ],
)
def test_bad_dist_settings_are_one_clear_error(tmp_path, overrides, message):
    with pytest.raises(LauncherError, match=message):
        _launch(overrides, tmp_path)


def test_deepspeed_command_reads_the_hostfile_with_deepspeeds_parser(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=4\nnode2 slots=4\n")
    cfg = compose_config(
        [
            "dist=deepspeed",
            f"dist.hostfile={hostfile}",
            "dist.nnodes=2",
            "dist.nproc_per_node=4",
            "dist.master_addr=node1",
        ]
    )
    command = deepspeed_command(cfg, tmp_path / "run", 29500)
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert "--no_ssh_check" not in command  # two hosts: DeepSpeed reaches node2 over ssh
    assert command[-3:] == ["--module", "launcher.launch.worker", str(tmp_path / "run")]
    assert "--master_addr=node1" in command and "--master_port=29500" in command

    excluded = compose_config(
        ["dist=deepspeed", f"dist.hostfile={hostfile}", "dist.exclude=node2", "dist.nproc_per_node=4"]
    )
    assert "--no_ssh_check" in deepspeed_command(excluded, tmp_path / "run", 29500)  # only node1 left

    with pytest.raises(LauncherError, match=r"gives 8 ranks on 2 host\(s\) .* = 4: make them agree"):
        deepspeed_command(
            compose_config(["dist=deepspeed", f"dist.hostfile={hostfile}", "dist.nproc_per_node=4"]), tmp_path, 1
        )


# ----------------------------------------------------------------------------- end to end (slow)

STEPS = 4
RUN = [
    "logger=none",
    "deepspeed=z3",
    "train.micro_batch_size=8",
    f"train.max_steps={STEPS}",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
]


@pytest.fixture
def one_thread_env(isolated_env):
    # One thread per rank everywhere: the same arithmetic in every launcher, so losses match bitwise.
    return {**isolated_env, "OMP_NUM_THREADS": "1"}


def _train(args: list[str], env: dict[str, str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**env, **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(*processes: subprocess.Popen) -> None:
    outputs = [process.communicate(timeout=900)[0] for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory):
    """Losses of one node with two ranks (dist=local), computed on first use."""
    cache: list[list[float]] = []

    def get(env: dict[str, str]) -> list[float]:
        if not cache:
            run_dir = tmp_path_factory.mktemp("reference") / "run"
            _finish(_train([*RUN, "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}"], env))
            cache.append(losses(run_dir))
            assert len(cache[0]) == STEPS
        return cache[0]

    return get


def _two_torchrun_nodes(run_dir: Path, env: dict[str, str]) -> Path:
    port = free_port()
    common = [*RUN, "dist=torchrun", "dist.nnodes=2", "dist.nproc_per_node=1", f"dist.master_port={port}"]
    nodes = [_train([*common, f"dist.node_rank={n}", f"hydra.run.dir={run_dir}"], env) for n in (0, 1)]
    _finish(*nodes)
    return run_dir


def _deepspeed_hostfile(run_dir: Path, env: dict[str, str]) -> Path:
    hostfile = run_dir.parent / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    _finish(
        _train(
            [*RUN, "dist=deepspeed", f"dist.hostfile={hostfile}", "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}"],
            env,
        )
    )
    return run_dir


def _srun_tasks(run_dir: Path, env: dict[str, str]) -> Path:
    """What `srun --ntasks=2 python train.py dist=slurm ...` starts: two tasks, SLURM's variables set."""
    slurm = {"SLURM_JOB_ID": str(free_port()), "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    slurm["SLURM_JOB_NODELIST"] = "localhost"
    tasks = [
        _train(
            [*RUN, "dist=slurm", "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}"],
            env,
            {**slurm, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)},
        )
        for task in (0, 1)
    ]
    _finish(*tasks)
    return run_dir


def _submitit_local(run_dir: Path, env: dict[str, str]) -> Path:
    """Hydra's submitit launcher, local executor: the same code path as on SLURM, tasks on this machine."""
    sweep = run_dir.parent / "sweep"
    args = [*RUN, "dist=slurm", "dist.nproc_per_node=2", "hydra/launcher=submitit_local"]
    _finish(_train(["-m", *args, "hydra.launcher.gpus_per_node=0", f"hydra.sweep.dir={sweep}"], env))
    return sweep / "0"


@pytest.mark.slow
@pytest.mark.parametrize(
    "start", [_two_torchrun_nodes, _deepspeed_hostfile, _srun_tasks, _submitit_local], ids=lambda f: f.__name__[1:]
)
def test_every_launcher_trains_zero3_like_one_node_with_two_ranks(tmp_path, one_thread_env, two_rank_reference, start):
    reference = two_rank_reference(one_thread_env)
    run_dir = start(tmp_path / "run", one_thread_env)
    result = summary(run_dir)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert result["params_held_per_rank"] == [148512, 148512]  # ZeRO-3 partitions across the two ranks
    assert losses(run_dir) == reference


@pytest.mark.slow
def test_a_crashed_rank_stops_the_job_and_only_its_error_is_shown(run_train, tmp_path):
    run_dir = tmp_path / "run"
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    started = time.time()
    result = run_train(
        *RUN,
        "train.max_steps=50",
        "dist.nproc_per_node=2",
        f"hydra.run.dir={run_dir}",
        env={"LAUNCHER_TEST_FAULT": "1:3"},
        timeout=300,
    )
    elapsed = time.time() - started
    assert result.returncode == 1, result.stderr[-3000:]
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: rank 1: step 3: RuntimeError: fault injected by LAUNCHER_TEST_FAULT on rank 1 at step 3 "
        f"(traceback: {run_dir / 'errors' / 'rank1.txt'})"
    ]
    # No wall of tracebacks: neither the ranks' nor torchrun's failure report.
    assert "Traceback" not in output and "ChildFailedError" not in output and "Connection closed" not in output
    assert "fault injected" in (run_dir / "errors" / "rank1.txt").read_text()  # the full traceback is kept
    assert summary(run_dir)["status"] == "failed" and "rank 1" in summary(run_dir)["error"]
    assert not (run_dir / "model").exists()
    # DeepSpeed's CPU all-reduce segments (66 MB per rank) of the crashed ranks are removed.
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before
    # Bounded: rank 0 does not wait for a timeout (gloo's default is 30 minutes).
    assert elapsed < 120, f"took {elapsed:.0f} s"


@pytest.mark.slow
def test_a_rank_that_dies_by_a_signal_mid_step_is_named_with_its_step(run_train, tmp_path):
    """gloo and NCCL end a rank with SIGABRT (a collective that received other sizes than it expected),
    and torchrun then terminates the others: no rank may record an error. The step is still named."""
    run_dir = tmp_path / "run"
    result = run_train(
        *RUN,
        "train.max_steps=50",
        "dist.nproc_per_node=2",
        f"hydra.run.dir={run_dir}",
        env={"LAUNCHER_TEST_FAULT": "1:3:abort"},
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    # Either rank 0 recorded the broken connection first, or nobody recorded and rank 1's step file names it.
    assert "step 3: " in errors[0] and "keep data.modality_guard on" in errors[0], errors[0]
    assert summary(run_dir)["status"] == "failed"
