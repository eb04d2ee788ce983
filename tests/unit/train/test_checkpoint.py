"""launcher.train.checkpoint, the torch side of checkpoints: the data position a checkpoint carries, the
random state, stopping on a signal, failed writes, metrics after a checkpoint, and what a rank saves and
loads (read from one short run, `quick_run`, and resumes of copies of it)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from launcher.core import checkpoints
from launcher.core.errors import TrainingFailed
from launcher.core.rundir import RunDir
from launcher.core.signals import STOP_SIGNALS
from launcher.train import checkpoint
from launcher.train.checkpoint import DataPosition, ResumableSampler, StopRequest
from tests.helpers import read_metrics, read_summary, run_here, train_here


# ----------------------------------------------------------------------------- the data position
def test_data_position_resumes_without_repeating_or_skipping_samples():
    data = list(range(10))

    def stream(position: DataPosition):
        sampler = ResumableSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = DataLoader(data, batch_size=2, sampler=sampler, drop_last=True)
        return checkpoint.batches(loader, sampler, position, micro=2)

    whole = stream(DataPosition())
    reference = [next(whole).tolist() for _ in range(12)]  # more than two epochs of 5 batches
    first_position = DataPosition()
    first = stream(first_position)
    seen = [next(first).tolist() for _ in range(7)]
    assert (first_position.epoch, first_position.batches) == (1, 2)
    second = stream(DataPosition(first_position.epoch, first_position.batches))
    seen += [next(second).tolist() for _ in range(5)]
    assert seen == reference


@pytest.mark.parametrize("count", [1, 5, 10, 13])
@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_the_resumable_sampler_gives_distributed_samplers_order(count, replicas):
    """Its order is DistributedSampler's (shuffled or not, padded or cut to a multiple of the ranks, over
    epochs), from any start: checkpoints of runs before it was made of tensors resume the same."""
    data = list(range(count))
    for shuffle, drop_last, epoch in [(True, False, 0), (True, False, 3), (False, False, 0), (True, True, 1)]:
        for rank in range(replicas):
            placement = {"num_replicas": replicas, "rank": rank, "shuffle": shuffle, "seed": 7, "drop_last": drop_last}
            reference, resumable = DistributedSampler(data, **placement), ResumableSampler(data, **placement)
            reference.set_epoch(epoch)
            resumable.set_epoch(epoch)
            expected = list(reference)
            assert list(resumable) == expected
            resumable.start = len(expected) // 2
            assert list(resumable) == expected[len(expected) // 2 :]


def test_a_resumed_data_stream_leaves_the_global_random_state_as_the_uninterrupted_one():
    """Each DataLoader iterator draws its workers' seed; from the global generator that draw, made once
    more by a resumed run, would shift dropout's random numbers after the restored state."""
    data = list(range(10))

    def stream(position: DataPosition):
        sampler = ResumableSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = DataLoader(data, batch_size=3, sampler=sampler, drop_last=True, generator=torch.Generator())
        return checkpoint.batches(loader, sampler, position, micro=3)

    saved_global = torch.get_rng_state()
    try:
        torch.manual_seed(0)
        whole = stream(DataPosition())
        reference = []
        for _ in range(8):  # three epochs of 3 batches (one record dropped each), and a random draw per batch
            reference.append((next(whole).tolist(), torch.rand(1).item()))
        torch.manual_seed(0)
        position = DataPosition()
        first = stream(position)
        seen = [(next(first).tolist(), torch.rand(1).item()) for _ in range(3)]  # saved at an epoch's end
        saved, state = DataPosition(position.epoch, position.batches), checkpoint.rng_state()
        torch.manual_seed(123)  # a new process: whatever it drew before the state is restored
        second = stream(saved)
        checkpoint.set_rng_state(state)
        seen += [(next(second).tolist(), torch.rand(1).item()) for _ in range(5)]
        assert seen == reference
    finally:
        torch.set_rng_state(saved_global)


