"""launcher.core.checkpoints, without torch or training: which checkpoint a resume picks, damage,
pruning, the typed marker, and what may differ between the job that saved a checkpoint and its resume."""

from __future__ import annotations

import dataclasses
import json

from launcher.core import checkpoints
from launcher.core.checkpoints import CheckpointMarker, find_resume_tag, incompatibilities, prune, write_latest
from launcher.core.rundir import RunDir


def make_checkpoint(run_dir: RunDir, step: int, *, complete: bool = True, size: int | None = None) -> None:
    tag = checkpoints.tag_for(step)
    run_dir.checkpoint(tag).mkdir(parents=True)
    states = run_dir.checkpoint(tag) / "mp_rank_00_model_states.pt"
    states.write_bytes(b"x" * (size or 0))
    if complete:
        files = checkpoints.saved_files(run_dir.checkpoint(tag)) if size is not None else {}
        checkpoints.write_marker(run_dir, CheckpointMarker(step=step, tag=tag, files=files))


def test_resume_picks_latest_and_never_an_incomplete_checkpoint(tmp_path):
    run_dir = RunDir(tmp_path)
    assert find_resume_tag(run_dir) is None
    make_checkpoint(run_dir, 10)
    make_checkpoint(run_dir, 20, complete=False)  # a save that died half-way
    assert find_resume_tag(run_dir) == "step10"  # no `latest` yet: newest complete one
    write_latest(run_dir, "step10")
    assert find_resume_tag(run_dir) == "step10"
    write_latest(run_dir, "step20")  # cannot happen through save(), handled anyway
    assert find_resume_tag(run_dir) == "step10"
    assert checkpoints.complete_tags(run_dir) == [(10, "step10")]


def test_latest_prefers_its_tag_over_a_newer_complete_one(tmp_path):
    run_dir = RunDir(tmp_path)
    for step in (5, 10):
        make_checkpoint(run_dir, step)
    write_latest(run_dir, "step5")
    assert find_resume_tag(run_dir) == "step5"
    assert run_dir.latest.read_text() == "step5"
    assert sorted(p.name for p in run_dir.checkpoints.iterdir()) == ["latest", "step10", "step5"]  # no temp file


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    run_dir = RunDir(tmp_path)
    for step in (5, 10, 15):
        make_checkpoint(run_dir, step)
    make_checkpoint(run_dir, 7, complete=False)
    make_checkpoint(run_dir, 20, complete=False)  # newer than the kept ones: a save in progress
    for step in (5, 15):  # universal copies go with their checkpoint
        run_dir.universal(f"step{step}").mkdir(parents=True)
    prune(run_dir, keep=2)
    assert sorted(p.name for p in run_dir.checkpoints.iterdir()) == ["step10", "step15", "step20", "universal"]
    assert [p.name for p in (run_dir.checkpoints / "universal").iterdir()] == ["step15"]


def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_resumed(tmp_path):
    run_dir = RunDir(tmp_path)
    root = run_dir.checkpoints
    for step in (5, 10, 15):
        make_checkpoint(run_dir, step, size=40)
    assert checkpoints.saved_files(root / "step5") == {"mp_rank_00_model_states.pt": 40}
    write_latest(run_dir, "step15")
    (root / "step15" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 12)  # truncated
    (root / "step10" / "mp_rank_00_model_states.pt").unlink()
    lines: list[str] = []
    assert find_resume_tag(run_dir, warn=lines.append) == "step5"
    assert lines == [
        f"checkpoint step15 is damaged ({root}/step15/mp_rank_00_model_states.pt: 12 bytes, 40 at save); trying step10",
        f"checkpoint step10 is damaged ({root}/step10/mp_rank_00_model_states.pt: missing, 40 bytes at save); "
        "resuming from step5",
    ]
    (root / "step5" / "mp_rank_00_model_states.pt").write_bytes(b"")
    lines.clear()
    assert find_resume_tag(run_dir, warn=lines.append) is None
    assert lines[-1].endswith("; no intact checkpoint is left")
    # A marker written before file lists existed is trusted as it is.
    make_checkpoint(run_dir, 1)
    assert find_resume_tag(run_dir, warn=lines.append) == "step1"


def test_an_unreadable_marker_is_damage(tmp_path):
    run_dir = RunDir(tmp_path)
    make_checkpoint(run_dir, 3)
    run_dir.marker("step3").write_text("{")
    assert checkpoints.checkpoint_damage(run_dir, "step3") == f"{run_dir.marker('step3')}: unreadable"
    lines: list[str] = []
    assert find_resume_tag(run_dir, warn=lines.append) is None
    assert lines == [
        f"checkpoint step3 is damaged ({run_dir.marker('step3')}: unreadable); no intact checkpoint is left"
    ]


