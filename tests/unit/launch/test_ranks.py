"""launcher.launch.ranks: the command each launcher gets (torchrun, DeepSpeed's launcher with a hostfile),
the rendezvous port, the settings refused before any rank starts, and `outcome`: how the ranks' ends
(their return code, summary and error records) become the job's one result or one error line."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from pathlib import Path

import pytest

from launcher.core.errors import Interrupted, LauncherError, TrainingFailed
from launcher.core.rank_errors import record_rank_error
from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.job.planning import plan_job
from launcher.launch.ranks import (
    WORKER,
    deepspeed_command,
    hostfile_ranks,
    master_port,
    outcome,
    start_ranks,
    torchrun_command,
)
from launcher.train.faults import FAULT_ENV
from tests.helpers import QUICK, compose_typed, hydra_job, read_metrics, run_here, small_disk


def dist_of(*overrides: str):
    return compose_typed(list(overrides)).dist


# ----------------------------------------------------------------------------- commands per launcher
def test_torchrun_command_for_one_node_of_several():
    dist = dist_of("dist=torchrun", "dist.nnodes=4", "dist.nproc_per_node=8", "dist.node_rank=2")
    command = torchrun_command(dist, Path("/shared/run"), 29500)
    assert command[1:3] == ["-m", "launcher.launch.torchrun"]
    for flag in ("--nnodes=4", "--nproc-per-node=8", "--node-rank=2", "--master-addr=127.0.0.1", "--master-port=29500"):
        assert flag in command
    assert command[-3:] == ["-m", WORKER, "/shared/run"]
    with pytest.raises(LauncherError, match=r"dist.node_rank=4 must be between 0 and dist.nnodes-1=3"):
        torchrun_command(dist_of("dist=torchrun", "dist.nnodes=4", "dist.node_rank=4"), Path("/shared/run"), 29500)


def test_the_rendezvous_port_is_a_free_one_here_and_the_users_across_nodes():
    assert master_port(dist_of("dist.master_port=null")) > 0  # one machine: any free port
    assert master_port(dist_of("dist=torchrun", "dist.master_port=29511")) == 29511  # never probed on 2 nodes
    with pytest.raises(LauncherError, match="a job on 2 nodes needs the same port on every node"):
        master_port(dist_of("dist=torchrun", "dist.master_port=null"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LauncherError, match=f"dist.master_port={port} is already in use on 127.0.0.1"):
            master_port(dist_of(f"dist.master_port={port}"))


def test_deepspeed_command_reads_the_hostfile_with_deepspeeds_parser(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode1 slots=4\nnode2 slots=4\n")
    given = ("dist=deepspeed", f"dist.hostfile={hostfile}")
    two_nodes = dist_of(*given, "dist.nnodes=2", "dist.nproc_per_node=4", "dist.master_addr=node1")
    assert hostfile_ranks(two_nodes) == {"node1": [0, 1, 2, 3], "node2": [0, 1, 2, 3]}
    command = deepspeed_command(two_nodes, 8, tmp_path / "run", 29500)
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert "--no_ssh_check" not in command  # two hosts: DeepSpeed reaches node2 over ssh
    assert command[-3:] == ["--module", WORKER, str(tmp_path / "run")]
    assert "--master_addr=node1" in command and "--master_port=29500" in command

    excluded = dist_of(*given, "dist.exclude=node2", "dist.nproc_per_node=4")
    assert hostfile_ranks(excluded) == {"node1": [0, 1, 2, 3]}
    command = deepspeed_command(excluded, 4, tmp_path / "run", 29500)
    assert "--no_ssh_check" in command and "--exclude=node2" in command  # only node1 left: no ssh

    with pytest.raises(LauncherError, match=r"gives 8 ranks on 2 host\(s\) .* = 4: make them agree"):
        deepspeed_command(dist_of(*given, "dist.nproc_per_node=4"), 4, tmp_path, 1)


def test_a_hostfile_deepspeed_cannot_parse_is_one_clear_error(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=4\nnode1 slots=2\n")  # a host twice
    with pytest.raises(LauncherError, match=f"dist.hostfile={hostfile}: "):
        hostfile_ranks(dist_of("dist=deepspeed", f"dist.hostfile={hostfile}"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dist=torchrun", "dist.node_rank=2"], "dist.node_rank=2 must be between 0 and dist.nnodes-1=1"),
        (["dist=torchrun", "dist.master_port=null"], "needs the same port on every node"),
        (["dist.nnodes=2"], "dist=local runs on this machine only"),
        (["dist=deepspeed"], "dist=deepspeed needs dist.hostfile=PATH"),
        (["dist=deepspeed", "dist.hostfile=/nonexistent/hostfile"], "dist.hostfile=/nonexistent/hostfile: no such"),
    ],
)
def test_bad_dist_settings_are_refused_before_any_rank_starts(tmp_path, overrides, message):
    ran = run_here([*QUICK, *overrides], tmp_path / "run")
    assert ran.outcome.status == "failed" and ran.outcome.exit_code == 2
    assert message in ran.error and "\n" not in ran.error
    assert not RunDir(tmp_path / "run").metrics.exists()  # no rank started


def test_a_slurm_task_count_other_than_the_planned_world_size_is_refused(tmp_path, monkeypatch):
    for name in [name for name in os.environ if name.startswith(("SLURM_", "SUBMITIT_"))]:
        monkeypatch.delenv(name)
    for name, value in {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}.items():
        monkeypatch.setenv(name, value)
    ran = run_here([*QUICK, "dist=slurm", "dist.nproc_per_node=2"], tmp_path / "run")
    assert ran.outcome.exit_code == 2
    assert ran.error == (
        "dist=slurm: SLURM started 4 tasks, but the job was planned for dist.nnodes=1 x dist.nproc_per_node=2 = 2"
    )
    # The other tasks wait on rank 0's plan; its error record of this launch ends their wait instead.
    record = RunDir(tmp_path / "run").rank_error(0).read_text()
    assert '"launch": "1.0"' in record and "SLURM started 4 tasks" in record


# ----------------------------------------------------------------------------- how the ranks ended
@pytest.fixture
def job(tmp_path):
    """A job of 2 ranks at ZeRO-3, planned into tmp_path/run (nothing started)."""
    overrides = [*QUICK, "deepspeed=z3", "dist.nproc_per_node=2"]
    run_dir = tmp_path / "run"
    (run_dir / "errors").mkdir(parents=True)
    return plan_job(compose_typed(overrides), hydra_job(overrides, run_dir))


def test_ranks_that_succeeded_give_rank_zeros_summary(job):
    run_dir = RunDir(job.run_dir)
    assert outcome(job, run_dir, 0, primary=False).status == "completed"  # another node: rank 0's is elsewhere
    run_dir.write_summary(Summary(status="completed", steps=2, final_loss=1.5))
    assert outcome(job, run_dir, 0) == Summary(status="completed", steps=2, final_loss=1.5)
    run_dir.write_summary(Summary(status="preempted", steps=1))
    assert outcome(job, run_dir, 0).status == "preempted"


def test_the_earliest_rank_error_is_the_one_line(job):
    run_dir = RunDir(job.run_dir)
    run_dir.write_summary(Summary(status="running", steps=1))
    trace = record_rank_error(run_dir, 1, "step 2: RuntimeError: the cause", 1, "Traceback ...")
    record_rank_error(run_dir, 0, "step 2: RuntimeError: Connection closed by peer", 1, "Traceback ...")
    with pytest.raises(TrainingFailed) as failed:
        outcome(job, run_dir, 1)
    assert str(failed.value) == f"rank 1: step 2: RuntimeError: the cause (traceback: {trace})"


def test_a_users_mistake_found_by_a_rank_keeps_its_line_and_exit_code_2(job):
    run_dir = RunDir(job.run_dir)
    record_rank_error(run_dir, 0, "data.path=/nope: no such file", 2, "Traceback ...")
    with pytest.raises(LauncherError) as refused:
        outcome(job, run_dir, 2)
    assert str(refused.value) == "data.path=/nope: no such file" and refused.value.exit_code == 2


def test_a_job_stopped_before_training_is_interrupted(job):
    run_dir = RunDir(job.run_dir)
    run_dir.write_summary(Summary(status="interrupted", error="stopped by SIGTERM while loading"))
    with pytest.raises(Interrupted, match="stopped by SIGTERM while loading"):
        outcome(job, run_dir, 143)


def test_a_rank_killed_by_a_signal_is_named_with_its_signal_and_step(job):
    run_dir = RunDir(job.run_dir)
    with pytest.raises(TrainingFailed) as killed:
        outcome(job, run_dir, -signal.SIGKILL)
    assert str(killed.value) == (
        "a rank was killed by SIGKILL (the kernel's out-of-memory killer sends it when memory runs out: see dmesg); "
        f"checkpoints saved before it resume with resume={run_dir.path}"
    )
    # torchrun reports a rank's signal as 128 + N; the step it died in is named, and at ZeRO-3 the likely cause.
    run_dir.in_step(1).write_text(f"{3:<20}\n")
    run_dir.in_step(0).write_text(f"{'':<20}\n")  # between steps
    with pytest.raises(TrainingFailed) as aborted:
        outcome(job, run_dir, 128 + signal.SIGABRT)
    assert str(aborted.value).startswith("step 3: a rank was killed by SIGABRT (another rank failed")
    assert "keep data.modality_guard on" in str(aborted.value)


def test_otherwise_the_exit_code_says_what_kind_of_failure(job):
    run_dir = RunDir(job.run_dir)
    with pytest.raises(TrainingFailed, match=r"^training exited with code 1$"):
        outcome(job, run_dir, 1)
    with pytest.raises(LauncherError, match=r"^training exited with code 2$") as refused:
        outcome(job, run_dir, 2)
    assert not isinstance(refused.value, TrainingFailed)
    run_dir.write_summary(Summary(status="failed", error="loss is NaN at step 2"))
    with pytest.raises(TrainingFailed, match=r"^loss is NaN at step 2$"):
        outcome(job, run_dir, 1)


def test_a_rank_that_recorded_nothing_on_a_full_disk_is_said_to_have_met_a_full_disk(job, tmp_path):
    """On a disk too full for a rank's error record the launcher can only see the exit code: it says the disk
    is full, and how to go on."""
    with small_disk(tmp_path / "disk", 1):
        run_dir = RunDir(tmp_path / "disk" / "run")
        run_dir.path.mkdir()
        with contextlib.suppress(OSError), (tmp_path / "disk" / "ballast").open("wb") as handle:
            while True:
                handle.write(b"\0" * 4096)
                handle.flush()
        with pytest.raises(TrainingFailed) as failed:
            outcome(job, run_dir, 1)
    assert str(failed.value) == (
        f"training exited with code 1 and recorded no error: the disk of {run_dir.path} is full (0.0 MiB free): "
        f"free disk space, then resume={run_dir.path} (complete checkpoints are kept; an incomplete one is never "
        "resumed from)"
    )


# ----------------------------------------------------------------------------- starting them
@pytest.mark.slow
def test_the_ranks_start_clean_get_the_environment_and_write_to_the_output(tmp_path, capfd):
    """A run directory left by a preempted segment (its stop request, an old error record): the primary
    launcher clears both, hands the rank `env` and its output file, and reports the rank's own failure."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.path.mkdir()
    run_dir.stop_file.touch()  # not cleared: the rank would stop after step 1, preempted
    record_rank_error(run_dir, 3, "an earlier segment's error", 1, "old")  # not cleared: the earliest record
    log = tmp_path / "ranks.log"

    def start(job, run_dir, *, env, output=None):
        return start_ranks(job, run_dir, env={**env, FAULT_ENV: "0:2"}, output=log)

    ran = run_here([*QUICK, "train.save_every=0"], run_dir.path, start=start)
    trace = run_dir.rank_traceback(0)
    assert ran.outcome.exit_code == 1
    fault = f"fault injected by {FAULT_ENV} on rank 0 at step 2"
    assert ran.error == f"rank 0: step 2: RuntimeError: {fault} (traceback: {trace})"
    assert not run_dir.stop_file.exists() and not run_dir.rank_error(3).exists()
    assert [row["step"] for row in read_metrics(run_dir.path)] == [1]  # step 1 ran: the fault came at step 2
    assert "step 1/2 | loss" in log.read_text()  # the rank's progress went to the output file ...
    assert "step 1/2" not in capfd.readouterr().err  # ... not to the terminal
