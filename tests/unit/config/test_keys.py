"""launcher.config.keys: a key the launcher does not read is refused, added with `+` or not, naming the key
meant where the user typed another tool's name (issue 44: `+train.learning_rate=1e-4` trained at the default
rate)."""

from __future__ import annotations

import itertools

import pytest

from launcher.config.compose import ConfigNotComposed, compose_typed
from launcher.config.keys import ALIASES, hint, schema_keys, unknown_keys
from tests.helpers import compose_config, run_here

PRESETS = {
    "model": ["tiny_llava", "tiny_qwen2_vl", "qwen2_vl_2b", "qwen2_5_vl_7b", "llava_1_5_7b"],
    "method": ["full", "lora", "qlora"],
}


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        *([f"model={model}", f"method={method}"] for model, method in itertools.product(*PRESETS.values())),
        *([f"experiment={name}"] for name in ("lr_search", "precision_sweep", "zero_sweep")),
        ["loss=dpo"], ["deepspeed=z3_nvme", "offload.nvme_path=/nvme"],
        ["+train.groups.heads.lr=1e-3", "+train.groups.heads.match=[lm_head]"],
        ["+deepspeed_extra.wall_clock_breakdown=true"],
    ],
)  # fmt: skip
def test_every_preset_and_the_users_own_groups_compose_to_keys_the_launcher_reads(overrides):
    """Recipes, experiments and presets set schema keys only; parameter groups and DeepSpeed's extra keys are
    the user's to name."""
    assert unknown_keys(compose_config(overrides)) == []


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("+train.learning_rate=1e-4", "train.learning_rate: the launcher reads no such key, so it would be ignored; "
         "did you mean train.lr? (learning_rate is another tool's name for it); python train.py --cfg job lists "
         "every key"),
        ("+cutoff_len=512", "cutoff_len: the launcher reads no such key, so it would be ignored; did you mean "
         "data.max_length?"),
        ("+foo=1", "foo: the launcher reads no such key, so it would be ignored; python train.py --cfg job"),
        ("+model.freeze_vison=false", "model.freeze_vison: the launcher reads no such key, so it would be ignored; "
         "did you mean model.freeze_vision?"),
    ],
)  # fmt: skip
def test_a_key_added_with_a_plus_that_nothing_reads_is_refused_naming_the_one_meant(override, line):
    with pytest.raises(ConfigNotComposed) as refused:
        compose_typed([override])
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("override", "meant"),
    [
        ("train.learning_rate=1e-4", "did you mean train.lr?"),
        ("learning_rate=1e-4", "did you mean train.lr?"),
        ("train.gradient_accumulation_steps=4", "did you mean train.grad_accum?"),
        ("zero.stag=2", "did you mean zero.stage?"),
        ("train.micro_bach_size=2", "did you mean train.micro_batch_size?"),
    ],
)
def test_a_key_the_schema_lacks_names_the_one_meant(override, meant):
    with pytest.raises(ConfigNotComposed) as refused:
        compose_typed([override])
    assert str(refused.value).startswith(f"Could not override '{override.split('=')[0]}'")
    assert meant in str(refused.value)


def test_every_alias_names_a_key_or_a_choice_of_the_launcher():
    keys = {key for key, _ in schema_keys()}
    for alias, meant in ALIASES.items():
        target = meant.split()[0].split("=")[0]
        assert target in keys or target in {"precision", "logger", "loss", "method", "resume", "hydra.run.dir"}, alias
    assert hint("per_device_train_batch_size").startswith("did you mean train.micro_batch_size?")


def test_the_launcher_refuses_the_key_before_it_writes_anything(tmp_path):
    ran = run_here(["+train.learning_rate=1e-4", "dry_run=true"], tmp_path / "run")
    assert ran.outcome.exit_code == 1 and "did you mean train.lr?" in ran.outcome.error
    # Nothing but the run directory's lock and reserve: no .hydra/, no job.json, no ds_config.json, no summary.json.
    assert {path.name for path in (tmp_path / "run").iterdir()} <= {".lock", ".reserve"}
