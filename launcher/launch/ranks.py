"""Start the ranks of a job with an existing launcher: torch's, DeepSpeed's, or SLURM's (via submitit).

    dist=local      one rank in this process; N ranks on this machine through torchrun
    dist=torchrun   one torchrun per node (nnodes, node_rank, master_addr:master_port rendezvous)
    dist=deepspeed  DeepSpeed's launcher with a hostfile (ssh/pdsh to the other hosts)
    dist=slurm      one SLURM task per rank (Hydra's submitit launcher, or srun): each task is a rank

Every rank reads the same run directory (written by the Hydra job before this is called), so all
ranks of a job share one output directory and none of them parses a Hydra command line. A failing
rank records its error under `run_dir/errors/`; the launcher reports the earliest record (the cause)
as one line, instead of every rank's and the launcher's own tracebacks.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from launcher.core.children import die_with_parent
from launcher.core.errors import (
    Interrupted,
    LauncherError,
    TrainingFailed,
    clear_rank_errors,
    first_rank_error,
    step_failure,
    step_in_flight,
)
from launcher.core.rundir import RunDir, Summary, read_json
from launcher.job.spec import JobSpec

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _master_port(cfg: DictConfig) -> int:
    """The rendezvous port: free on this machine for single-node jobs, the user's for multi-node ones."""
    if cfg.dist.master_port is None:
        if cfg.dist.nnodes > 1:
            raise LauncherError(
                f"dist.master_port is not set: a job on {cfg.dist.nnodes} nodes needs the same port on every "
                "node (e.g. dist.master_port=29500)"
            )
        return free_port(cfg.dist.master_addr)
    port = int(cfg.dist.master_port)
    if cfg.dist.nnodes == 1 and not port_is_free(cfg.dist.master_addr, port):
        raise LauncherError(
            f"dist.master_port={port} is already in use on {cfg.dist.master_addr}: pick another port, or "
            "leave dist.master_port=null to get a free one"
        )
    return port


def _rank_env(rank: int, local_rank: int, world_size: int, local_world_size: int, addr: str, port: int) -> dict:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
    }


# ----------------------------------------------------------------------------- commands per launcher
def torchrun_command(cfg: DictConfig, run_dir: Path, port: int) -> list[str]:
    """torch's launcher (static rendezvous at master_addr:master_port), quieted by launcher.torchrun."""
    if not 0 <= cfg.dist.node_rank < cfg.dist.nnodes:
        raise LauncherError(
            f"dist.node_rank={cfg.dist.node_rank} must be between 0 and dist.nnodes-1={cfg.dist.nnodes - 1}"
        )
    return [
        sys.executable,
        "-m",
        "launcher.launch.torchrun",
        f"--nnodes={cfg.dist.nnodes}",
        f"--nproc-per-node={cfg.dist.nproc_per_node}",
        f"--node-rank={cfg.dist.node_rank}",
        f"--master-addr={cfg.dist.master_addr}",
        f"--master-port={port}",
        "-m",
        "launcher.launch.worker",
        str(run_dir),
    ]


