"""Several ranks, end to end: every launcher trains like one node with two ranks, and a failing rank is
reported as one line.

Multi-node runs are simulated on this machine: two torchrun "nodes" of one rank each meeting at
127.0.0.1, DeepSpeed's launcher with a hostfile naming localhost, two `srun`-like tasks given SLURM's
variables (each starts its rank as a child process; the second waits for the first's plan), and Hydra's
submitit launcher (its local executor) starting one task per rank. Each must train ZeRO-3 to exactly the
losses of one node with two ranks (dist=local, through torchrun). Two steps: the second step's loss
shows the first step's update, so two are enough to tell the launchers apart.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.train.faults import FAULT_ENV
from tests.helpers import ROOT, free_port, losses, read_summary, subprocess_env

pytestmark = pytest.mark.slow

STEPS = 2
RUN = [
    "logger=none",
    "deepspeed=z3",
    "train.micro_batch_size=8",
    f"train.max_steps={STEPS}",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    # One thread per rank everywhere: the same arithmetic in every launcher, so losses match bitwise.
    return {**subprocess_env(tmp_path_factory.mktemp("dist_env")), "OMP_NUM_THREADS": "1"}


def train(args: list[str], env: dict[str, str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**env, **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(*processes: subprocess.Popen) -> list[str]:
    outputs = [process.communicate(timeout=900)[0] for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-3000:]
    return outputs


@pytest.fixture(scope="module")
def two_rank_reference(tmp_path_factory, env) -> list[float]:
    """Losses of one node with two ranks (dist=local)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    finish(train([*RUN, "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}"], env))
    assert len(losses(run_dir)) == STEPS
    return losses(run_dir)


def two_torchrun_nodes(run_dir: Path, env: dict[str, str]) -> Path:
    port = free_port()
    common = [*RUN, "dist=torchrun", "dist.nnodes=2", "dist.nproc_per_node=1", f"dist.master_port={port}"]
    finish(*(train([*common, f"dist.node_rank={n}", f"hydra.run.dir={run_dir}"], env) for n in (0, 1)))
    return run_dir


def deepspeed_hostfile(run_dir: Path, env: dict[str, str]) -> Path:
    hostfile = run_dir.parent / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    args = [*RUN, "dist=deepspeed", f"dist.hostfile={hostfile}", "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}"]
    (output,) = finish(train(args, env))
    chatter = [line for line in output.splitlines() if "[INFO] [runner.py" in line or "[INFO] [launch.py" in line]
    assert chatter == []  # DeepSpeed's launcher says warnings only, not its world dicts and commands
    return run_dir


def srun_tasks(run_dir: Path, env: dict[str, str]) -> Path:
    """What `srun --ntasks=2 python train.py dist=slurm ...` starts: two tasks, SLURM's variables set."""
    slurm = {"SLURM_JOB_ID": str(free_port()), "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}
    slurm["SLURM_JOB_NODELIST"] = "localhost"
    args = [*RUN, "dist=slurm", "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}"]
    finish(*(train(args, env, {**slurm, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)}) for task in (0, 1)))
    return run_dir


def submitit_local(run_dir: Path, env: dict[str, str]) -> Path:
    """Hydra's submitit launcher, local executor: the same code path as on SLURM, tasks on this machine."""
    sweep = run_dir.parent / "sweep"
    args = [*RUN, "dist=slurm", "dist.nproc_per_node=2", "hydra/launcher=submitit_local"]
    finish(train(["-m", *args, "hydra.launcher.gpus_per_node=0", f"hydra.sweep.dir={sweep}"], env))
    return sweep / "0"


@pytest.mark.parametrize(
    "start", [two_torchrun_nodes, deepspeed_hostfile, srun_tasks, submitit_local], ids=lambda start: start.__name__
)
def test_every_launcher_trains_zero3_like_one_node_with_two_ranks(tmp_path, env, two_rank_reference, start):
    run_dir = start(tmp_path / "run", env)
    result = read_summary(run_dir)
    assert result["status"] == "completed" and result["world_size"] == 2
    assert result["params_held_per_rank"] == [148512, 148512]  # ZeRO-3 partitions across the two ranks
    assert losses(run_dir) == two_rank_reference