def test_the_file_list_leaves_out_the_marker_and_its_temporary_files(tmp_path):
    tag = tmp_path / "step1"
    (tag / "zero").mkdir(parents=True)
    (tag / "zero" / "a.pt").write_bytes(b"abc")
    (tag / "launcher_rank0.pt").write_bytes(b"a")
    (tag / "launcher_complete.json").write_text("{}")
    (tag / ".launcher_complete.json.123.tmp").write_text("{")
    assert checkpoints.saved_files(tag) == {"launcher_rank0.pt": 1, "zero/a.pt": 3}


def test_the_marker_is_typed_and_reads_an_older_launchers(tmp_path):
    run_dir = RunDir(tmp_path)
    marker = CheckpointMarker(step=4, tag="step4", world_size=2, zero_stage=3, precision="bf16", global_batch=16)
    checkpoints.write_marker(run_dir, marker)
    assert checkpoints.read_marker(run_dir, "step4") == marker
    assert json.loads(run_dir.marker("step4").read_text())["world_size"] == 2
    # An older marker: no tag, no file list, keys this launcher no longer reads.
    old = CheckpointMarker.from_json({"step": 7, "files": None, "retired_key": 1})
    assert (old.tag, old.files, old.world_size, old.lr_schedule) == ("step7", {}, None, None)


def test_incompatibilities_name_what_differs():
    model = {"name": "tiny_llava", "hidden_size": 64}
    marker = CheckpointMarker(step=4, tag="step4", world_size=2, zero_stage=3, precision="fp32", model=model)
    assert incompatibilities(marker, precision="fp32", model=model, method={}) == []
    # The world size and the stage may change (launcher.job.reshard); the shape may not.
    wider = {**model, "hidden_size": 128}
    assert incompatibilities(marker, precision="fp32", model=wider, method={}) == ["model.hidden_size 64 -> 128"]
    assert incompatibilities(marker, precision="bf16", model=model, method={}) == ["precision fp32 -> bf16"]


def test_how_the_model_runs_may_change_on_resume_but_not_what_trains():
    old = {"name": "tiny_llava", "gradient_checkpointing": False, "attn_implementation": "auto", "compile": False,
           "kernels": "torch"}  # fmt: skip
    new = {"name": "tiny_llava", "gradient_checkpointing": True, "attn_implementation": "eager", "compile": True,
           "kernels": "liger"}  # fmt: skip
    marker = CheckpointMarker(step=1, tag="step1", precision="fp32", model=old)
    assert incompatibilities(marker, precision="fp32", model=new, method={"name": "full"}) == []
    # An older checkpoint records no method (it trained every weight): nothing to compare.
    assert marker.method is None
    lora = dataclasses.replace(marker, method={"name": "lora", "r": 8})
    assert incompatibilities(lora, precision="fp32", model=old, method={"name": "lora", "r": 16}) == [
        "method.r 8 -> 16"
    ]


def test_the_learning_rate_schedule_a_checkpoint_records():
    ds = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95]}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10}},
        "train_batch_size": 8,
    }
    assert checkpoints.lr_schedule_of(ds) == {"lr": 1e-3, "scheduler": ds["scheduler"]}
    assert checkpoints.lr_schedule_of({}) == {"lr": None, "scheduler": None}


def test_a_changed_learning_rate_schedule_is_one_line_and_an_unchanged_one_says_nothing():
    """What a resume makes of the schedule a marker records (launcher.job.resume.schedule_change)."""
    from launcher.job.resume import schedule_change, scheduled_lr

    def ds(total: int, warmup: int, lr: float = 1e-3) -> dict:
        params = {"total_num_steps": total, "warmup_num_steps": warmup, "cos_min_ratio": 0.05, "warmup_type": "linear"}
        return {"optimizer": {"params": {"lr": lr}}, "scheduler": {"type": "WarmupCosineLR", "params": params}}

    marker = CheckpointMarker(step=500, tag="step500", lr_schedule=checkpoints.lr_schedule_of(ds(1000, 50)))
    assert schedule_change(marker, ds(1000, 50)) is None
    older = CheckpointMarker(step=500, tag="step500")  # an older launcher's checkpoint
    assert schedule_change(older, ds(2000, 100)) is None
    assert schedule_change(marker, ds(2000, 100)) == (
        "resume: train.max_steps 1000 -> 2000, warm-up 50 -> 100 steps: the learning-rate schedule is "
        "re-stretched to 2000 steps from step 501 on (lr at step 501: 5.6e-04 -> 9.0e-04)"
    )
    assert schedule_change(marker, ds(1000, 50, lr=3e-4)) == (
        "resume: train.lr 0.001 -> 0.0003: the learning-rate schedule is changed to the new values from step 501 "
        "on (lr at step 501: 5.6e-04 -> 1.7e-04)"
    )
    # The rate a step applies, as metrics.jsonl shows it: step k of WarmupCosineLR applies its iteration k
    # (launcher.train.engine.start_warm_up_at_step_one): lr x 1/2 at step 1 of a 2-step warm-up, then the cosine.
    assert scheduled_lr(checkpoints.lr_schedule_of(ds(10, 2)), 1) == 5e-4
    assert 9e-4 < scheduled_lr(checkpoints.lr_schedule_of(ds(10, 2)), 2) < 1e-3
