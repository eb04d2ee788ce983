"""Nested dicts by dotted path (launcher.config.tree): the DeepSpeed dict's tools."""

from __future__ import annotations

import copy

import pytest

from launcher.config.tree import deep_merge, delete, get, is_unset, leaves, set_path

DS = {
    "train_batch_size": 16,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}},
    "optimizer": {"type": "AdamW", "params": {}},
}


def test_leaves_are_dotted_paths_and_an_empty_block_is_a_leaf():
    assert dict(leaves(DS)) == {
        "train_batch_size": 16,
        "zero_optimization.stage": 3,
        "zero_optimization.offload_param.device": "cpu",
        "zero_optimization.offload_param.pin_memory": True,
        "optimizer.type": "AdamW",
        "optimizer.params": {},
    }
    assert list(leaves({})) == []


def test_get_follows_a_path_or_gives_the_default():
    assert get(DS, "zero_optimization.offload_param.device") == "cpu"
    assert get(DS, "zero_optimization") is DS["zero_optimization"]
    assert get(DS, "zero_optimization.offload_optimizer.device") is None
    assert get(DS, "zero_optimization.offload_optimizer.device", "none") == "none"
    assert get(DS, "train_batch_size.value", "absent") == "absent"  # through a leaf: not there
    assert get({"a": {"b": None}}, "a.b", "absent") is None  # a null that is there is its value


def test_set_path_creates_the_blocks_on_its_way_and_replaces_a_leaf_in_it():
    tree: dict = {"scheduler": "WarmupLR"}
    set_path(tree, "zero_optimization.offload_param.device", "nvme")
    set_path(tree, "scheduler.params.warmup_num_steps", 10)  # a leaf in the way becomes a block
    set_path(tree, "train_batch_size", 8)
    assert tree == {
        "scheduler": {"params": {"warmup_num_steps": 10}},
        "zero_optimization": {"offload_param": {"device": "nvme"}},
        "train_batch_size": 8,
    }


def test_delete_removes_a_path_and_ignores_one_that_is_not_there():
    tree = copy.deepcopy(DS)
    delete(tree, "zero_optimization.offload_param")
    delete(tree, "zero_optimization.offload_optimizer.device")  # absent
    delete(tree, "train_batch_size.value")  # through a leaf
    delete(tree, "nothing")
    assert tree == {"train_batch_size": 16, "zero_optimization": {"stage": 3}, "optimizer": DS["optimizer"]}


def test_deep_merge_merges_blocks_recursively_into_a_new_dict():
    before = copy.deepcopy(DS)
    override = {
        "zero_optimization": {"offload_param": {"device": "nvme"}, "stage": 2},
        "optimizer": {"params": {"lr": 1}},
    }
    merged = deep_merge(DS, override)
    assert merged["zero_optimization"] == {"stage": 2, "offload_param": {"device": "nvme", "pin_memory": True}}
    assert merged["optimizer"] == {"type": "AdamW", "params": {"lr": 1}}
    assert before == DS and override["optimizer"] == {"params": {"lr": 1}}  # neither input changes
    merged["optimizer"]["params"]["lr"] = 2
    assert override["optimizer"]["params"]["lr"] == 1  # nothing shared with the inputs
    assert deep_merge({"a": {"b": 1}}, {"a": 5}) == {"a": 5}  # a value replaces a block
    assert deep_merge({"a": 5}, {"a": {"b": 1}}) == {"a": {"b": 1}}


@pytest.mark.parametrize(
    ("value", "unset"),
    [
        (None, True),
        ("auto", True),
        ("AUTO", True),
        ("Auto", True),
        (0, False),
        ("", False),
        (False, False),
        ({}, False),
    ],
)
def test_null_and_auto_are_unset(value, unset):
    assert is_unset(value) is unset
