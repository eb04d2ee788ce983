"""Checkpoint bookkeeping without training: which checkpoint a resume picks, pruning, data position."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch.utils.data import DataLoader

from launcher.job.resume import resumed_overrides, resumed_run_dir
from launcher.train import checkpoint


def make_checkpoint(checkpoints: Path, step: int, *, complete: bool = True) -> None:
    tag = checkpoints / f"step{step}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_text("")
    if complete:
        (tag / checkpoint.MARKER_FILE).write_text(json.dumps({"step": step}))


def test_resume_picks_latest_and_never_an_incomplete_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert checkpoint.find_resume_tag(checkpoints) is None
    make_checkpoint(checkpoints, 10)
    make_checkpoint(checkpoints, 20, complete=False)  # a save that died half-way
    assert checkpoint.find_resume_tag(checkpoints) == "step10"  # no `latest` yet: newest complete one
    checkpoint._write_latest(checkpoints, "step10")
    assert checkpoint.find_resume_tag(checkpoints) == "step10"
    checkpoint._write_latest(checkpoints, "step20")  # cannot happen through save(), handled anyway
    assert checkpoint.find_resume_tag(checkpoints) == "step10"


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        make_checkpoint(checkpoints, step)
    make_checkpoint(checkpoints, 7, complete=False)
    make_checkpoint(checkpoints, 20, complete=False)  # newer than the kept ones: a save in progress
    checkpoint._prune(checkpoints, keep=2)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step10", "step15", "step20"]


def test_truncate_metrics_drops_steps_after_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(1, 8))
    )
    checkpoint.truncate_metrics(tmp_path, 4)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4]


def test_incompatibilities_name_what_differs():
    old = {"world_size": 2, "zero_stage": 3, "precision": "fp32", "model": {"name": "tiny_llava", "hidden_size": 64}}
    new = {"world_size": 1, "zero_stage": 3, "precision": "fp32", "model": {"name": "tiny_llava", "hidden_size": 128}}
    assert checkpoint.incompatibilities(old, old) == []
    assert checkpoint.incompatibilities(old, new) == ["model.hidden_size 64 -> 128"]  # the shape: launcher.reshard
    assert checkpoint.incompatibilities(old, {**old, "precision": "bf16"}) == ["precision fp32 -> bf16"]


def test_how_the_model_runs_may_change_on_resume_but_not_what_trains():
    old = {"model": {"name": "tiny_llava", "gradient_checkpointing": False, "attn_implementation": "auto"}}
    new = {"model": {"name": "tiny_llava", "gradient_checkpointing": True, "attn_implementation": "eager"}}
    assert checkpoint.incompatibilities(old, new) == []
    # An older checkpoint records no method (it trained every weight): nothing to compare.
    assert checkpoint.incompatibilities(old, {**new, "method": {"name": "full"}}) == []
    lora = {**old, "method": {"name": "lora", "r": 8}}
    assert checkpoint.incompatibilities(lora, {**old, "method": {"name": "lora", "r": 16}}) == ["method.r 8 -> 16"]


def test_resume_argument_reruns_the_old_overrides_in_the_old_directory(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    old = ["train.max_steps=40", "deepspeed=z3", "resume=auto"]
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in old))
    argv = ["train.py", f"resume={run_dir}", "train.max_steps=80", "hydra.run.dir=elsewhere"]
    assert resumed_run_dir(argv) == run_dir
    assert resumed_overrides(old, argv[1:]) == ["deepspeed=z3", f"resume={run_dir}", "train.max_steps=80"]
    # resume=auto continues hydra.run.dir only when a run was started there; sweeps never resume.
    assert resumed_run_dir(["train.py", "resume=auto", f"hydra.run.dir={tmp_path / 'x'}"]) is None
    assert resumed_run_dir(["train.py", "resume=auto", f"hydra.run.dir={run_dir}"]) == run_dir
    assert resumed_run_dir(["train.py", "-m", f"resume={run_dir}"]) is None


def test_data_position_resumes_without_repeating_or_skipping_samples():
    data = list(range(10))

    def stream(position: checkpoint.DataPosition):
        sampler = checkpoint.ResumableSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = DataLoader(data, batch_size=2, sampler=sampler, drop_last=True)
        return checkpoint.batches(loader, sampler, position, micro=2)

    whole = stream(checkpoint.DataPosition())
    reference = [next(whole).tolist() for _ in range(12)]  # more than two epochs of 5 batches
    first_position = checkpoint.DataPosition()
    first = stream(first_position)
    seen = [next(first).tolist() for _ in range(7)]
    assert (first_position.epoch, first_position.batches) == (1, 2)
    second = stream(checkpoint.DataPosition(first_position.epoch, first_position.batches))
    seen += [next(second).tolist() for _ in range(5)]
    assert seen == reference


def test_a_nonfinite_loss_stops_unless_fp16_may_skip_it():
    from launcher.train.trainer import nonfinite_action

    assert nonfinite_action(1.5, fp16=False, in_a_row=0, allowed=0) == "ok"
    for loss in (math.nan, math.inf, -math.inf):
        assert nonfinite_action(loss, fp16=False, in_a_row=1, allowed=5) == "stop"  # fp32/bf16: always
        assert nonfinite_action(loss, fp16=True, in_a_row=1, allowed=0) == "stop"  # the default
        assert nonfinite_action(loss, fp16=True, in_a_row=2, allowed=2) == "skip"
        assert nonfinite_action(loss, fp16=True, in_a_row=3, allowed=2) == "stop"


def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumed(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        make_checkpoint(checkpoints, step)
        tag = checkpoints / f"step{step}"
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 40)
        marker = json.loads((tag / checkpoint.MARKER_FILE).read_text())
        (tag / checkpoint.MARKER_FILE).write_text(json.dumps({**marker, "files": checkpoint.saved_files(tag)}))
    assert checkpoint.saved_files(checkpoints / "step5") == {"mp_rank_00_model_states.pt": 40}
    checkpoint._write_latest(checkpoints, "step15")
    (checkpoints / "step15" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 12)  # truncated
    (checkpoints / "step10" / "mp_rank_00_model_states.pt").unlink()
    lines: list[str] = []
    assert checkpoint.find_resume_tag(checkpoints, warn=lines.append) == "step5"
    assert lines == [
        f"checkpoint step15 is damaged ({checkpoints}/step15/mp_rank_00_model_states.pt: 12 bytes, 40 at save); "
        "trying step10",
        f"checkpoint step10 is damaged ({checkpoints}/step10/mp_rank_00_model_states.pt: missing, 40 bytes at save); "
        "resuming from step5",
    ]
    (checkpoints / "step5" / "mp_rank_00_model_states.pt").write_bytes(b"")
    lines.clear()
    assert checkpoint.find_resume_tag(checkpoints, warn=lines.append) is None
    assert lines[-1].endswith("; no intact checkpoint is left")
    # A marker written before file lists existed is trusted as it is.
    make_checkpoint(checkpoints, 1)
    assert checkpoint.find_resume_tag(checkpoints, warn=lines.append) == "step1"


def test_a_resumed_data_stream_leaves_the_global_random_state_as_the_uninterrupted_one():
    """Each DataLoader iterator draws its workers' seed; from the global generator that draw, made once
    more by a resumed run, would shift dropout's random numbers after the restored state."""
    import torch

    data = list(range(10))

    def stream(position: checkpoint.DataPosition):
        sampler = checkpoint.ResumableSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3)
        loader = DataLoader(data, batch_size=3, sampler=sampler, drop_last=True, generator=torch.Generator())
        return checkpoint.batches(loader, sampler, position, micro=3)

    torch.manual_seed(0)
    whole = stream(checkpoint.DataPosition())
    reference = []
    for _ in range(8):  # three epochs of 3 batches (one record dropped each), and a random draw per batch
        reference.append((next(whole).tolist(), torch.rand(1).item()))
    torch.manual_seed(0)
    position = checkpoint.DataPosition()
    first = stream(position)
    seen = [(next(first).tolist(), torch.rand(1).item()) for _ in range(3)]  # saved at an epoch's end
    saved, state = checkpoint.DataPosition(position.epoch, position.batches), checkpoint.rng_state()
    torch.manual_seed(123)  # a new process: whatever it drew before the state is restored
    second = stream(saved)
    checkpoint.set_rng_state(state)
    seen += [(next(second).tolist(), torch.rand(1).item()) for _ in range(5)]
    assert seen == reference