def test_a_crashed_rank_stops_the_job_and_only_its_error_is_shown(run_train, tmp_path):
    run_dir = tmp_path / "run"
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    started = time.time()
    result = run_train(
        *RUN, "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}", env={FAULT_ENV: f"1:{STEPS}"}, timeout=300
    )
    elapsed = time.time() - started
    assert result.returncode == 1, result.stderr[-3000:]
    output = result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: rank 1: step {STEPS}: RuntimeError: fault injected by {FAULT_ENV} on rank 1 at step {STEPS} "
        f"(traceback: {run_dir / 'errors' / 'rank1.txt'})"
    ]
    # No wall of tracebacks: neither the ranks' nor torchrun's failure report.
    assert "Traceback" not in output and "ChildFailedError" not in output and "Connection closed" not in output
    assert "fault injected" in (run_dir / "errors" / "rank1.txt").read_text()  # the full traceback is kept
    assert read_summary(run_dir)["status"] == "failed" and "rank 1" in read_summary(run_dir)["error"]
    assert not (run_dir / "model").exists()
    # DeepSpeed's CPU all-reduce segments (66 MB per rank) of the crashed ranks are removed.
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before
    # Bounded: rank 0 does not wait for a timeout (gloo's default is 30 minutes).
    assert elapsed < 120, f"took {elapsed:.0f} s"


def test_a_rank_that_dies_by_a_signal_mid_step_is_named_with_its_step(run_train, tmp_path):
    """gloo and NCCL end a rank with SIGABRT (a collective that received other sizes than it expected),
    and torchrun then terminates the others: no rank may record an error. The step is still named."""
    run_dir = tmp_path / "run"
    result = run_train(
        *RUN, "dist.nproc_per_node=2", f"hydra.run.dir={run_dir}", env={FAULT_ENV: f"1:{STEPS}:abort"}, timeout=300
    )
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    # Either rank 0 recorded the broken connection first, or nobody recorded and rank 1's step file names it.
    assert f"step {STEPS}: " in errors[0] and "keep data.modality_guard on" in errors[0], errors[0]
    assert read_summary(run_dir)["status"] == "failed"
    assert read_summary(run_dir)["steps"] == STEPS - 1  # the last step trained, though no rank could say


def test_a_packed_zero3_run_on_two_ranks_has_the_losses_of_the_unpacked_one(tmp_path, env):
    """Tiny Qwen2-VL (its 3-D rotary index rebuilt per record), ZeRO-3 on 2 ranks, the same 16 records
    each step: packed into rows of at most 256 tokens (11 and 5 of its 23-token records), a row per
    rank, against 8 records per rank unpacked. The ranks hold different records either way; the loss is
    the mean over all the step's answer tokens, so the losses agree to 1e-5 (fp32) step by step."""
    common = ["logger=none", "deepspeed=z3", "dist.nproc_per_node=2", "model.arch=tiny_qwen2_vl", "data.n_train=16",
              "data.n_eval=8", "train.max_steps=4", "train.eval_every=0", "data.eval_accuracy=false",
              "train.save_every=0", "train.seed=1", "train.lr=3e-3", "train.warmup_steps=1"]  # fmt: skip
    packed, plain = tmp_path / "packed", tmp_path / "plain"
    finish(
        train([*common, "data.packing=true", "data.pack_length=256", "train.micro_batch_size=1",
               f"hydra.run.dir={packed}"], env),
        train([*common, "train.micro_batch_size=8", f"hydra.run.dir={plain}"], env),
    )  # fmt: skip
    reference = losses(plain)
    assert len(reference) == 4 and reference[-1] < reference[0] - 0.05  # the weights moved
    assert losses(packed) == pytest.approx(reference, rel=1e-5)