def hostfile_ranks(cfg: DictConfig) -> dict[str, list[int]]:
    """The hosts and slots DeepSpeed's launcher will use: its own hostfile parser and include/exclude."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_inclusion_exclusion

    path = Path(str(cfg.dist.hostfile)).expanduser()
    if not path.is_file():
        raise LauncherError(f"dist.hostfile={cfg.dist.hostfile}: no such file (lines of 'HOST slots=N')")
    try:
        pool = fetch_hostfile(str(path))
        return parse_inclusion_exclusion(pool, cfg.dist.include, cfg.dist.exclude)
    except (ValueError, AssertionError) as err:
        raise LauncherError(f"dist.hostfile={cfg.dist.hostfile}: {err}") from None


def deepspeed_command(cfg: DictConfig, run_dir: Path, port: int) -> list[str]:
    """DeepSpeed's launcher (`deepspeed --hostfile ...`), which reaches other hosts with pdsh/ssh."""
    if not cfg.dist.hostfile:
        raise LauncherError("dist=deepspeed needs dist.hostfile=PATH (lines of 'HOST slots=N')")
    hosts = hostfile_ranks(cfg)
    world = sum(len(slots) for slots in hosts.values())
    from launcher.job.spec import world_size_of

    planned = world_size_of(cfg)
    if world != planned:
        raise LauncherError(
            f"dist.hostfile={cfg.dist.hostfile} gives {world} ranks on {len(hosts)} host(s) "
            f"({', '.join(f'{h}: {len(s)}' for h, s in hosts.items())}), but the job was planned for "
            f"dist.nnodes={cfg.dist.nnodes} x dist.nproc_per_node={cfg.dist.nproc_per_node} = {planned}: "
            "make them agree"
        )
    command = [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={cfg.dist.hostfile}"]
    if cfg.dist.include:
        command.append(f"--include={cfg.dist.include}")
    if cfg.dist.exclude:
        command.append(f"--exclude={cfg.dist.exclude}")
    if len(hosts) == 1:
        # One host: DeepSpeed starts the ranks here without ssh; its ssh check would fail needlessly.
        command.append("--no_ssh_check")
    command += [
        f"--master_addr={cfg.dist.master_addr}",
        f"--master_port={port}",
        "--module",
        "launcher.launch.worker",
        str(run_dir),
    ]
    return command


def _slurm_job_environment() -> Any | None:
    """submitit's view of this SLURM task (or of its local executor's), None outside SLURM."""
    if os.environ.get("SUBMITIT_EXECUTOR"):
        from submitit import JobEnvironment

        return JobEnvironment()
    if "SLURM_PROCID" in os.environ and "SLURM_JOB_ID" in os.environ:
        from submitit.slurm.slurm import SlurmJobEnvironment

        return SlurmJobEnvironment()
    return None


def slurm_global_rank(cfg: DictConfig) -> int | None:
    """This task's global rank under dist=slurm (None for other launchers, or outside a SLURM task)."""
    if cfg.dist.launcher != "slurm":
        return None
    job = _slurm_job_environment()
    return None if job is None else int(job.global_rank)


def launch_id(cfg: DictConfig) -> str | None:
    """What tells one start of a SLURM job from the next (a requeue keeps the job id, not the count)."""
    if cfg.dist.launcher != "slurm" or (job := _slurm_job_environment()) is None:
        return None
    return f"{job.job_id}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"


def slurm_rank_env(cfg: DictConfig) -> dict[str, str]:
    """This task's rank environment from SLURM's (or submitit's local executor's) variables.

    submitit's JobEnvironment reads them (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_NODEID,
    and SLURM_JOB_NODELIST, whose first host is the master); outside submitit (`srun python train.py`)
    its SLURM reader is used directly. The port is dist.master_port, or one derived from the job id so
    that every task of the job agrees without talking to the others."""
    job = _slurm_job_environment()
    if job is None:
        raise LauncherError(
            "dist=slurm: no SLURM task environment (SLURM_PROCID, SLURM_JOB_ID): run with "
            "`python train.py -m dist=slurm ...` (submitit) or under `srun`"
        )
    tasks_per_node = job.num_tasks // max(job.num_nodes, 1)
    port = cfg.dist.master_port
    if port is None:
        digits = "".join(ch for ch in str(job.job_id) if ch.isdigit()) or "0"
        port = 20000 + int(digits) % 20000
    return _rank_env(job.global_rank, job.local_rank, job.num_tasks, tasks_per_node, job.hostnames[0], int(port))


# ----------------------------------------------------------------------------- running them
def launch(cfg: DictConfig, spec: JobSpec, secret_env: dict[str, str] | None = None) -> Summary:
    """Train the job planned in its run directory; returns rank 0's summary.

    The ranks always run in child processes, and this process supervises them: whatever ends a rank
    (an exception, a signal, the kernel's out-of-memory killer), this process is left to record how
    the job ended in summary.json. The children die with it (PR_SET_PDEATHSIG), so none outlives it.
    `secret_env` hands the ranks the config's credentials, which the run directory's files leave out.
    """
    run_dir = spec.hydra.run_dir
    kind, nproc = cfg.dist.launcher, spec.ranks_per_node
    if kind == "local" and cfg.dist.nnodes > 1:
        raise LauncherError(f"dist=local runs on this machine only (dist.nnodes={cfg.dist.nnodes}): use dist=torchrun")
    if kind == "slurm":
        return train_as_slurm_task(cfg, run_dir, spec.world_size)

    port = _master_port(cfg)
    stop_file = RunDir(run_dir).stop_file
    if cfg.dist.node_rank == 0:
        stop_file.unlink(missing_ok=True)  # left by an earlier, preempted segment of this run
        clear_rank_errors(run_dir)
    env = {**os.environ, **(secret_env or {})}
    if kind == "local" and nproc == 1:
        command = [sys.executable, "-m", "launcher.launch.worker", str(run_dir)]
        env.update(_rank_env(0, 0, 1, 1, str(cfg.dist.master_addr), port))
    elif kind == "deepspeed":
        command = deepspeed_command(cfg, run_dir, port)
    else:
        command = torchrun_command(cfg, run_dir, port)
    # A launcher would give each rank 1 thread; share this machine's cores between its ranks instead.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        completed = _run_forwarding_stop_signals(command, env, stop_file)
    finally:
        _remove_shared_memory(str(cfg.dist.master_addr), port)
    return _outcome(run_dir, completed.returncode, node_rank=int(cfg.dist.node_rank))


def _remove_shared_memory(addr: str, port: int) -> None:
    """Delete what DeepSpeed's CPU all-reduce left in /dev/shm for this job (66 MB per rank).

    Its ranks remove these segments when they exit normally, not when they crash or are killed."""
    for segment in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        segment.unlink(missing_ok=True)


def train_as_slurm_task(cfg: DictConfig, run_dir: Path, planned_world_size: int) -> Summary:
    """Under SLURM every task is already a rank: set its environment and train in this process."""
    rank_env = slurm_rank_env(cfg)
    if int(rank_env["WORLD_SIZE"]) != planned_world_size:
        raise LauncherError(
            f"dist=slurm: SLURM started {rank_env['WORLD_SIZE']} tasks, but the job was planned for "
            f"dist.nnodes={cfg.dist.nnodes} x dist.nproc_per_node={cfg.dist.nproc_per_node} = {planned_world_size}"
        )
    os.environ.update(rank_env)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        # Every task would use all of the node's cores: give each its share (SLURM's, when it says).
        share = (os.cpu_count() or 1) // int(rank_env["LOCAL_WORLD_SIZE"])
        torch.set_num_threads(int(os.environ.get("SLURM_CPUS_PER_TASK") or 0) or max(1, share))
    from launcher.train.trainer import train

    return train(cfg, run_dir)


def _signal_name(returncode: int) -> str | None:
    """The signal that ended a process: negative return codes (subprocess), or 128 + N (shells, torchrun)."""
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else None
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def _outcome(run_dir: Path, returncode: int, node_rank: int = 0) -> Summary:
    """Rank 0's summary when the ranks succeeded; else the first failing rank's error, as one exception."""
    summary = RunDir(run_dir).read_summary()
    if returncode == 0 and node_rank > 0:
        # Another node's launcher: rank 0 (on node 0) writes the summary, maybe on another disk.
        return summary or Summary(status="completed")
    if returncode == 0 and summary is not None and summary.status in ("completed", "preempted"):
        return summary
    first = first_rank_error(run_dir)
    if first is not None:
        if first["exit_code"] == 2:  # a user's mistake (bad data, say): the same line as with one rank
            raise LauncherError(first["error"])
        raise TrainingFailed(f"rank {first['rank']}: {first['error']} (traceback: {first['traceback']})")
    if summary is not None and summary.status == "interrupted":
        raise Interrupted(summary.error or "interrupted")
    killed = _signal_name(returncode)
    if killed is not None and not (summary and summary.error):
        oom = killed == "SIGKILL"
        hint = " (the kernel's out-of-memory killer sends it when memory runs out: see dmesg)" if oom else ""
        message = f"a rank was killed by {killed}{hint}"
        step = step_in_flight(run_dir)
        if step is not None:  # it died in a train step, too suddenly to record an error
            job = read_json(RunDir(run_dir).job)
            message = step_failure(message, step, int(job["world_size"]), job.get("zero_stage"))
        raise TrainingFailed(f"{message}; checkpoints saved before it resume with resume={run_dir}")
    error = (summary.error if summary else None) or f"training exited with code {returncode}"
    raise (LauncherError if returncode == 2 else TrainingFailed)(error)


def _run_forwarding_stop_signals(
    command: list[str], env: dict[str, str], stop_file: Path
) -> subprocess.CompletedProcess:
    """Run the ranks; SIGTERM/SIGUSR1/SIGUSR2 to this process become `stop_file`, read by every rank per step.

    Passing the signal on to torchrun instead would make it kill its ranks before they can save."""

    def request_stop(signum: int, _frame: object) -> None:
        stop_file.touch()

    previous = {signum: signal.signal(signum, request_stop) for signum in STOP_SIGNALS}
    try:
        return subprocess.run(command, env=env, check=False, preexec_fn=die_with_parent)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
