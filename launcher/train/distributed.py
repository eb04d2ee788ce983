"""This rank's place in the job, and the few collectives the trainer runs itself.

The rank's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is set by whoever
started the process: torchrun, DeepSpeed's launcher, the launcher's own child process
(launcher.launch.ranks), or a test. On a GPU each rank takes the device of its LOCAL_RANK.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from launcher.core.errors import LauncherError
from launcher.job.spec import Job
from launcher.train.ops import prepare_ops

# GiB a rank's CUDA allocator may hold: launcher.tune sets it for its candidates on a GPU (in the ranks'
# environment), so a candidate over the budget meets a real CUDA out-of-memory error.
CUDA_MEMORY_CAP_ENV = "LAUNCHER_CUDA_MEMORY_GB"


@dataclass(frozen=True)
class Rank:
    """This process's place in the job."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(job: Job) -> tuple[Rank, bool]:
    """Join the job's process group (NCCL on a GPU, gloo on a CPU, or dist.backend) and take a device;
    whether this call created the group (then its caller destroys it: `destroy`). A process that trains
    several jobs (a test) creates the group once and keeps it: DeepSpeed caches its groups per process."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    _quiet_libraries()
    prepare_ops()
    accelerator = get_accelerator()
    backend = str(job.config.dist.backend)
    if backend == "auto":
        backend = "nccl" if accelerator.device_name() == "cuda" else "gloo"
    created = not torch.distributed.is_initialized()
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=int(job.config.dist.timeout_s)))
    device = torch.device("cpu")
    if accelerator.device_name() == "cuda":
        local_rank = gpu_index(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        cap_gb = os.environ.get(CUDA_MEMORY_CAP_ENV)
        if cap_gb:  # the autotuner's budget on a GPU: the allocator refuses past it (a real CUDA OOM)
            total = torch.cuda.get_device_properties(local_rank).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap_gb) * 2**30 / total), local_rank)
    return Rank(torch.distributed.get_rank(), torch.distributed.get_world_size(), device), created


def gpu_index(local_rank: int, visible: int) -> int:
    """The GPU a rank takes: its LOCAL_RANK's among the GPUs it sees, or the only one it sees (SLURM binding one
    GPU to each task, `--gpus-per-task=1` or `--gpu-bind`, while LOCAL_RANK still counts the node's tasks)."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise LauncherError(
        f"LOCAL_RANK={local_rank}, but this rank sees {visible} GPUs (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most one rank per GPU it can see "
        "(dist.nproc_per_node), or give each rank one GPU"
    )


def _quiet_libraries() -> None:
    """DeepSpeed logs every config key at INFO and torch warns about its own deprecations per call."""
    from deepspeed.utils import logger as deepspeed_logger

    deepspeed_logger.setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.distributed.*")


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """The values summed over the ranks (one collective; none on one rank)."""
    return _all_reduce(values, device, torch.distributed.ReduceOp.SUM)


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Each value at its largest over the ranks (one collective; none on one rank)."""
    return _all_reduce(values, device, torch.distributed.ReduceOp.MAX)


def _all_reduce(values: list[float], device: torch.device, op: Any) -> list[float]:
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)  # exact for integers below 2^53
    torch.distributed.all_reduce(tensor, op=op)
    return tensor.tolist()


def any_rank(flag: bool, device: torch.device | None = None) -> bool:
    """Whether `flag` is set on any rank (one collective, on `device` or the CPU; none on one rank)."""
    return all_reduce_sum([float(flag)], device or torch.device("cpu"))[0] > 0


def barrier() -> None:
    if torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


@contextlib.contextmanager
def main_process_first(rank: Rank) -> Iterator[None]:
    """Rank 0 runs the block first (builds what is missing: the built-in data, a data cache); the others
    wait, then run it too and find the build done."""
    if not rank.is_main:
        barrier()
    yield
    if rank.is_main:
        barrier()


def destroy() -> None:
    """Leave the process group. Without this, rank 0 aborts at exit ("terminate called without an active
    exception")."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
