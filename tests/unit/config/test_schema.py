"""The config schema (launcher.config.schema): closed choices are enums, so a misspelt one fails when the
config is composed; the typed form round-trips through JSON and YAML; a resume runs in its own directory.

Hydra's compose error names the key and lists the options, before any process starts, any file is
written or anything heavy is imported. The table is built from the schema itself, so a choice field
added later is covered without editing this file.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
import typing

import pytest
import yaml
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ValidationError

from launcher.config import schema
from launcher.config.compose import compose
from launcher.config.schema import Config, config_from_yaml, from_plain, plain, run_dir_of, typed
from launcher.core.rundir import RunDir
from tests.helpers import CONF, compose_config


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


@pytest.fixture(scope="module")
def composed():
    """The default job's composed config, for the options that need no composition of their own."""
    return compose_config([])


def test_every_closed_choice_is_an_enum_field():
    assert {key for key, _ in CHOICE_FIELDS} >= REQUIRED


@pytest.mark.parametrize(("key", "choices"), CHOICE_FIELDS, ids=[key for key, _ in CHOICE_FIELDS])
def test_a_misspelt_choice_fails_at_compose_time_listing_the_options(key, choices, composed):
    options = [member.value for member in choices]
    typo = options[0][:-1] + "x" if len(options[0]) > 1 else "zz"
    listed = _is_list(key)
    value = f"[{typo}]" if listed else typo
    with pytest.raises((ConfigCompositionException, ValidationError)) as caught:
        compose_config([f"{key}={value}"])
    text = str(caught.value) + str(caught.value.__cause__ or "")
    assert f"Invalid value '{typo}', expected one of [{', '.join(options)}]" in text
    # And every listed option is taken, as Hydra applies an override (OmegaConf.update on the composed
    # config, which validates against the schema), and reads back as its string.
    for option in options:
        cfg = copy.deepcopy(composed)
        OmegaConf.update(cfg, key, [option] if listed else option, merge=True)
        got = _get(cfg, key)[0] if listed else _get(cfg, key)
        assert got == option and str(got) == option and f"{got}" == option
    assert compose_config([f"{key}=[{options[-1]}]" if listed else f"{key}={options[-1]}"])  # and on the command line


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def test_the_train_knobs_have_their_values_in_yaml_only():
    """conf/train/default.yaml holds every training knob's value; the schema only types them."""
    values = yaml.safe_load((CONF / "train" / "default.yaml").read_text())
    fields = {f.name: f for f in dataclasses.fields(schema.TrainConfig)}
    assert set(values) == set(fields)
    assert all(f.default is MISSING for f in fields.values())
    # max_steps: 1000 unless train.epochs is given (schema.steps_unless_epochs)
    assert values["max_steps"] == "${steps_unless_epochs:${.epochs}}"
    assert dict(compose_config([]).train) == {**values, "max_steps": schema.DEFAULT_MAX_STEPS}


def test_an_explicit_epochs_replaces_the_default_length_and_an_explicit_max_steps_wins_over_it():
    length = {
        (): (1000, None),
        ("train.epochs=1",): (None, 1.0),
        ("train.epochs=1", "train.max_steps=5"): (5, 1.0),
        ("train.max_steps=7",): (7, None),
    }
    for overrides, expected in length.items():
        train = typed(compose_config(list(overrides))).train
        assert (train.max_steps, train.epochs) == expected, overrides


# ----------------------------------------------------------------------------- the typed form
def test_the_typed_config_has_every_value_typed_and_resolved(monkeypatch, tmp_path):
    monkeypatch.setenv("VLM_LAUNCHER_CACHE", str(tmp_path / "cache"))
    config = typed(compose_config(["precision=bf16", "plan.precisions=[bf16,fp32]"]))
    assert isinstance(config, Config) and isinstance(config.train, schema.TrainConfig)
    assert config.precision.dtype is schema.Precision.bf16 and config.precision.dtype == "bf16"
    assert config.plan.precisions == [schema.PlannedPrecision.bf16, schema.PlannedPrecision.fp32]
    assert config.cache_dir == str(tmp_path / "cache")  # ${oc.env:...} resolved
    assert f"{config.precision.dtype}" == "bf16" and json.dumps(config.precision.dtype) == '"bf16"'


def test_plain_is_json_data_and_from_plain_types_it_again():
    config = typed(compose_config(["model=qwen2_vl_2b", "method=lora", "+deepspeed_extra.steps_per_print=5"]))
    data = plain(config)
    assert data["precision"]["dtype"] == "fp32" and type(data["precision"]["dtype"]) is str
    assert data["deepspeed_extra"] == {"steps_per_print": 5} and data["train"]["betas"] == [0.9, 0.999]
    assert json.loads(json.dumps(data)) == data
    assert from_plain(json.loads(json.dumps(data))) == config
    assert plain((schema.Precision.bf16, [1, 2])) == ["bf16", [1, 2]]


def test_from_plain_refuses_what_the_schema_does_not_have():
    data = plain(typed(compose_config([])))
    data["train"]["lrr"] = 1.0
    with pytest.raises(Exception, match="lrr"):
        from_plain(data)


def test_a_runs_saved_config_reads_back_typed_with_its_interpolations_resolved(tmp_path, monkeypatch):
    monkeypatch.setenv("VLM_LAUNCHER_CACHE", str(tmp_path / "cache"))
    cfg = compose_config(["train.lr=0.25", "logger.mode=offline"])
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))  # as .hydra/config.yaml holds it: ${oc.env:...} unresolved
    assert "${oc.env:VLM_LAUNCHER_CACHE" in path.read_text()
    config = config_from_yaml(path)
    assert config == typed(cfg) and config.train.lr == 0.25 and config.cache_dir == str(tmp_path / "cache")
    assert config.logger.mode is schema.LoggerMode.offline


# ----------------------------------------------------------------------------- where a job runs
def test_a_resume_runs_in_the_run_directory_it_names_once_a_job_was_started_there(tmp_path, monkeypatch):
    fresh = "outputs/runs/today/now"
    for resume in (None, "", "auto", "null"):
        assert run_dir_of(resume, fresh) == fresh
    run = RunDir(tmp_path / "run")
    assert run_dir_of(str(run.path), fresh) == fresh  # nothing was started there: a new run
    run.write_hydra_files({}, {}, ["train.max_steps=5"])
    assert run_dir_of(str(run.path), fresh) == str(run.path)
    monkeypatch.chdir(tmp_path)
    assert run_dir_of("run", fresh) == str(run.path)  # a relative one, made absolute
    # conf/config.yaml's hydra.run.dir goes through the resolver.
    assert compose([f"resume={run.path}"], with_hydra=True).hydra.run.dir == str(run.path)
    assert compose(["resume=auto", "hydra.run.dir=/x/y"], with_hydra=True).hydra.run.dir == "/x/y"
