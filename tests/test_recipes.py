"""The real presets' published recipes (conf/recipe/), and a run's length in epochs."""

from __future__ import annotations

import json
import math
import sys

import pytest

from launcher.config.knobs import warmup_steps
from launcher.core.errors import LauncherError
from launcher.job.length import resolve_training_length, steps_for_epochs
from tests.conftest import CONF, ROOT, compose_config

# model, method -> what the recipe's source sets (conf/recipe/*.yaml names it)
RECIPES = {
    ("llava_1_5_7b", "full"): {"lr": 2e-5, "micro_batch_size": 16, "global_batch_size": 128, "epochs": 1},
    ("llava_1_5_7b", "lora"): {"lr": 2e-4, "micro_batch_size": 16, "global_batch_size": 128, "epochs": 1},
    ("qwen2_vl_2b", "full"): {"lr": 1e-5, "micro_batch_size": 1, "grad_accum": 2, "epochs": 3},
    ("qwen2_vl_2b", "lora"): {"lr": 1e-4, "micro_batch_size": 1, "grad_accum": 8, "epochs": 3},
    ("qwen2_5_vl_7b", "full"): {"lr": 1e-5, "micro_batch_size": 1, "grad_accum": 2, "epochs": 3},
    ("qwen2_5_vl_7b", "lora"): {"lr": 1e-4, "micro_batch_size": 1, "grad_accum": 8, "epochs": 3},
}


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
    assert resolve_training_length(cfg, world_size=1) is None  # max_steps wins over the recipe's epochs
    cfg = compose_config(["model=llava_1_5_7b", "method=lora", "method.r=8"])
    assert cfg.method.r == 8 and cfg.method.alpha == 256
    dropped = compose_config(["model=llava_1_5_7b", "~recipe"])  # the recipe dropped: the defaults again
    assert dropped.train.lr == 1e-3 and dropped.train.max_steps == 1000
    default = compose_config([])
    assert default.train.lr == 1e-3 and default.train.max_steps == 1000 and default.train.epochs is None


def test_epochs_become_steps_over_the_records_at_the_global_batch():
    assert steps_for_epochs(1, 665_298, 128) == 5198  # LLaVA-1.5's mix665k at its global batch
    assert steps_for_epochs(3, 10, 16) == 2 and steps_for_epochs(0.01, 10, 16) == 1
    cfg = compose_config(["train.max_steps=null", "train.epochs=2", "data.n_train=100", "train.micro_batch_size=8"])
    line = resolve_training_length(cfg, world_size=1)
    assert cfg.train.max_steps == 25 and line.endswith("train.max_steps=25"), line
    cfg = compose_config(
        [
            "train.max_steps=null",
            "train.epochs=1",
            "data.n_train=100",
            "train.global_batch_size=32",
            "train.micro_batch_size=8",
        ]
    )
    resolve_training_length(cfg, world_size=2)
    assert cfg.train.max_steps == math.ceil(100 / 32)


def test_a_mixture_takes_steps_not_epochs(tmp_path):
    sources = "data.sources=[{path: a.json, weight: 3}, {path: b.json, weight: 1}]"
    cfg = compose_config(["data=mixture", sources, "train.max_steps=null", "train.epochs=1"])
    with pytest.raises(LauncherError, match=r"^train.epochs with a data mixture .*give train.max_steps instead"):
        resolve_training_length(cfg, world_size=1)


def test_warmup_ratio_rounds_up_and_an_explicit_count_wins():
    train = {"max_steps": 5198, "warmup_steps": None, "warmup_ratio": 0.03}
    assert warmup_steps(train) == 156  # ceil(155.94), as the HF Trainer rounds
    assert warmup_steps({**train, "warmup_steps": 10}) == 10
    assert warmup_steps({**train, "warmup_ratio": None}) == 5198 // 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.max_steps=null"], "train.max_steps=null and train.epochs=null: give the training length"),
        (["train.max_steps=null", "train.epochs=0"], "train.epochs=0.0 must be a positive number of passes"),
        (["train.warmup_ratio=1.5"], "train.warmup_ratio=1.5 must be a fraction in [0, 1)"),
    ],
)
def test_a_bad_length_is_one_clear_line(run_train, tmp_path, args, message):
    result = run_train(*args, "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_the_readme_plan_command_recommends_a_preset_that_fits():
    import subprocess

    command = [
        sys.executable,
        "-m",
        "launcher.plan",
        "model=llava_1_5_7b",
        "dist.nproc_per_node=8",
        "plan.gpu_memory_gb=80",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("recommendation: deepspeed=") and "nothing is expected to fit" not in last, last


@pytest.mark.slow
def test_a_run_given_in_epochs_trains_that_many_steps(run_train, tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "train.max_steps=null",
        "train.epochs=2",
        "data.n_train=64",
        "train.micro_batch_size=8",
        "logger=none",
        "train.eval_every=0",
        "data.eval_accuracy=false",
        f"hydra.run.dir={run_dir}",
    ]
    result = run_train(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train.epochs=2 over 64 training records at a global batch of 8: train.max_steps=16" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 16
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["scheduler"]["params"]["total_num_steps"] == 16
