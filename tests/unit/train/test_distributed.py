"""launcher.train.distributed: a rank joins its job's process group, and the few collectives the trainer
runs itself (one rank in this process, on the `process_group` fixture's gloo group; two in subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from launcher.config.precision import Device
from launcher.job.planning import plan_job
from launcher.launch.ranks import free_port
from launcher.train.distributed import Rank, all_reduce_sum, barrier, init_distributed, main_process_first
from tests.helpers import ROOT, compose_typed, hydra_job


def test_a_rank_joins_the_group_it_finds_and_does_not_own_it(process_group, tmp_path):
    """A process that trains several jobs (a test, the tuner) keeps its group: the trainer destroys only a
    group it created."""
    job = plan_job(
        compose_typed(["logger=none"]),
        hydra_job(["logger=none"], tmp_path),
        device=Device("cpu", bf16=True, fp16=False),
        hidden_size=64,
        validate=False,
    )
    rank, created = init_distributed(job)
    assert rank == Rank(rank=0, world_size=1, device=torch.device("cpu")) and rank.is_main
    assert not created and torch.distributed.is_initialized()


def test_one_rank_runs_no_collective(process_group):
    assert all_reduce_sum([1.5, 2.0, 0.0], torch.device("cpu")) == [1.5, 2.0, 0.0]
    barrier()
    ran = []
    with main_process_first(Rank(0, 1, torch.device("cpu"))):
        ran.append("body")
    assert ran == ["body"]


RANK = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from launcher.train.distributed import Rank, all_reduce_sum, main_process_first

rank, marker = int(sys.argv[1]), Path(sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2)
print(all_reduce_sum([rank + 1.0, 1.0], torch.device("cpu")), flush=True)
with main_process_first(Rank(rank, 2, torch.device("cpu"))):
    if rank == 0:
        time.sleep(1.0)  # rank 1 must wait for this block, however long it takes
        marker.write_text("built")
    else:
        print(marker.read_text(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two processes that import torch: several seconds on two cores
def test_two_ranks_sum_over_the_group_and_rank_zero_builds_first(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(tmp_path / "built")],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [process.communicate(timeout=120) for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
    assert outputs[0][0].splitlines() == ["[3.0, 2.0]"]
    assert outputs[1][0].splitlines() == ["[3.0, 2.0]", "built"]  # rank 0's block had ended


def test_a_rank_takes_its_local_ranks_gpu_or_the_only_one_it_sees():
    from launcher.core.errors import LauncherError
    from launcher.train.distributed import gpu_index

    assert [gpu_index(local, 8) for local in (0, 3, 7)] == [0, 3, 7]  # torchrun, DeepSpeed's launcher: all GPUs
    assert gpu_index(5, 1) == 0  # SLURM with one GPU bound to each task: LOCAL_RANK still counts the tasks
    with pytest.raises(LauncherError, match=r"LOCAL_RANK=4, but this rank sees 2 GPUs .*dist.nproc_per_node"):
        gpu_index(4, 2)