def test_a_changed_learning_rate_schedule_is_one_line_and_an_unchanged_one_says_nothing():
    def ds(total: int, warmup: int, lr: float = 1e-3) -> dict:
        params = {"total_num_steps": total, "warmup_num_steps": warmup, "cos_min_ratio": 0.05, "warmup_type": "linear"}
        return {"optimizer": {"params": {"lr": lr}}, "scheduler": {"type": "WarmupCosineLR", "params": params}}

    marker = {"step": 500, "lr_schedule": checkpoint.lr_schedule_of(ds(1000, 50))}
    assert checkpoint.schedule_change(marker, ds(1000, 50)) is None
    assert checkpoint.schedule_change({"step": 500}, ds(2000, 100)) is None  # an older launcher's checkpoint
    assert checkpoint.schedule_change(marker, ds(2000, 100)) == (
        "resume: train.max_steps 1000 -> 2000, warm-up 50 -> 100 steps: the learning-rate schedule is "
        "re-stretched to 2000 steps from step 501 on (lr at step 501: 5.6e-04 -> 9.0e-04)"
    )
    assert checkpoint.schedule_change(marker, ds(1000, 50, lr=3e-4)) == (
        "resume: train.lr 0.001 -> 0.0003: the learning-rate schedule is changed to the new values from step 501 "
        "on (lr at step 501: 5.6e-04 -> 1.7e-04)"
    )
    # The rate metrics.jsonl shows at a step: the scheduler after that many steps (0 at step 1: linear warm-up).
    assert checkpoint.scheduled_lr(checkpoint.lr_schedule_of(ds(10, 2)), 1) == 0.0
    assert checkpoint.scheduled_lr(checkpoint.lr_schedule_of(ds(10, 2)), 2) == 5e-4
