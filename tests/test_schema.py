"""Closed choices are enums in the schema: a misspelt one fails when the config is composed.

Hydra's compose error names the key and lists the options, before any process starts, any file is
written or anything heavy is imported. The table is built from the schema itself, so a choice field
added later is covered without editing this file.
"""

from __future__ import annotations

import dataclasses
import enum
import typing

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from launcher.config import schema
from tests.conftest import compose_config


def _choice_fields() -> list[tuple[str, type[enum.Enum]]]:
    """(dotted key, enum type) of every enum-typed field of the composed config."""
    hints = typing.get_type_hints(schema.Config)
    found = []
    for group in dataclasses.fields(schema.Config):
        node = hints[group.name]
        if dataclasses.is_dataclass(node):
            inner = typing.get_type_hints(node)
            found += [(f"{group.name}.{name}", _enum_of(hint)) for name, hint in inner.items() if _enum_of(hint)]
        elif _enum_of(node):
            found.append((group.name, _enum_of(node)))
    return found


def _is_list(key: str) -> bool:
    """Whether the field holds a list of choices (`plan.precisions=[bf16]`)."""
    group, _, name = key.partition(".")
    hint = typing.get_type_hints(typing.get_type_hints(schema.Config)[group]).get(name) if name else None
    return any(typing.get_origin(arg) is list for arg in (hint, *typing.get_args(hint)))


def _enum_of(hint: object) -> type[enum.Enum] | None:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint
    for arg in typing.get_args(hint):  # Optional[E], list[E]
        if (found := _enum_of(arg)) is not None:
            return found
    return None


CHOICE_FIELDS = _choice_fields()
# Fields that must be closed choices (the list); the table covers at least these.
REQUIRED = {
    "precision.dtype",
    "offload.optimizer",
    "offload.param",
    "dist.launcher",
    "dist.backend",
    "logger.mode",
    "preflight",
    "objective",
    "data.on_bad_record",
    "model.source",
    "model.arch",
    "plan.precisions",
}


def test_every_closed_choice_is_an_enum_field():
    assert {key for key, _ in CHOICE_FIELDS} >= REQUIRED


@pytest.mark.parametrize(("key", "choices"), CHOICE_FIELDS, ids=[key for key, _ in CHOICE_FIELDS])
def test_a_misspelt_choice_fails_at_compose_time_listing_the_options(key, choices):
    options = [member.value for member in choices]
    typo = options[0][:-1] + "x" if len(options[0]) > 1 else "zz"
    listed = _is_list(key)
    value = f"[{typo}]" if listed else typo
    with pytest.raises((ConfigCompositionException, ValidationError)) as caught:
        compose_config([f"{key}={value}"])
    text = str(caught.value) + str(caught.value.__cause__ or "")
    assert f"Invalid value '{typo}', expected one of [{', '.join(options)}]" in text
    # And every listed option composes.
    for option in options:
        cfg = compose_config([f"{key}=[{option}]" if listed else f"{key}={option}"])
        got = _get(cfg, key)[0] if listed else _get(cfg, key)
        assert got == option and str(got) == option and f"{got}" == option


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def test_train_py_refuses_a_misspelt_choice_before_anything_starts(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("logger.mode=onlin", f"hydra.run.dir={run_dir}", timeout=120)
    assert result.returncode == 1
    assert "Invalid value 'onlin', expected one of [auto, online, offline, disabled]" in result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()  # nothing started, nothing written


def test_the_train_knobs_have_their_values_in_yaml_only():
    """conf/train/default.yaml holds every training knob's value; the schema only types them."""
    import yaml

    from tests.conftest import CONF

    values = yaml.safe_load((CONF / "train" / "default.yaml").read_text())
    fields = {f.name: f for f in dataclasses.fields(schema.TrainConfig)}
    assert set(values) == set(fields)
    from omegaconf import MISSING

    assert all(f.default is MISSING for f in fields.values())
    assert dict(compose_config([]).train) == values
