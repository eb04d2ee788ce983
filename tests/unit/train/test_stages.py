"""train.stages in one run, trained in this process: a two-stage schedule gives the losses of its stages
run as two jobs (the second from the first's saved model), each stage's optimizer holds what trains in it
only, at every ZeRO stage and offload with the rates DeepSpeed uses; a resume lands in the right stage
(mid-stage and at a boundary) bitwise. Two ranks: tests/e2e/test_stages.py. The schedule's rules:
tests/unit/config/test_stages.py."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from launcher.core.checkpoints import read_marker
from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.job.planning import plan_job
from launcher.model.stats import model_dir
from launcher.train.distributed import init_distributed
from launcher.train.engine import build_engine, release
from tests.helpers import PRESET_OPTIMIZERS, QUICK, compose_typed, hydra_job, losses, rates_in_use, read_metrics

STEPS = ("train.max_steps=10", "train.eval_every=0", "logger=none", "data.n_train=256", "data.n_eval=32")
SCHEDULE = "train.stages=[{steps: 4, train: [projector], lr: 3e-3}, {name: full, train: [projector, language]}]"


def close(a: list[float], b: list[float], rtol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rtol) for x, y in zip(a, b, strict=True))


def test_two_stages_train_as_two_jobs_the_second_from_the_firsts_model(train_in_process, tmp_path):
    staged = train_in_process(*STEPS, SCHEDULE, run_dir=tmp_path / "staged")
    assert staged.outcome.status == "completed", staged.error
    first = train_in_process(
        *STEPS, "train.max_steps=4", "train.lr=3e-3", "model.freeze_vision=true", "model.freeze_language=true",
        run_dir=tmp_path / "first",
    )  # fmt: skip
    second = train_in_process(
        *STEPS, "train.max_steps=6", "model.freeze_vision=true", "model.source=pretrained",
        f"model.path={first.run_dir / 'model'}", run_dir=tmp_path / "second",
    )  # fmt: skip
    assert second.outcome.status == "completed", second.error
    assert close(losses(staged.run_dir), losses(first.run_dir) + losses(second.run_dir))
    # The stage's model is the first job's; the run's final model is the second's.
    for ours, theirs in ((staged.run_dir / "stages" / "stage1", first.run_dir / "model"),
                         (staged.run_dir / "model", second.run_dir / "model")):  # fmt: skip
        mine, other = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
        assert mine.keys() == other.keys()
        assert all(torch.allclose(mine[key], other[key], rtol=1e-5, atol=1e-7) for key in mine)
    # Each stage's optimizer held what trained in it, at its rate; the metrics say which stage a step trained in.
    summary = staged.summary()
    held = [{group["name"]: group["params"] for group in stage["param_groups"]} for stage in summary["stages"]]
    trained = [job.summary()["params_trainable"] for job in (first, second)]  # projector; projector + language
    assert trained[0] < trained[1] < summary["params_total"]
    assert held == [{"default": trained[0]}, {"default": trained[1]}]
    assert [group["lr"] for stage in summary["stages"] for group in stage["param_groups"]] == [3e-3, 1e-3]
    assert [row["train/stage"] for row in read_metrics(staged.run_dir)] == [1] * 4 + [2] * 6
    assert "stages stage1: steps 1-4, projector at lr 0.003, full: steps 5-10, projector + language" in "\n".join(
        staged.lines
    )


@pytest.mark.parametrize("saved_at", [2, 4, 6])
def test_a_resume_lands_in_its_stage_and_ends_bitwise(train_in_process, tmp_path, saved_at):
    """Checkpoints in stage 1, at its last step (the boundary) and in stage 2: each resumed copy ends with
    the uninterrupted run's losses and weights, bitwise."""
    whole = train_in_process(*STEPS, SCHEDULE, f"train.save_every={saved_at}", "train.keep_checkpoints=5",
                             run_dir=tmp_path / "whole")  # fmt: skip
    assert whole.outcome.status == "completed", whole.error
    copy = tmp_path / "copy"
    shutil.copytree(whole.run_dir, copy)
    run_dir = RunDir(copy)
    for tag in [path.name for path in run_dir.checkpoints.iterdir() if path.is_dir()]:
        if read_marker(run_dir, tag).step != saved_at:
            shutil.rmtree(run_dir.checkpoint(tag))
    shutil.rmtree(copy / "model")
    if saved_at <= 4:
        shutil.rmtree(copy / "stages")  # saved again at the boundary by the resumed run
    resumed = train_in_process(f"resume={copy}", run_dir=copy)
    assert resumed.outcome.status == "completed", resumed.error
    assert resumed.summary()["resumed_from_step"] == saved_at
    assert losses(copy) == losses(whole.run_dir)
    mine, theirs = (
        load_file(copy / "model" / "model.safetensors"),
        load_file(whole.run_dir / "model" / "model.safetensors"),
    )
    assert all(torch.equal(mine[key], theirs[key]) for key in mine)


