"""train.stages as the config gives it (launcher.config.stages): the schedule planned over train.max_steps,
each stage's DeepSpeed schedule, what a resume may change, and every refusal in one line before a run."""

from __future__ import annotations

import pytest

from launcher.config.ranges import check_config
from launcher.config.stages import (
    Stage,
    check_schedule_kept,
    parts_by_stage,
    plan_stages,
    stage_at,
    stage_ds_config,
    stage_train,
)
from launcher.core.errors import LauncherError
from tests.helpers import compose_typed

LLAVA = [{"steps": 100, "train": ["projector"]}, {"train": ["projector", "language"], "lr": 2e-5}]


def test_the_last_stage_takes_the_rest_of_the_run():
    first, second = plan_stages(LLAVA, max_steps=300)
    assert (first.name, first.first_step, first.last_step, first.train) == ("stage1", 1, 100, ("projector",))
    assert (second.name, second.first_step, second.last_step, second.steps) == ("stage2", 101, 300, 200)
    assert second.train == ("projector", "language")
    assert first.freeze() == {"vision": True, "projector": False, "language": True}
    assert (first.rate(1e-3), second.rate(1e-3)) == (1e-3, 2e-5)
    assert [stage_at((first, second), step).name for step in (0, 1, 100, 101, 300)] == ["stage1"] * 3 + ["stage2"] * 2


def test_parts_come_in_the_models_order_and_a_scale_multiplies_train_lr():
    (stage,) = plan_stages([{"train": ["language", "vision"], "lr_scale": 0.5, "name": "warm"}], max_steps=10)
    assert (stage.name, stage.train, stage.rate(1e-3)) == ("warm", ("vision", "language"), 5e-4)
    assert stage.describe(1e-3) == "warm: steps 1-10, vision + language at lr 0.0005"


def test_no_schedule_and_a_length_not_yet_counted():
    assert plan_stages(None, max_steps=10) == ()
    assert plan_stages(LLAVA, max_steps=None) == ()  # train.epochs: planned once counted
    assert parts_by_stage(LLAVA) == [("projector",), ("projector", "language")]
    assert parts_by_stage(None) == []


@pytest.mark.parametrize(
    ("given", "max_steps", "frozen", "says"),
    [
        ("projector", 10, {}, "train.stages=projector must be a list of stages"),
        ([], 10, {}, "must be a list of stages"),
        (["projector"], 10, {}, "train.stages[0]=projector must be a stage"),
        ([{"train": ["projector"], "epochs": 1}], 10, {}, "train.stages[0].epochs is no stage setting"),
        ([{"train": ["projector"]}, {"train": ["language"]}], 10, {}, "train.stages[0] (stage1) gives no steps"),
        ([{"steps": 0, "train": ["projector"]}], 10, {}, "train.stages[0].steps=0: a stage needs a whole number"),
        ([{"steps": 2.5, "train": ["projector"]}], 10, {}, "train.stages[0].steps=2.5"),
        ([{"steps": 5}], 10, {}, "train.stages[0].train=None: name the parts that train"),
        ([{"steps": 5, "train": []}], 10, {}, "train.stages[0].train=[]"),
        ([{"train": ["vision_tower"]}], 10, {}, "train.stages[0].train: vision_tower is no part of the model"),
        ([{"train": ["adapters"]}], 10, {}, "adapters is no part of the model that trains"),
        ([{"train": ["projector", "projector"]}], 10, {}, "names a part twice"),
        ([{"train": ["vision"]}], 10, {"vision": True}, "which model.freeze_vision=true freezes for the whole run"),
        ([{"train": ["projector"], "lr": 1e-3, "lr_scale": 2}], 10, {}, "sets both lr and lr_scale"),
        # A name is a folder's (RUN/stages/NAME): a path would write, or replace, folders outside the run dir.
        ([{"train": ["projector"], "name": "../../escaped"}], 10, {}, "train.stages[0].name='../../escaped' names"),
        ([{"train": ["projector"], "name": "/home/me/victim"}], 10, {}, "(no '/', no '..')"),
        ([{"train": ["projector"], "name": ".."}], 10, {}, "train.stages[0].name='..'"),
        ([{"train": ["projector"], "name": "a/b"}], 10, {}, "train.stages[0].name='a/b'"),
        ([{"train": ["projector"], "name": ".hidden"}], 10, {}, "starting with a letter or digit"),
        ([{"train": ["projector"], "name": "x" * 65}], 10, {}, "up to 64 letters"),
        ([{"train": ["projector"], "lr": 0}], 10, {}, "train.stages[0].lr=0 must be a number above 0"),
        ([{"train": ["projector"], "lr_scale": "x"}], 10, {}, "train.stages[0].lr_scale=x"),
        ([{"steps": 4, "train": ["projector"]}, {"steps": 4, "train": ["language"]}], 10, {}, "take 8 steps but"),
        ([{"steps": 10, "train": ["projector"]}, {"train": ["language"]}], 10, {}, "leaving the last stage none"),
        (
            [{"steps": 4, "train": ["projector"], "name": "a"}, {"train": ["language"], "name": "a"}],
            10,
            {},
            "train.stages[1].name=a: two stages have that name",
        ),
    ],
)
def test_a_bad_schedule_is_refused_in_one_line(given, max_steps, frozen, says):
    with pytest.raises(LauncherError) as refused:
        plan_stages(given, max_steps=max_steps, frozen=frozen)
    assert says in str(refused.value)
    assert "\n" not in str(refused.value)


