"""The config `python train.py OVERRIDES` runs with (launcher.config.compose), and what the conf/ tree
composes to: the real presets' published recipes (conf/recipe/), the command line winning over them."""

from __future__ import annotations

import pytest
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from launcher.config.compose import CONF_DIR, compose, composition_error, without_hydra
from launcher.config.schema import typed
from launcher.job.planning import training_length
from tests.helpers import CONF, ROOT, compose_config

# model, method -> what the recipe's source sets (conf/recipe/*.yaml names it)
RECIPES = {
    ("llava_1_5_7b", "full"): {"lr": 2e-5, "micro_batch_size": 16, "global_batch_size": 128, "epochs": 1},
    ("llava_1_5_7b", "lora"): {"lr": 2e-4, "micro_batch_size": 16, "global_batch_size": 128, "epochs": 1},
    ("qwen2_vl_2b", "full"): {"lr": 1e-5, "micro_batch_size": 1, "grad_accum": 2, "epochs": 3},
    ("qwen2_vl_2b", "lora"): {"lr": 1e-4, "micro_batch_size": 1, "grad_accum": 8, "epochs": 3},
    ("qwen2_5_vl_7b", "full"): {"lr": 1e-5, "micro_batch_size": 1, "grad_accum": 2, "epochs": 3},
    ("qwen2_5_vl_7b", "lora"): {"lr": 1e-4, "micro_batch_size": 1, "grad_accum": 8, "epochs": 3},
}


# ----------------------------------------------------------------------------- compose
def test_compose_gives_the_task_config_and_with_hydra_also_hydras_node():
    assert CONF_DIR == ROOT / "conf" == CONF
    cfg = compose(["train.lr=0.5", "deepspeed=z3"])
    assert isinstance(cfg, DictConfig) and "hydra" not in cfg
    assert cfg.train.lr == 0.5 and cfg.zero.stage == 3
    full = compose(["deepspeed=z3"], with_hydra=True)
    assert full.hydra.runtime.choices.deepspeed == "z3" and list(full.hydra.overrides.task) == ["deepspeed=z3"]
    task, node = without_hydra(full)
    assert task is full and "hydra" not in task and node.runtime.choices.zero == "stage3"
    assert task == compose(["deepspeed=z3"])


def test_a_misspelt_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match=r"train\.lrr"):
        compose(["train.lrr=1"])


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("zero.stag=3", "Could not override 'zero.stag': Key 'stag' not in 'ZeroConfig'"),
        ("offload.optimizer=cpuu", "offload.optimizer=cpuu: Invalid value 'cpuu', expected one of [none, cpu, nvme]"),
        ("deepspeed=z9", "Could not find 'deepspeed/z9'; Available options in 'deepspeed': z0, z1, z2, z2_offload"),
    ],
)
def test_a_config_that_does_not_compose_gets_one_line_with_hydras_reason(override, line):
    """The line the tools under train.py print (python -m launcher.plan, launcher.prepare)."""
    with pytest.raises(Exception) as info:
        compose([override])
    text = composition_error(info.value)
    assert line in text and "\n" not in text


def test_inside_a_running_hydra_app_its_own_instance_composes(tmp_path):
    """A job of train.py (or a sweep's) composes through the Hydra instance that runs it."""
    (tmp_path / "config.yaml").write_text("marker: 1\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        assert compose(["marker=2"]) == {"marker": 2}
    assert "marker" not in compose([])  # outside it, conf/ again


# ----------------------------------------------------------------------------- recipes
@pytest.mark.parametrize(("model", "method"), list(RECIPES), ids=["_".join(key) for key in RECIPES])
def test_a_real_preset_trains_with_its_published_recipe(model, method):
    cfg = compose_config([f"model={model}", f"method={method}"])
    for key, value in RECIPES[model, method].items():
        assert cfg.train[key] == value, key
    assert cfg.train.max_steps is None  # the length is the recipe's epochs
    assert cfg.train.min_lr_ratio == 0.0 and cfg.model.gradient_checkpointing
    assert cfg.train.warmup_ratio == (0.03 if model.startswith("llava") else 0.1)


def test_every_recipe_file_belongs_to_a_model_and_method_and_names_its_source():
    models = {path.stem for path in (CONF / "model").glob("*.yaml")}
    methods = {path.stem for path in (CONF / "method").glob("*.yaml")}
    files = sorted((CONF / "recipe").glob("*.yaml"))
    assert {path.stem for path in files} == {f"{model}_{method}" for model, method in RECIPES}
    for path in files:
        model, _, method = path.stem.rpartition("_")
        assert model in models and method in methods, path.name
        text = path.read_text()
        assert text.startswith("# @package _global_") and ("LLaVA" in text or "LLaMA-Factory" in text), path.name


def test_the_command_line_wins_over_a_recipe_and_the_tiny_default_has_none():
    cfg = compose_config(["model=llava_1_5_7b", "train.lr=1e-3", "train.max_steps=50", "method.r=8"])
    assert cfg.train.lr == 1e-3 and cfg.train.max_steps == 50
    config = typed(cfg)
    assert training_length(config) == (config, None)  # max_steps wins over the recipe's epochs
    cfg = compose_config(["model=llava_1_5_7b", "method=lora", "method.r=8"])
    assert cfg.method.r == 8 and cfg.method.alpha == 256
    dropped = compose_config(["model=llava_1_5_7b", "~recipe"])  # the recipe dropped: the defaults again
    assert dropped.train.lr == 1e-3 and dropped.train.max_steps == 1000
    default = compose_config([])
    assert default.train.lr == 1e-3 and default.train.max_steps == 1000 and default.train.epochs is None
