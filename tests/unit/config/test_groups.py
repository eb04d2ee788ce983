"""launcher.config.groups: what train.groups sets, the rates it resolves to, and the schedulers that keep
them, without torch. Which parameters each group holds: tests/unit/model/test_groups.py."""

from __future__ import annotations

import pytest

from launcher.config.groups import GroupSpec, check_schedule, describe_groups, group_specs
from launcher.core.errors import LauncherError
from tests.helpers import compose_typed


def test_the_default_sets_no_group():
    assert group_specs(compose_typed().train.groups) == []


def test_parts_and_regex_groups_resolve_their_rates_against_the_base():
    specs = group_specs(
        compose_typed(
            [
                "train.groups.vision.lr=2e-5",
                "train.groups.projector.lr_scale=2",
                "train.groups.language.weight_decay=0.1",
                "+train.groups.heads.match=.*lm_head.*",
                "+train.groups.heads.lr_scale=0.5",
            ]
        ).train.groups
    )
    assert [spec.name for spec in specs] == ["vision", "projector", "language", "heads"]
    assert [spec.rate(1e-3) for spec in specs] == [2e-5, 2e-3, 1e-3, 5e-4]
    assert specs[2].weight_decay == 0.1 and specs[3].match == ".*lm_head.*"
    line = describe_groups(specs, 1e-3)
    assert line == "lr 0.001 (vision 2e-05, projector 0.002, language 0.001 wd 0.1, heads 0.0005)"
    assert describe_groups([], 1e-3) == ""


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ({"vision": 3}, "train.groups.vision=3 must be a group: {lr, lr_scale, weight_decay, match}"),
        ({"vision": {"lr": True}}, "train.groups.vision.lr=True must be a finite number, at least 0"),
        ({"vision": {"lr": float("nan")}}, "train.groups.vision.lr=nan must be a finite number, at least 0"),
        ({"vision": {"lr": "fast"}}, "train.groups.vision.lr=fast must be a finite number, at least 0"),
        ({"heads": {"match": "x"}}, "train.groups.heads sets nothing: give it lr, lr_scale or weight_decay"),
        ({"vision": {"lr": 1, "match": "x"}}, "train.groups.vision is a part of the model and takes no match"),
        ({"default": {"lr": 1, "match": "x"}}, "train.groups.default: 'default' names the parameters no group holds"),
    ],
)
def test_bad_groups_are_one_line_naming_the_key(groups, message):
    with pytest.raises(LauncherError) as refused:
        group_specs(groups)
    assert str(refused.value).startswith(message)


@pytest.mark.parametrize("scheduler", [None, "WarmupCosineLR"])
def test_a_scheduler_that_scales_each_groups_rate_keeps_them(scheduler):
    ds = {} if scheduler is None else {"scheduler": {"type": scheduler}}
    check_schedule([GroupSpec("vision", lr=1e-5)], ds)


@pytest.mark.parametrize("scheduler", ["WarmupLR", "WarmupDecayLR", "OneCycle", "LRRangeTest"])
def test_a_scheduler_that_sets_one_rate_for_every_group_is_refused_with_rated_groups(scheduler):
    check_schedule([GroupSpec("language", weight_decay=0.1)], {"scheduler": {"type": scheduler}})  # no rate of its own
    with pytest.raises(LauncherError, match=f"the scheduler {scheduler} sets every group to one rate of its own"):
        check_schedule([GroupSpec("vision", lr_scale=0.1)], {"scheduler": {"type": scheduler}})