def test_a_sampler_started_part_way_skips_indices_not_batches():
    sampler = ResumableSampler(list(range(8)), num_replicas=2, rank=1, shuffle=False)
    assert list(sampler) == [1, 3, 5, 7] and len(sampler) == 4
    sampler.start = 3
    assert list(sampler) == [7] and len(sampler) == 1


# ----------------------------------------------------------------------------- metrics after a checkpoint
def test_truncate_metrics_drops_steps_after_the_checkpoint(tmp_path):
    run_dir = RunDir(tmp_path)
    checkpoint.truncate_metrics(run_dir, 4)  # no metrics yet: nothing to do
    assert not run_dir.metrics.exists()
    run_dir.metrics.write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(1, 8)) + "\n")
    checkpoint.truncate_metrics(run_dir, 4)
    assert [row["step"] for row in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # no temporary file left


# ----------------------------------------------------------------------------- stopping on a signal
def test_a_stop_signal_is_a_request_and_close_gives_the_previous_handlers_back(tmp_path):
    """The handlers are the rank's while it trains; `close` restores the ones it found (a test process,
    the tuner that trains several jobs)."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    stop = StopRequest(RunDir(tmp_path))
    try:
        assert not stop.wanted() and stop.reason() == "unknown"
        assert all(signal.getsignal(signum) != before[signum] for signum in STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.wanted() and stop.reason() == "SIGUSR1"
    finally:
        stop.close()
    assert {signum: signal.getsignal(signum) for signum in STOP_SIGNALS} == before
    stop.close()  # twice: nothing left to restore


def test_the_launchers_stop_file_is_a_request_too(tmp_path):
    run_dir = RunDir(tmp_path)
    stop = StopRequest(run_dir)
    try:
        assert not stop.wanted()
        run_dir.stop_file.touch()  # what the launcher process writes when a signal reaches it
        assert stop.wanted() and stop.reason() == "signal forwarded by the launcher"
    finally:
        stop.close()


# ----------------------------------------------------------------------------- a write that fails
def test_a_full_disk_is_one_line_naming_the_checkpoint(tmp_path):
    """/dev/full fails every write with ENOSPC, as a full disk does; torch's writer says only
    "unexpected pos", a plain write says "No space left on device"."""
    folder = tmp_path / "checkpoints" / "step3"
    folder.parent.mkdir()
    with pytest.raises(TrainingFailed) as failed, checkpoint.write_failures_reported(folder):
        torch.save({"weights": torch.ones(100_000)}, "/dev/full")
    line = str(failed.value)
    assert line.startswith(f"cannot write checkpoint {folder} (a write stopped part-way; ")
    assert "GiB free there" in line and line.endswith("the incomplete checkpoint is never resumed from")
    assert "\n" not in line
    with (
        pytest.raises(TrainingFailed) as failed,
        checkpoint.write_failures_reported(folder, what="the final model"),
        open("/dev/full", "w") as handle,
    ):
        handle.write("x")
    assert str(failed.value).startswith(f"cannot write the final model {folder} (No space left on device; ")
    assert str(failed.value).endswith("nothing incomplete is left")


def test_other_errors_pass_through_unchanged(tmp_path):
    with (
        pytest.raises(RuntimeError, match="CUDA error: device-side assert"),
        checkpoint.write_failures_reported(tmp_path),
    ):
        raise RuntimeError("CUDA error: device-side assert triggered")
    with pytest.raises(ValueError), checkpoint.write_failures_reported(tmp_path):
        raise ValueError("not a write")


# ----------------------------------------------------------------------------- what a rank saved
@pytest.mark.slow
def test_a_saved_checkpoint_is_complete_with_every_files_size_and_each_ranks_state(quick_run):
    run_dir = RunDir(quick_run.run_dir)
    assert run_dir.latest.read_text() == "step2" and checkpoints.find_resume_tag(run_dir) == "step2"
    marker = checkpoints.read_marker(run_dir, "step2")
    assert (marker.step, marker.world_size, marker.zero_stage, marker.precision) == (2, 1, 0, "fp32")
    assert (marker.global_batch, marker.micro_batch, marker.offload_optimizer) == (4, 4, "none")
    assert marker.files == checkpoints.saved_files(run_dir.checkpoint("step2"))
    assert {"launcher_rank0.pt", "mp_rank_00_model_states.pt"} <= set(marker.files)
    assert marker.param_names and marker.lr_schedule["scheduler"]["type"] == "WarmupCosineLR"
    own = torch.load(run_dir.checkpoint("step2") / "launcher_rank0.pt", weights_only=False)
    assert (own["step"], own["epoch"], own["batches"]) == (2, 0, 2)
    assert set(own["rng"]) >= {"python", "numpy", "torch"}
    assert "comet" not in json.dumps(marker.to_json())


def copy_of(run_dir: Path, where: Path) -> Path:
    shutil.copytree(run_dir, where)
    return where


def files_of(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory but its log and the lock (and room) a job takes in it."""
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name not in ("train.log", ".lock", ".reserve")
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["resume={run}"], 0, "resume: {run} already finished at step 2 (train.max_steps=2); nothing to train"),
        (["resume=auto"], 0, "resume: {run} already finished at step 2"),
        (
            ["resume={run}", "train.max_steps=1"],
            2,
            "error: train.max_steps=1 is below step 2 of the checkpoint step2 this resume continues",
        ),
    ],
    ids=["resume-dir", "resume-auto", "fewer-steps"],
)
def test_resuming_a_finished_run_leaves_it_as_it_was(quick_run, tmp_path, args, code, message):
    run = copy_of(quick_run.run_dir, tmp_path / "run")
    before = files_of(run)
    ran = run_here([arg.format(run=run) for arg in args], run, start=train_here)
    assert ran.outcome.exit_code == code, ran.outcome.error
    said = ran.lines + [line for line, _ in ran.outcome.lines()]
    assert any(message.format(run=run) in line for line in said), said
    assert files_of(run) == before  # summary, metrics, checkpoints, model, .hydra: untouched