def test_a_resume_refuses_a_schedule_that_changes_steps_already_run(train_in_process, tmp_path):
    run = train_in_process(*STEPS, SCHEDULE, "train.save_every=6", run_dir=tmp_path / "run")
    changed = "train.stages=[{steps: 5, train: [projector], lr: 3e-3}, {name: full, train: [projector, language]}]"
    refused = train_in_process(f"resume={run.run_dir}", changed, run_dir=run.run_dir)
    assert refused.outcome.status != "completed"
    assert "train.stages[0] (stage1) had run up to step 4" in refused.error
    # A later stage may change while the one before runs: the checkpoint at step 2 resumes with another.
    later = SCHEDULE.replace("language]}", "language], lr: 5e-4}")
    early = train_in_process(
        *STEPS, SCHEDULE, "train.save_every=2", "train.keep_checkpoints=5", run_dir=tmp_path / "early"
    )
    for tag in [p.name for p in RunDir(early.run_dir).checkpoints.iterdir() if p.is_dir()]:
        if read_marker(RunDir(early.run_dir), tag).step != 2:
            shutil.rmtree(RunDir(early.run_dir).checkpoint(tag))
    shutil.rmtree(early.run_dir / "stages")
    again = train_in_process(f"resume={early.run_dir}", later, run_dir=early.run_dir)
    assert again.outcome.status == "completed", again.error
    assert again.summary()["stages"][1]["lr"] == 5e-4


def test_a_profile_in_the_second_stage_sees_that_stages_vision_tower(train_in_process):
    """The profiler follows the engine a stage builds: it held the first stage's vision tower (and so, under
    ZeRO-1/2, that stage's whole flat buffer of trained weights) and hooked it, so the second stage's tower
    ran outside the vision scope."""
    ran = train_in_process(
        "train.max_steps=4", "train.eval_every=0", "logger=none", "data.n_train=64", "data.n_eval=16",
        "train.stages=[{steps: 2, train: [projector]}, {name: full, train: [projector, language]}]",
        "train.profile_steps=[3,4]", "data.eval_accuracy=false",
    )  # fmt: skip
    assert ran.outcome.status == "completed", ran.error
    assert ran.summary()["profile"]["attention (vision, forward)"] > 0


def test_the_quick_job_is_unchanged_without_stages(quick_run):
    assert "stages" not in quick_run.summary()
    assert all("train/stage" not in row for row in read_metrics(quick_run.run_dir))
    assert QUICK  # the shared run's overrides hold no schedule
    assert not any("stages" in override for override in QUICK)


@pytest.mark.parametrize(("preset", "optimizer"), PRESET_OPTIMIZERS)
def test_each_stage_steps_its_own_rates_at_every_zero_stage_and_offload(process_group, tmp_path, preset, optimizer):
    """The LLaVA-NeXT#492 trap, per stage: the rates DeepSpeed's optimizer holds once initialised are the
    stage's (its lr, train.groups' scale of the parts that train in it), and nothing else is in it."""
    schedule = "train.stages=[{steps: 4, train: [projector], lr: 3e-3}, {train: [vision, projector, language]}]"
    overrides = [f"deepspeed={preset}", schedule, "train.max_steps=10", "train.lr=1e-3", "train.weight_decay=0.1",
                 "train.groups.vision.lr_scale=0.1", "train.groups.projector.lr_scale=2"]  # fmt: skip
    config = compose_typed(overrides)
    job = plan_job(config, hydra_job(overrides, tmp_path / "run")).replace(model_path=model_dir(config))
    rank, _ = init_distributed(job)
    first, second = job.stages
    engine = build_engine(job, rank, Summary(), stage=first)
    assert type(engine.engine.optimizer).__name__ == optimizer
    assert rates_in_use(engine) == {"projector": (6e-3, 0.1), "projector.no_decay": (6e-3, 0.0)}
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.engine.module.parameters()
                    if p.requires_grad)  # fmt: skip
    assert trainable == sum(group.params for group in engine.groups)  # Adam states for the projector only
    release(engine)
    engine = build_engine(job, rank, Summary(), stage=second)
    assert rates_in_use(engine) == {
        "vision": (1e-4, 0.1), "vision.no_decay": (1e-4, 0.0), "projector": (2e-3, 0.1),
        "projector.no_decay": (2e-3, 0.0), "default": (1e-3, 0.1), "default.no_decay": (1e-3, 0.0),
    }  # fmt: skip
    assert engine.ds_config["scheduler"]["params"]["total_num_steps"] == 6
    release(engine)


def test_a_schedule_the_model_cannot_train_is_refused_before_a_rank_starts(tmp_path):
    """One line, nothing trained: a regex group left empty in a stage, a sum that is not the run's length."""
    from tests.helpers import run_here

    vision_group = ["+train.groups.encoder.match=.*vision_tower.*", "+train.groups.encoder.lr=1e-4"]
    for overrides, says in (
        ([*STEPS, SCHEDULE, *vision_group], "train.groups.encoder: no trainable parameter's name matches"),
        ([*STEPS, "train.stages=[{steps: 4, train: [projector]}, {steps: 4, train: [language]}]"], "take 8 steps"),
    ):
        ran = run_here(overrides, tmp_path / "refused")
        assert ran.outcome.status == "failed" and says in ran.error, ran.error
        assert "\n" not in ran.error
        assert not (tmp_path / "refused" / "metrics.jsonl").exists()


def test_the_planner_plans_the_stage_that_trains_the_most():
    from launcher.model.stats import heaviest_stage, model_stats

    config = compose_typed([*STEPS, SCHEDULE])
    assert heaviest_stage(config) == ("projector", "language")
    everything = compose_typed(["model.freeze_vision=true"])
    assert model_stats(config).trainable == model_stats(everything).trainable
    assert heaviest_stage(compose_typed([])) is None