def test_every_stage_warms_up_anew_so_each_must_outlast_the_warm_up():
    with pytest.raises(LauncherError, match=r"train.stages\[0\] \(stage1\) takes 5 steps, no more than train.warmup"):
        plan_stages([{"steps": 5, "train": ["projector"]}, {"train": ["language"]}], max_steps=20, warmup_steps=5)


def test_a_stage_trains_with_the_schedule_its_own_job_would_have():
    stage = plan_stages(LLAVA, max_steps=300)[1]
    train = {"lr": 1e-3, "max_steps": 300, "warmup_steps": None, "warmup_ratio": 0.1, "stages": LLAVA}
    assert stage_train(train, stage) == {**train, "max_steps": 200, "lr": 2e-5, "stages": None}
    ds = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 300, "warmup_num_steps": 30}},
    }
    staged = stage_ds_config(ds, train, stage)
    assert staged["optimizer"]["params"] == {"lr": 2e-5, "weight_decay": 0.0}
    assert staged["scheduler"]["params"] == {"total_num_steps": 200, "warmup_num_steps": 20}
    assert ds["scheduler"]["params"]["total_num_steps"] == 300  # the run's own dict is left as it was
    # A user's WarmupLR block: its peak follows the stage's rate; a dict without a scheduler gets none.
    user = {"optimizer": {"params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}}
    assert stage_ds_config(user, train, stage)["scheduler"]["params"] == {"warmup_max_lr": 2e-5}
    assert "scheduler" not in stage_ds_config({"optimizer": {"params": {"lr": 1.0}}}, train, stage)


def saved(schedule, max_steps=300):
    return [stage.to_json() for stage in plan_stages(schedule, max_steps=max_steps)]


def test_a_resume_keeps_the_stages_that_have_started():
    now = plan_stages(LLAVA, max_steps=300)
    assert check_schedule_kept(saved(LLAVA), now, 150) is None
    assert check_schedule_kept(None, (), 10) is None
    # Later stages may change while an earlier one runs, and so may the running stage's end (after the step).
    later = [LLAVA[0], {"train": ["vision", "projector", "language"]}]
    assert check_schedule_kept(saved(LLAVA), plan_stages(later, max_steps=300), 50) is None
    assert check_schedule_kept(saved(LLAVA), plan_stages(LLAVA, max_steps=400), 150) is None
    longer = [{"steps": 150, "train": ["projector"]}, LLAVA[1]]
    assert check_schedule_kept(saved(LLAVA), plan_stages(longer, max_steps=300), 50) is None
    assert "stages[0] (stage1) had run up to step 100" in check_schedule_kept(
        saved(LLAVA), plan_stages(longer, max_steps=300), 150
    )
    assert "stages[1] (stage2) had run up to step 150" in check_schedule_kept(
        saved(LLAVA), plan_stages(later, max_steps=300), 150
    )
    assert "stages[0] (stage1) had run up to step 50" in check_schedule_kept(
        saved(LLAVA), plan_stages([{"steps": 100, "train": ["vision"]}, LLAVA[1]], max_steps=300), 50
    )
    assert "trained with train.stages" in check_schedule_kept(saved(LLAVA), (), 50)
    assert "trained without train.stages" in check_schedule_kept(None, now, 50)


def test_the_schedule_composes_from_the_command_line_and_is_checked_with_the_config():
    schedule = "train.stages=[{steps: 4, train: [projector]}, {train: [projector, language], lr: 2e-5}]"
    config = compose_typed(["train.max_steps=10", schedule])
    check_config(config)
    assert config.train.stages == [
        {"steps": 4, "train": ["projector"]},
        {"train": ["projector", "language"], "lr": 2e-5},
    ]
    assert compose_typed([]).train.stages is None
    for overrides, says in (
        (["train.max_steps=10", "method=lora", schedule], "train.stages with method=lora"),
        (["train.max_steps=10", "data.streaming=true", schedule], "train.stages with data.streaming=true"),
        (["train.max_steps=10", "model.freeze_language=true", schedule], "model.freeze_language=true freezes"),
        (["train.max_steps=20", "train.stages=[{steps: 4, train: [projector]}, {steps: 4, train: [language]}]"], "8"),
    ):
        with pytest.raises(LauncherError) as refused:
            check_config(compose_typed(overrides))
        assert says in str(refused.value), overrides


def test_stage_to_json_round_trips_what_a_checkpoint_records():
    stage = Stage(1, "full", 5, 10, ("projector", "language"), lr=2e-5)
    assert stage.to_json() == {
        "name": "full", "steps": [5, 10], "train": ["projector", "language"], "lr": 2e-5, "lr_scale": None
    }  # fmt: skip
