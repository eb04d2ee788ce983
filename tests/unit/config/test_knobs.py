"""The training knobs' table (launcher.config.knobs): each train.* key, the DeepSpeed value it sets, and
what it owns of a base JSON."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from launcher.config.batch import BatchSizes
from launcher.config.ds_config import KNOWN_TOP_LEVEL_KEYS, OWNERS
from launcher.config.knobs import TRAIN_KEY_OWNS, TRAIN_KNOBS, train_values, warmup_steps
from launcher.config.schema import TrainConfig
from tests.helpers import CONF, compose_plain

BATCH = BatchSizes(micro=4, accum=2, total=16)


def test_warmup_ratio_rounds_up_and_an_explicit_count_wins():
    train = {"max_steps": 5198, "warmup_steps": None, "warmup_ratio": 0.03}
    assert warmup_steps(train) == 156  # ceil(155.94), as the HF Trainer rounds
    assert warmup_steps({**train, "warmup_steps": 10}) == 10
    assert warmup_steps({**train, "warmup_ratio": None}) == 5198 // 20


@pytest.mark.parametrize(
    ("train", "expected"),
    [
        ({"max_steps": 10, "warmup_steps": None, "warmup_ratio": None}, 1),  # 5% of 10 is 0: at least one
        ({"max_steps": 10, "warmup_steps": None, "warmup_ratio": 0.0}, 1),
        ({"max_steps": 1000, "warmup_steps": None}, 50),  # no warmup_ratio key at all
        ({"max_steps": 1000, "warmup_steps": "7", "warmup_ratio": 0.5}, 7),
    ],
)
def test_warmup_is_at_least_one_step(train, expected):
    assert warmup_steps(train) == expected


def test_every_knob_is_a_train_key_of_the_schema_and_a_deepspeed_key():
    fields = {f"train.{f.name}" for f in dataclasses.fields(TrainConfig)}
    values = set(yaml.safe_load((CONF / "train" / "default.yaml").read_text()))
    for knob in TRAIN_KNOBS:
        assert knob.key is None or (knob.key in fields and knob.key.removeprefix("train.") in values), knob
        assert knob.path.split(".", 1)[0] in KNOWN_TOP_LEVEL_KEYS, knob
        assert OWNERS[knob.path.split(".", 1)[0]] == "train"  # a train= choice owns all of them
    paths = [knob.path for knob in TRAIN_KNOBS]
    assert len(paths) == len(set(paths))  # one row per DeepSpeed value


def test_a_train_key_owns_each_value_it_sets_and_nothing_else():
    assert TRAIN_KEY_OWNS["train.lr"] == ("optimizer.params.lr", "scheduler.params.warmup_max_lr")
    assert TRAIN_KEY_OWNS["train.micro_batch_size"] == ("train_micro_batch_size_per_gpu",)
    assert TRAIN_KEY_OWNS["train.max_steps"] == ("scheduler.params.total_num_steps",)
    assert TRAIN_KEY_OWNS["train.min_lr_ratio"] == ("scheduler.params.cos_min_ratio",)
    owned = [path for paths in TRAIN_KEY_OWNS.values() for path in paths]
    assert sorted(owned) == sorted(knob.path for knob in TRAIN_KNOBS if knob.key is not None)
    assert "train.seed" not in TRAIN_KEY_OWNS and "train.eval_every" not in TRAIN_KEY_OWNS  # no DeepSpeed value


def test_the_values_come_from_the_train_group_and_the_resolved_batch():
    train = compose_plain(["train.lr=2e-5", "train.max_steps=300", "train.warmup_steps=30"])["train"]
    values = train_values(train, BATCH, composed_only=False)
    assert values == {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer.params.lr": 2e-5,
        "optimizer.params.betas": [0.9, 0.95],
        "optimizer.params.eps": 1e-8,
        "optimizer.params.weight_decay": 0.0,
        "scheduler.params.total_num_steps": 300,
        "scheduler.params.warmup_num_steps": 30,
        "scheduler.params.warmup_max_lr": 2e-5,
        "scheduler.params.warmup_min_lr": 0.0,
        "scheduler.params.warmup_min_ratio": 0.0,
        "scheduler.params.cos_min_ratio": 0.05,
    }
    assert all(type(values[path]) is float for path in ("gradient_clipping", "optimizer.params.lr"))
    # The composition writes the WarmupCosineLR values only; the WarmupLR ones fill a base JSON's "auto".
    composed = train_values(train, BATCH, composed_only=True)
    assert set(values) - set(composed) == {"scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr"}
