"""launcher.core.overrides: the one parser of `key=value` overrides every part of the launcher uses."""

from __future__ import annotations

import pytest

from launcher.core.overrides import argument, is_multirun, override_key, override_value, replaced, runs_a_job


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("train.lr=1e-4", "train.lr", "1e-4"),
        ("+deepspeed_extra.comet.enabled=false", "deepspeed_extra.comet.enabled", "false"),
        ("++model.x=1", "model.x", "1"),
        ("~deepspeed_extra", "deepspeed_extra", None),
        ("deepspeed@foo=z3", "deepspeed", "z3"),
        ("hydra.run.dir='out/a b'", "hydra.run.dir", "out/a b"),
        ('data.path="x=y.json"', "data.path", "x=y.json"),
        (" train.seed = 3 ", "train.seed", "3"),
    ],
)
def test_the_key_and_value_of_an_override(override, key, value):
    assert override_key(override) == key
    assert override_value(override) == value


def test_the_last_value_the_command_line_gives_a_key():
    argv = ["train.py", "train.lr=1", "+train.lr=2", "resume=auto", "-m"]
    assert argument(argv, "train.lr") == "2"
    assert argument(argv, "resume") == "auto"
    assert argument(argv, "train.seed") is None
    assert argument(["train.lr=3"], "train.lr") is None  # the first item is the program, not an override


def test_flags_that_print_instead_of_running_a_job():
    assert runs_a_job(["train.py", "train.lr=1"])
    for flag in ("--cfg", "--cfg=job", "-c", "--help", "-h", "--info", "--hydra-help", "--version"):
        assert not runs_a_job(["train.py", flag]), flag
    assert is_multirun(["train.py", "-m", "a=1,2"]) and is_multirun(["train.py", "--multirun"])
    assert not is_multirun(["train.py", "a=1"])


def test_new_overrides_replace_the_old_ones_of_the_same_key():
    """A resume reruns the old command line with the new one's overrides winning."""
    old = ["train.max_steps=40", "deepspeed=z3", "resume=auto", "+deepspeed_extra.x=1"]
    new = ["resume=/runs/a", "train.max_steps=80", "~deepspeed_extra.x"]
    assert replaced(old, new) == ["deepspeed=z3", "resume=/runs/a", "train.max_steps=80", "~deepspeed_extra.x"]
    assert replaced(old, []) == old and replaced([], new) == new
