"""Start the ranks of a job with an existing launcher, supervise them, and say how they ended.

    dist=local      one rank as a child process; N ranks on this machine through torchrun
    dist=torchrun   one torchrun per node (nnodes, node_rank, master_addr:master_port rendezvous)
    dist=deepspeed  DeepSpeed's launcher with a hostfile (ssh/pdsh to the other hosts)
    dist=slurm      one SLURM task per rank (launcher.launch.slurm): each task starts its rank

Every rank reads the same run directory (job.json, written by the launcher before this is called), so
all ranks of a job share one output directory and none of them parses a Hydra command line. The ranks
always run in child processes, and this process supervises them: whatever ends a rank (an exception,
a signal, the kernel's out-of-memory killer), this process is left to record how the job ended. A
failing rank records its error under `run_dir/errors/`; the launcher reports the earliest record (the
cause) as one line, instead of every rank's and the launcher's own tracebacks.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from launcher.config.schema import DistConfig
from launcher.core import disk
from launcher.core.children import die_with_parent
from launcher.core.errors import Interrupted, LauncherError, TrainingFailed
from launcher.core.rank_errors import clear_rank_errors, first_rank_error, step_failure, step_in_flight
from launcher.core.rundir import RunDir
from launcher.core.signals import STOP_SIGNALS, handling, name, remember
from launcher.core.summary import Summary
from launcher.job.spec import Job
from launcher.launch import slurm
from launcher.train.ops import interpreter_path

# Less free space than this where the run writes: a rank that failed without a record most likely could not
# write one (a checkpoint's next file alone is larger).
FULL_DISK_BYTES = 64 * 2**20
WORKER = "launcher.launch.worker"  # a rank's entry point: python -m launcher.launch.worker RUN_DIR


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


def master_port(dist: DistConfig) -> int:
    """The rendezvous port: free on this machine for single-node jobs, the user's for multi-node ones."""
    if dist.master_port is None:
        if dist.nnodes > 1:
            raise LauncherError(
                f"dist.master_port is not set: a job on {dist.nnodes} nodes needs the same port on every "
                "node (e.g. dist.master_port=29500)"
            )
        return free_port(dist.master_addr)
    port = int(dist.master_port)
    if dist.nnodes == 1 and not port_is_free(dist.master_addr, port):
        raise LauncherError(
            f"dist.master_port={port} is already in use on {dist.master_addr}: pick another port, or "
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
def torchrun_command(dist: DistConfig, run_dir: Path, port: int) -> list[str]:
    """torch's launcher (static rendezvous at master_addr:master_port), quieted by launcher.torchrun."""
    if not 0 <= dist.node_rank < dist.nnodes:
        raise LauncherError(f"dist.node_rank={dist.node_rank} must be between 0 and dist.nnodes-1={dist.nnodes - 1}")
    return [
        sys.executable,
        "-m",
        "launcher.launch.torchrun",
        f"--nnodes={dist.nnodes}",
        f"--nproc-per-node={dist.nproc_per_node}",
        f"--node-rank={dist.node_rank}",
        f"--master-addr={dist.master_addr}",
        f"--master-port={port}",
        "-m",
        WORKER,
        str(run_dir),
    ]


def hostfile_ranks(dist: DistConfig) -> dict[str, list[int]]:
    """The hosts and slots DeepSpeed's launcher will use: its own hostfile parser and include/exclude."""
    from deepspeed.launcher.runner import fetch_hostfile, parse_inclusion_exclusion

    path = Path(str(dist.hostfile)).expanduser()
    if not path.is_file():
        raise LauncherError(f"dist.hostfile={dist.hostfile}: no such file (lines of 'HOST slots=N')")
    try:
        pool = fetch_hostfile(str(path))
        return parse_inclusion_exclusion(pool, dist.include, dist.exclude)
    except (ValueError, AssertionError) as err:
        raise LauncherError(f"dist.hostfile={dist.hostfile}: {err}") from None


def deepspeed_command(dist: DistConfig, world_size: int, run_dir: Path, port: int) -> list[str]:
    """DeepSpeed's launcher (`deepspeed --hostfile ...`), which reaches other hosts with pdsh/ssh."""
    if not dist.hostfile:
        raise LauncherError("dist=deepspeed needs dist.hostfile=PATH (lines of 'HOST slots=N')")
    hosts = hostfile_ranks(dist)
    world = sum(len(slots) for slots in hosts.values())
    planned = world_size
    if world != planned:
        raise LauncherError(
            f"dist.hostfile={dist.hostfile} gives {world} ranks on {len(hosts)} host(s) "
            f"({', '.join(f'{h}: {len(s)}' for h, s in hosts.items())}), but the job was planned for "
            f"dist.nnodes={dist.nnodes} x dist.nproc_per_node={dist.nproc_per_node} = {planned}: "
            "make them agree"
        )
    # Warnings only: at its default (info) the runner and each node's launch print their world dicts and
    # commands, a dozen lines before the job's own (issue 44).
    command = [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={dist.hostfile}", "--log_level=warning"]
    if dist.include:
        command.append(f"--include={dist.include}")
    if dist.exclude:
        command.append(f"--exclude={dist.exclude}")
    if len(hosts) == 1:
        # One host: DeepSpeed starts the ranks here without ssh; its ssh check would fail needlessly.
        command.append("--no_ssh_check")
    command += [
        f"--master_addr={dist.master_addr}",
        f"--master_port={port}",
        "--module",
        WORKER,
        str(run_dir),
    ]
    return command


# ----------------------------------------------------------------------------- running them
def start_ranks(
    job: Job, run_dir: RunDir, *, env: Mapping[str, str], primary: bool = True, output: Path | None = None
) -> Summary:
    """Train the job planned in its run directory with the ranks this process starts; rank 0's summary.

    `env` joins the ranks' environment (credentials, the tuner's settings). `primary`: this is the launcher
    that owns the run (node 0, or global rank 0 under SLURM): it clears an earlier segment's stop request and
    error records. `output`: a file that gets the ranks' output (the terminal otherwise). The children die
    with this process (PR_SET_PDEATHSIG), so none outlives it."""
    dist, nproc = job.config.dist, job.ranks_per_node
    kind = str(dist.launcher)
    if kind == "local" and dist.nnodes > 1:
        raise LauncherError(f"dist=local runs on this machine only (dist.nnodes={dist.nnodes}): use dist=torchrun")
    if primary:
        run_dir.stop_file.unlink(missing_ok=True)  # left by an earlier, preempted segment of this run
        clear_rank_errors(run_dir)
    environment = {**os.environ, **env, "PATH": interpreter_path(os.environ.get("PATH", ""))}
    if kind == "slurm":
        ranks = slurm.rank_env(dist)
        if int(ranks["WORLD_SIZE"]) != job.world_size:
            raise LauncherError(
                f"dist=slurm: SLURM started {ranks['WORLD_SIZE']} tasks, but the job was planned for "
                f"dist.nnodes={dist.nnodes} x dist.nproc_per_node={dist.nproc_per_node} = {job.world_size}"
            )
        command, addr, port = (
            [sys.executable, "-m", WORKER, str(run_dir.path)],
            ranks["MASTER_ADDR"],
            ranks["MASTER_PORT"],
        )
        environment.update(ranks)
    else:
        addr, port = str(dist.master_addr), master_port(dist)
        if kind == "local" and nproc == 1:
            command = [sys.executable, "-m", WORKER, str(run_dir.path)]
            environment.update(_rank_env(0, 0, 1, 1, addr, port))
        elif kind == "deepspeed":
            command = deepspeed_command(dist, job.world_size, run_dir.path, port)
        else:
            command = torchrun_command(dist, run_dir.path, port)
        # A launcher would give each rank 1 thread; share this machine's cores between its ranks instead.
        environment.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        returncode = _run_forwarding_stop_signals(command, environment, run_dir, output)
    finally:
        _remove_shared_memory(addr, int(port))
    return outcome(job, run_dir, returncode, primary=primary)


def _remove_shared_memory(addr: str, port: int) -> None:
    """Delete what DeepSpeed's CPU all-reduce left in /dev/shm for this job (66 MB per rank).

    Its ranks remove these segments when they exit normally, not when they crash or are killed."""
    for segment in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        segment.unlink(missing_ok=True)


def _signal_name(returncode: int) -> str | None:
    """The signal that ended a process: negative return codes (subprocess), or 128 + N (shells, torchrun)."""
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else None
    try:
        return name(number) if number else None
    except ValueError:
        return None


def outcome(job: Job, run_dir: RunDir, returncode: int, *, primary: bool = True) -> Summary:
    """Rank 0's summary when the ranks succeeded; else the first failing rank's error, as one exception."""
    summary = run_dir.read_summary()
    if returncode == 0 and not primary:
        # Another node's launcher: rank 0 (on node 0) writes the summary, maybe on another disk.
        return summary or Summary(status="completed")
    if returncode == 0 and summary is not None and summary.status in ("completed", "preempted"):
        return summary
    first = first_rank_error(run_dir)
    if first is not None:
        if first.exit_code == Interrupted.exit_code:  # the ranks stopped on a signal before their first step
            raise Interrupted(first.error)
        if first.exit_code == 2:  # a user's mistake (bad data, say): the same line as with one rank
            raise LauncherError(first.error)
        raise TrainingFailed(f"rank {first.rank}: {first.error} (traceback: {first.traceback})")
    if summary is not None and summary.status == "interrupted":
        raise Interrupted(summary.error or "interrupted")
    killed = _signal_name(returncode)
    ender = run_dir.ended_by.read_text().strip() if run_dir.ended_by.is_file() else ""
    if killed is not None and ender:  # not a fault: whoever started the job ended it (launcher.tune)
        raise TrainingFailed(f"ended by {ender}: its ranks were stopped on purpose ({killed}), not by a fault")
    if killed is not None and not (summary and summary.error):
        oom = killed == "SIGKILL"
        hint = " (the kernel's out-of-memory killer sends it when memory runs out: see dmesg)" if oom else ""
        message = f"a rank was killed by {killed}{hint}"
        step = step_in_flight(run_dir)
        if step is not None:  # it died in a train step, too suddenly to record an error
            message = step_failure(message, step, job.world_size, job.zero_stage)
        raise TrainingFailed(f"{message}; checkpoints saved before it resume with resume={run_dir.path}")
    error = (summary.error if summary else None) or f"training exited with code {returncode}{_disk_full(run_dir)}"
    raise (LauncherError if returncode == 2 else TrainingFailed)(error)


def _disk_full(run_dir: RunDir) -> str:
    """Why a rank that failed may have recorded nothing: the run dir's disk is full (else "")."""
    free = disk.free_bytes(run_dir.path)
    if free is None or free >= FULL_DISK_BYTES:
        return ""
    return (
        f" and recorded no error: the disk of {run_dir.path} is full ({disk.said(free)}): free disk space, "
        f"then resume={run_dir.path} (complete checkpoints are kept; an incomplete one is never resumed from)"
    )


def _run_forwarding_stop_signals(command: list[str], env: dict[str, str], run_dir: RunDir, output: Path | None) -> int:
    """Run the ranks; a stop signal to this process becomes `stop_requested`, read by every rank per step.

    Passing the signal on to torchrun instead would make it kill its ranks before they can save."""

    def request_stop(signum: int, _frame: object) -> None:
        run_dir.stop_file.touch()
        remember(signum)  # a sweep's next job does not start

    with handling(STOP_SIGNALS, request_stop):
        if output is None:
            return subprocess.run(command, env=env, check=False, preexec_fn=die_with_parent).returncode
        with output.open("ab") as log:
            done = subprocess.run(
                command, env=env, check=False, preexec_fn=die_with_parent, stdout=log, stderr=subprocess.STDOUT
            )
        return done.returncode
