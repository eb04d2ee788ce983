"""Start the ranks: in this process for one rank, through torch's own launcher (torchrun) for several.

Every rank reads the same run directory (written by the Hydra job before this is called), so all
ranks of a job share one output directory and none of them parses a Hydra command line.
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

from launcher.errors import LauncherError, TrainingFailed
from launcher.rundir import SUMMARY_FILE, read_json

STOP_FILE = "stop_requested"  # launcher.checkpoint.STOP_FILE, without importing torch here
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
    if cfg.dist.master_port is None:
        return free_port(cfg.dist.master_addr)
    port = int(cfg.dist.master_port)
    if cfg.dist.nnodes == 1 and not port_is_free(cfg.dist.master_addr, port):
        raise LauncherError(
            f"dist.master_port={port} is already in use on {cfg.dist.master_addr}: pick another port, or "
            "leave dist.master_port=null to get a free one"
        )
    return port


def _single_rank_env(cfg: DictConfig, port: int) -> dict[str, str]:
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": str(cfg.dist.master_addr),
        "MASTER_PORT": str(port),
    }


def launch(cfg: DictConfig, run_dir: Path, *, isolate: bool = False) -> dict[str, Any]:
    """Train with the job planned in `run_dir`; returns rank 0's summary.

    One rank runs in this process, unless `isolate` (set for the jobs of a sweep): DeepSpeed keeps
    process-group state in module globals that a second job in the same process would trip over,
    and a crashing job must not take the sweep down with it.
    """
    if cfg.dist.launcher != "local":
        raise LauncherError(f"dist.launcher={cfg.dist.launcher} is unknown: use dist=local")
    nproc = int(cfg.dist.nproc_per_node)
    port = _master_port(cfg)
    stop_file = run_dir / STOP_FILE
    stop_file.unlink(missing_ok=True)  # left by an earlier, preempted segment of this run
    env = dict(os.environ)
    if nproc == 1 and cfg.dist.nnodes == 1:
        if not isolate:
            os.environ.update(_single_rank_env(cfg, port))
            from launcher.train_loop import train

            return train(cfg, run_dir)
        command = [sys.executable, "-m", "launcher.worker", str(run_dir)]
        env.update(_single_rank_env(cfg, port))
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--nnodes={cfg.dist.nnodes}",
            f"--master_addr={cfg.dist.master_addr}",
            f"--master_port={port}",
            "-m",
            "launcher.worker",
            str(run_dir),
        ]
        # torchrun would give each rank 1 thread; share the cores between the ranks instead.
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    completed = _run_forwarding_stop_signals(command, env, stop_file)
    summary_path = run_dir / SUMMARY_FILE
    summary = read_json(summary_path) if summary_path.is_file() else {}
    if completed.returncode != 0 or summary.get("status") not in ("completed", "preempted"):
        error = summary.get("error") or f"training exited with code {completed.returncode}"
        # A worker that stopped on a user's mistake (bad data, say) exits 2, as the launcher would.
        raise (LauncherError if completed.returncode == 2 else TrainingFailed)(error)
    return summary


def _run_forwarding_stop_signals(
    command: list[str], env: dict[str, str], stop_file: Path
) -> subprocess.CompletedProcess:
    """Run the ranks; SIGTERM/SIGUSR1 to this process become `stop_file`, which every rank checks per step.

    Passing the signal on to torchrun instead would make it kill its ranks before they can save."""

    def request_stop(signum: int, _frame: object) -> None:
        stop_file.touch()

    previous = {signum: signal.signal(signum, request_stop) for signum in STOP_SIGNALS}
    try:
        return subprocess.run(command, env=env, check=False)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