@pytest.mark.slow
def test_a_dry_run_of_a_resume_leaves_the_runs_command_line_and_the_next_resume_trains(
    quick_run, train_in_process, tmp_path
):
    run = copy_of(quick_run.run_dir, tmp_path / "run")
    before = files_of(run)
    dry = run_here([f"resume={run}", "train.max_steps=3", "dry_run=true"], run)
    assert (dry.outcome.status, dry.outcome.exit_code) == ("planned", 0), dry.outcome.error
    assert (f"dry run: wrote {run / 'ds_config.json'}; nothing trained", True) in dry.outcome.lines()
    after = files_of(run)
    assert {name: data for name, data in after.items() if name != "ds_config.json"} == {
        name: data for name, data in before.items() if name != "ds_config.json"
    }  # .hydra/, summary, metrics, checkpoints: untouched; the plan shown is written, as a dry run does
    real = train_in_process(f"resume={run}", "train.max_steps=3", run_dir=run)
    assert real.outcome.status == "completed", real.outcome.error
    assert read_summary(run)["steps"] == 3 and read_summary(run)["resumed_from_step"] == 2


@pytest.mark.slow
def test_a_resume_that_fails_to_load_leaves_the_runs_summary_alone(quick_run, train_in_process, tmp_path):
    """Damage the file sizes cannot show (a marker written before they were recorded): DeepSpeed's load
    fails on the rank, one line names the checkpoint, and the run's summary still says "completed"."""
    run = copy_of(quick_run.run_dir, tmp_path / "run")
    marker = RunDir(run).marker("step2")
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}))
    states = RunDir(run).checkpoint("step2") / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    summary_before = (run / "summary.json").read_bytes()
    ran = train_in_process(f"resume={run}", "train.max_steps=3", run_dir=run)
    assert (ran.outcome.status, ran.outcome.exit_code) == ("failed", 1), ran.outcome.error
    assert f"cannot load checkpoint {run}/checkpoints/step2" in ran.error and "\n" not in ran.error
    assert (run / "summary.json").read_bytes() == summary_before
