"""SLURM: every task of the job is a rank (`python train.py -m dist=slurm ...` through Hydra's submitit
launcher, or your own `srun python train.py dist=slurm ...`).

Planning is once-per-job work: global rank 0 plans the job and writes job.json (carrying this launch's
id); the other tasks wait for that plan on the shared run directory (`follow_rank_zero`), or for rank
0's error record when planning failed, and then each starts its rank as a child process, as every
launcher does (launcher.launch.ranks).
"""

from __future__ import annotations

import os
import time
from typing import Any

from launcher.config.schema import DistConfig
from launcher.core.errors import LauncherError
from launcher.core.json_files import read_json_or_none
from launcher.core.rank_errors import read_rank_error
from launcher.core.rundir import RunDir


def job_environment() -> Any | None:
    """submitit's view of this SLURM task (or of its local executor's), None outside SLURM."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        from submitit import JobEnvironment

        return JobEnvironment()
    if "SLURM_PROCID" in os.environ and "SLURM_JOB_ID" in os.environ:
        from submitit.slurm.slurm import SlurmJobEnvironment

        return SlurmJobEnvironment()
    return None


def global_rank(dist: DistConfig) -> int | None:
    """This task's global rank under dist=slurm (None for other launchers, or outside a SLURM task)."""
    if str(dist.launcher) != "slurm":
        return None
    job = job_environment()
    return None if job is None else int(job.global_rank)


def launch_id(dist: DistConfig) -> str | None:
    """What tells one start of a SLURM job from the next (a requeue keeps the job id, not the count)."""
    if str(dist.launcher) != "slurm" or (job := job_environment()) is None:
        return None
    return f"{job.job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def rank_env(dist: DistConfig) -> dict[str, str]:
    """This task's rank environment from SLURM's (or submitit's local executor's) variables.

    submitit's JobEnvironment reads them (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID,
    and SLURM_JOB_NODELIST, whose first host is the master); outside submitit (`srun python train.py`)
    its SLURM reader is used directly. The port is dist.master_port, or one derived from the job id so
    that every task of the job agrees without talking to the others. Every task would use all of the
    node's cores: each gets its share (SLURM's, when it says)."""
    job = job_environment()
    if job is None:
        raise LauncherError(
            "dist=slurm: no SLURM task environment (SLURM_PROCID, SLURM_JOB_ID): run with "
            "`python train.py -m dist=slurm ...` (submitit) or under `srun`"
        )
    tasks_per_node = job.num_tasks // max(job.num_nodes, 1)
    port = dist.master_port
    if port is None:
        digits = "".join(ch for ch in str(job.job_id) if ch.isdigit()) or "0"
        port = 20000 + int(digits) % 20000
    threads = os.environ.get("SLURM_CPUS_PER_TASK") or str(max(1, (os.cpu_count() or 1) // tasks_per_node))
    return {
        "RANK": str(job.global_rank),
        "LOCAL_RANK": str(job.local_rank),
        "WORLD_SIZE": str(job.num_tasks),
        "LOCAL_WORLD_SIZE": str(tasks_per_node),
        "MASTER_ADDR": job.hostnames[0],
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or threads,
    }


def wait_for_plan(run_dir: RunDir, wanted: str | None, timeout_s: float) -> dict[str, Any]:
    """job.json of this launch, written by global rank 0 once its plan is accepted; rank 0's error as a
    LauncherError (with its exit code) when its planning failed, or when nothing comes in time."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        job = read_json_or_none(run_dir.job)
        if isinstance(job, dict) and job.get("launch_id") == wanted:
            return job
        failure = read_rank_error(run_dir, 0)
        if failure is not None and failure.launch == wanted:
            error = LauncherError(failure.error)
            error.exit_code = failure.exit_code
            raise error
        time.sleep(0.2)
    error = LauncherError(
        f"global rank 0 did not plan the job within dist.timeout_s={timeout_s:g} s "
        f"(no {run_dir.job} for launch {wanted}); see rank 0's log"
    )
    error.exit_code = 1
    raise error
