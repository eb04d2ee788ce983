"""Batch arithmetic (launcher.config.batch): any two of micro batch, accumulation and global batch fix the
third; with a DeepSpeed JSON base, an error says where each number came from."""

from __future__ import annotations

import re

import pytest

from launcher.config.batch import (
    BATCH_KEYS,
    TRAIN_BATCH_KEYS,
    BatchSizes,
    batch_givens,
    resolve_batch_sizes,
    resolve_givens,
)
from launcher.core.errors import LauncherError

TRAIN = {"micro_batch_size": 32, "grad_accum": None, "global_batch_size": None}  # conf/train/default.yaml's


@pytest.mark.parametrize(
    ("micro", "accum", "total", "world", "expected"),
    [
        (16, None, None, 1, (16, 1, 16)),
        (4, 2, None, 8, (4, 2, 64)),
        (4, None, 64, 8, (4, 2, 64)),
        (None, 2, 64, 8, (4, 2, 64)),
        (4, 2, 64, 8, (4, 2, 64)),
        (1, None, 1, 1, (1, 1, 1)),
    ],
)
def test_any_two_batch_sizes_determine_the_third(micro, accum, total, world, expected):
    sizes = resolve_batch_sizes(micro, accum, total, world)
    assert (sizes.micro, sizes.accum, sizes.total) == expected
    assert sizes.total == sizes.micro * sizes.accum * world


@pytest.mark.parametrize(
    ("micro", "accum", "total", "world", "message"),
    [
        (
            4,
            2,
            60,
            8,
            "train.global_batch_size=60 but train.micro_batch_size=4 x train.grad_accum=2 x world size 8 = 64",
        ),
        (4, None, 60, 8, "not divisible by train.micro_batch_size=4 x world size 8 = 32"),
        (None, 3, 64, 8, "not divisible by train.grad_accum=3 x world size 8 = 24"),
        (None, None, 64, 1, "with train.global_batch_size also give"),
        (None, 2, None, 1, "underdetermined"),
        (0, None, None, 1, "train.micro_batch_size=0 must be a positive integer"),
        (4, -1, None, 1, "train.grad_accum=-1 must be a positive integer"),
        (4, None, 0, 1, "train.global_batch_size=0 must be a positive integer"),
        (True, None, None, 1, "train.micro_batch_size=True must be a positive integer"),  # not a number of samples
        (4.0, None, None, 1, "train.micro_batch_size=4.0 must be a positive integer"),
        (4, None, None, 0, "world size must be at least 1, got 0"),
    ],
)
def test_inconsistent_or_indivisible_batch_sizes_show_the_numbers(micro, accum, total, world, message):
    with pytest.raises(LauncherError, match=re.escape(message)):
        resolve_batch_sizes(micro, accum, total, world)


def test_the_key_tables_name_deepspeeds_three_batch_keys():
    assert set(TRAIN_BATCH_KEYS.values()) == set(BATCH_KEYS)
    assert list(TRAIN_BATCH_KEYS) == ["micro_batch_size", "grad_accum", "global_batch_size"]


# ----------------------------------------------------------------------------- where each number comes from
def _values(givens) -> tuple:
    return tuple(given.value for given in givens)


def _origins(givens) -> tuple:
    return tuple(given.origin for given in givens)


def test_without_a_base_the_train_node_decides_and_named_keys_are_overrides():
    givens = batch_givens(TRAIN, None, frozenset(), "deepspeed_json")
    assert _values(givens) == (32, None, None) and _origins(givens) == ("default", "default", "default")
    givens = batch_givens(TRAIN, None, frozenset({"train.micro_batch_size"}), "deepspeed_json")
    assert _origins(givens) == ("override", "default", "default")
    assert _origins(batch_givens(TRAIN, None, frozenset({"train"}), "x")) == ("override",) * 3  # train= names all
    assert resolve_givens(givens, 2) == BatchSizes(micro=32, accum=1, total=64)


def test_a_bases_concrete_values_fill_what_the_command_line_does_not_name():
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}
    givens = batch_givens(TRAIN, base, frozenset(), "ds.json")
    assert _values(givens) == (4, 4, 16) and _origins(givens) == ("file", "file", "file")
    assert resolve_givens(givens, 1) == BatchSizes(micro=4, accum=4, total=16)
    # A named micro batch wins; the file's accumulation stays; its global batch is derived again.
    named = {**TRAIN, "micro_batch_size": 8}
    givens = batch_givens(named, base, frozenset({"train.micro_batch_size"}), "ds.json")
    assert _values(givens) == (8, 4, None) and _origins(givens)[:2] == ("override", "file")
    assert resolve_givens(givens, 1) == BatchSizes(micro=8, accum=4, total=32)
    # "auto" and null leaves of the file are not values: the train node fills in.
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": 2}
    givens = batch_givens(TRAIN, auto, frozenset(), "ds.json")
    assert _values(givens) == (32, 2, None) and _origins(givens)[:2] == ("default", "file")
    assert resolve_givens(givens, 2) == BatchSizes(micro=32, accum=2, total=128)


@pytest.mark.parametrize(
    ("train", "base", "world", "message"),
    [
        (
            TRAIN,
            {"gradient_accumulation_steps": 0},
            1,
            'ds.json sets gradient_accumulation_steps=0, which must be a positive integer (or "auto" to derive it): '
            "fix it in the file, or set train.grad_accum",
        ),
        (
            TRAIN,
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4},
            2,
            "inconsistent batch sizes: ds.json sets train_batch_size=16, but the file's "
            "train_micro_batch_size_per_gpu=4 x the file's gradient_accumulation_steps=4 x world size 2 = 32: "
            'set one of them to "auto" in the file',
        ),
        (
            TRAIN,
            {"train_batch_size": 48},
            1,
            "ds.json sets train_batch_size=48, which is not divisible by the default train.micro_batch_size=32 x "
            "world size 1: set train.micro_batch_size (or train_micro_batch_size_per_gpu in the file)",
        ),
        (
            {"micro_batch_size": None, "grad_accum": None, "global_batch_size": None},
            {"gradient_accumulation_steps": 2},
            1,
            "batch size is underdetermined (gradient_accumulation_steps=2 (from ds.json)): give two of "
            "train.micro_batch_size, train.grad_accum and train.global_batch_size, or set them in ds.json",
        ),
    ],
)
def test_an_error_with_a_base_names_the_file_and_where_each_number_came_from(train, base, world, message):
    with pytest.raises(LauncherError) as err:
        resolve_givens(batch_givens(train, base, frozenset(), "ds.json"), world)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
