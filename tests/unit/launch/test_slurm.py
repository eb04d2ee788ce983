"""launcher.launch.slurm: a SLURM task's rank environment (SLURM's variables, or submitit's local
executor's), its launch id, and how the tasks other than global rank 0 wait for rank 0's plan."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from launcher.core.errors import LauncherError
from launcher.core.rank_errors import record_rank_error
from launcher.core.rundir import RunDir
from launcher.launch import slurm
from tests.helpers import compose_typed


@pytest.fixture(scope="module")
def dist():
    """dist=slurm's settings, typed."""
    return compose_typed(["dist=slurm"]).dist


@pytest.fixture
def scheduler_env(monkeypatch):
    """Set exactly these SLURM_/SUBMITIT_ variables (none of the machine's own), and no thread counts."""

    def set_env(variables: dict[str, str]) -> None:
        for name in list(os.environ):
            if name.startswith(("SLURM_", "SUBMITIT_")) or name == "OMP_NUM_THREADS":
                monkeypatch.delenv(name)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return set_env


# Task 5 of 8 (2 nodes x 4 tasks).
TASK_5_OF_8 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
}


def test_the_rank_environment_of_a_slurm_task(dist, scheduler_env):
    """Rank, local rank, world size, master = the first host of the node list, a port every task derives
    from the job id, and the task's share of the node's cores."""
    scheduler_env(TASK_5_OF_8)
    assert slurm.rank_env(dist) == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu007",
        "MASTER_PORT": str(20000 + 4242),
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 4)),
    }
    # A port given by the user wins; every task computes the same one either way.
    assert slurm.rank_env(compose_typed(["dist=slurm", "dist.master_port=12345"]).dist)["MASTER_PORT"] == "12345"


def test_a_task_gets_the_threads_slurm_gives_it_unless_omp_num_threads_is_set(dist, scheduler_env, monkeypatch):
    scheduler_env({**TASK_5_OF_8, "SLURM_CPUS_PER_TASK": "6"})
    assert slurm.rank_env(dist)["OMP_NUM_THREADS"] == "6"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert slurm.rank_env(dist)["OMP_NUM_THREADS"] == "3"


def test_the_rank_environment_under_submitits_local_executor(dist, scheduler_env):
    scheduler_env(
        {
            "SUBMITIT_EXECUTOR": "local",
            "SUBMITIT_LOCAL_JOB_ID": "777",
            "SUBMITIT_LOCAL_NTASKS": "2",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_GLOBALID": "1",
            "SUBMITIT_LOCAL_LOCALID": "1",
        }
    )
    env = slurm.rank_env(dist)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "1", "2", "20777")
    assert slurm.global_rank(dist) == 1


def test_without_a_slurm_environment_the_rank_environment_is_one_clear_error(dist, scheduler_env):
    scheduler_env({})
    with pytest.raises(LauncherError, match="no SLURM task environment"):
        slurm.rank_env(dist)


def test_global_rank_and_launch_id_only_under_slurm(dist, scheduler_env, monkeypatch):
    local = compose_typed([]).dist
    scheduler_env({})
    assert slurm.global_rank(dist) is None and slurm.launch_id(dist) is None  # not in a SLURM task
    scheduler_env(TASK_5_OF_8)
    assert slurm.global_rank(dist) == 5
    assert slurm.global_rank(local) is None and slurm.launch_id(local) is None  # another launcher
    # A requeued job keeps its id: the restart count tells its launches apart.
    assert slurm.launch_id(dist) == "4242.0"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    assert slurm.launch_id(dist) == "4242.3"


def test_the_slurm_preset_drives_hydras_submitit_launcher():
    from launcher.config.compose import compose, without_hydra

    overrides = ["dist=slurm", "dist.nnodes=2", "dist.nproc_per_node=8"]
    cfg, hydra = without_hydra(compose(overrides, with_hydra=True))
    assert cfg.dist.launcher == "slurm"
    assert hydra.launcher._target_.endswith("SlurmLauncher")
    assert (hydra.launcher.nodes, hydra.launcher.tasks_per_node, hydra.launcher.gpus_per_node) == (2, 8, 8)


# ----------------------------------------------------------------------------- waiting for rank 0's plan
def write_plan(run_dir: RunDir, launch: str) -> None:
    run_dir.path.mkdir(parents=True, exist_ok=True)
    run_dir.job.write_text(json.dumps({"version": 2, "launch_id": launch}))


def test_a_task_waits_for_the_plan_of_its_own_launch(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    write_plan(run_dir, "41.0")  # the previous launch's plan: not this one's
    writer = threading.Timer(0.5, write_plan, (run_dir, "41.1"))
    writer.start()
    started = time.time()
    try:
        assert slurm.wait_for_plan(run_dir, "41.1", timeout_s=30)["launch_id"] == "41.1"
    finally:
        writer.cancel()
    assert 0.4 <= time.time() - started < 10


def test_rank_zeros_planning_error_of_this_launch_ends_the_wait_with_its_line_and_code(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    write_plan(run_dir, "41.0")
    record_rank_error(run_dir, 0, "an old launch's error", 2, "trace", launch="41.0")
    with pytest.raises(LauncherError, match="did not plan the job within") as waited:
        slurm.wait_for_plan(run_dir, "41.1", timeout_s=0.5)  # neither the old plan nor the old error is this one's
    assert waited.value.exit_code == 1 and str(run_dir.job) in str(waited.value)

    record_rank_error(run_dir, 0, "data.path=/nope: no such file", 2, "trace", launch="41.1")
    with pytest.raises(LauncherError, match=r"^data.path=/nope: no such file$") as refused:
        slurm.wait_for_plan(run_dir, "41.1", timeout_s=30)
    assert refused.value.exit_code == 2
