"""Every knob's range, checked once before a job is planned (launcher.config.ranges.check_config).

The train.* ranges used to be build_ds_config's; they are check_config's now, with the same messages.
Each error is one line that names the key and its value.
"""

from __future__ import annotations

import re

import pytest

from launcher.config.ranges import (
    CHECKS,
    RANGES,
    SOURCE_RANGES,
    TRAIN_RANGES,
    TUNE_RANGES,
    WORKERS_PER_CORE,
    check_config,
    usable_cores,
    value_of,
)
from launcher.core.errors import LauncherError
from tests.helpers import compose_config, compose_typed, run_here


def refusal(overrides: list[str], *, tuner: bool = False) -> str:
    with pytest.raises(LauncherError) as err:
        check_config(compose_typed(overrides), tuner=tuner)
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == 2
    return message


def test_the_default_job_and_the_real_presets_are_in_range():
    check_config(compose_typed([]), tuner=True)
    check_config(compose_config([]), tuner=True)  # a composed DictConfig reads the same, by attribute
    for model in ("tiny_qwen2_vl", "qwen2_vl_2b", "llava_1_5_7b", "qwen2_5_vl_7b"):
        check_config(compose_typed([f"model={model}", "method=lora"]))


def test_every_row_names_a_key_of_the_schema():
    config = compose_typed([])
    for row in (*SOURCE_RANGES, *RANGES, *TRAIN_RANGES, *TUNE_RANGES):
        value_of(config, row.key)  # an AttributeError here: a row for a key the schema does not have
    assert value_of(config, "train.lr") == config.train.lr and value_of(config, "dist") is config.dist
    groups = {"model", "data", "dist", "train", "logger", "plan", "method", "tune", "loss"}
    assert {rule.group for rule in CHECKS} <= groups


# ----------------------------------------------------------------------------- the training knobs
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr=0", "train.lr=0.0 must be positive"),
        ("train.max_steps=0", "train.max_steps=0 must be positive"),
        ("train.warmup_steps=1400", r"train.warmup_steps=1400 must lie in \[1, train.max_steps=1000\)"),
        ("train.warmup_steps=0", r"train.warmup_steps=0 must lie in .* needs at least one warm-up step"),
        ("train.grad_clip=-1", "train.grad_clip=-1.0 must not be negative"),
        ("train.weight_decay=-0.1", "train.weight_decay=-0.1 must not be negative"),
        ("train.lr=inf", "train.lr=inf must be a finite number"),
        ("train.eps=-1e-8", r"train.eps=-1e-08 must lie in \(0, 1\)"),
        ("train.eps=0", r"train.eps=0.0 must lie in \(0, 1\): Adam divides by sqrt\(v\) \+ eps"),
        ("train.log_every=0", "train.log_every=0 must be positive"),
        ("train.eval_every=-1", "train.eval_every=-1 must not be negative"),
        ("train.min_lr_ratio=1.5", r"train.min_lr_ratio=1.5 must lie in \[0, 1\]"),
        ("train.betas=[0.9]", r"train.betas=\[0.9\] must be two numbers in \[0, 1\), e.g. \[0.9, 0.95\]"),
        ("train.betas=[0.9,1.0]", r"train.betas=\[0.9, 1.0\] must be two numbers in \[0, 1\)"),
        ("train.seed=-1", r"train.seed=-1 must lie in \[0, 2\*\*32\)"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints=0 must be positive"),
        ("train.max_nonfinite_steps=-1", "train.max_nonfinite_steps=-1 must be at least 0"),
        ("train.profile_steps=[3]", r"train.profile_steps=\[3\] must be \[FIRST,LAST\], the steps to profile"),
        ("train.profile_steps=[4,2]", r"train.profile_steps=\[4, 2\] must be \[FIRST,LAST\].*1 <= FIRST <= LAST"),
        ("train.profile_steps=[0,1]", r"train.profile_steps=\[0, 1\] must be \[FIRST,LAST\]"),
    ],
)
def test_bad_training_values_are_refused(override, message):
    assert re.search(message, refusal(["deepspeed=z2", override]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.max_steps=null"], "train.max_steps=null and train.epochs=null: give the training length"),
        (["train.max_steps=null", "train.epochs=0"], "train.epochs=0.0 must be a positive number of passes"),
        (["train.warmup_ratio=1.5"], "train.warmup_ratio=1.5 must be a fraction in [0, 1)"),
    ],
)
def test_a_bad_length_is_one_clear_line(overrides, message):
    assert message in refusal(overrides)


def test_a_length_in_epochs_alone_is_in_range():
    check_config(compose_typed(["train.max_steps=null", "train.epochs=0.5", "train.warmup_ratio=0.1"]))


# ----------------------------------------------------------------------------- the rest of the job
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.path=/models/x"], "model.path=/models/x is given, but model=tiny_llava builds a tiny model"),
        (["model=qwen2_vl_2b", "model.path=null"], "model.path is empty for model=qwen2_vl_2b"),
        (["model.arch=null"], "model.arch is not set for the tiny model model=tiny_llava"),
        (["model.hidden_size=48"], "model.hidden_size=48 must be a positive multiple of 32"),
        (["model.vision_hidden_size=0"], "model.vision_hidden_size=0 must be a positive multiple of 32"),
        (["model.num_layers=0"], "model.num_layers=0 must be positive"),
        (["model.num_layers=100000"], "model.num_layers=100000 must be at most 256 for a model built from code"),
        (["model.vision_hidden_size=65536"], "model.vision_hidden_size=65536 must be at most 32768"),
        (["model.image_size=36"], "model.image_size=36 must be a multiple of model.patch_size=8"),
        (["model=tiny_qwen2_vl", "model.image_size=24", "model.patch_size=8"], "= 3 must be even"),
        (["model.min_pixels=0"], "model.min_pixels=0 must be a positive number of pixels per image"),
        (["model.min_pixels=1000", "model.max_pixels=10"], "model.max_pixels=10 is below model.min_pixels=1000"),
        (["data.n_train=0"], "data.n_train=0 must be positive"),
        (["data.image_size=4"], "data.image_size=4 must be at least 8"),
        (["data.max_length=0"], "data.max_length=0 must be a positive number of tokens per sample"),
        (["data.pack_max_images=0"], "data.pack_max_images=0 must be positive"),
        (["data.num_workers=-1"], "data.num_workers=-1 must lie in [0, "),
        (["dist.nproc_per_node=0"], "dist.nproc_per_node=0 must be positive"),
        (["dist.master_port=70000"], "dist.master_port=70000 must be a TCP port in [1, 65535]"),
        (["dist.step_timeout_s=-1"], "dist.step_timeout_s=-1.0 must be a number of seconds, or 0 (or null) for no"),
        (["logger.log_every=0"], "logger.log_every=0 must be positive"),
        (["plan.headroom=1"], "plan.headroom=1.0 must be a fraction in [0, 1)"),
        (["plan.gpu_memory_gb=0"], "plan.gpu_memory_gb=0.0 must be a positive number of GiB"),
        (["plan.seq_len=0"], "plan.seq_len=0 must be positive"),
        (["loss.chunk_tokens=-1"], "loss.chunk_tokens=-1 must be"),
        (["data.video.fps=0"], "data.video.fps=0.0 must be a positive number of frames per second"),
        (["data.video.fps=inf"], "data.video.fps=inf must be a positive number of frames per second"),
        (["data.video.min_frames=0"], "data.video.min_frames=0 must be positive"),
        (["data.video.max_frames=0"], "data.video.max_frames=0 must be a positive number of frames per video"),
        (
            ["data.video.min_frames=9", "data.video.max_frames=8"],
            "data.video.min_frames=9 is over data.video.max_frames=8",
        ),
        (["data.video.max_pixels=10"], "data.video.max_pixels=10 must be at least 64"),
        (["data.video.max_seconds=0"], "data.video.max_seconds=0.0 must be a positive length, or null"),
        (["data.video.grid=0"], "data.video.grid=0 must be positive"),
        # Named, not the tiny LLaVA's model.image_size the motion task makes from it.
        (["data.task=motion", "data.video.grid=0"], "data.video.grid=0 must be positive"),
        (["plan.videos_per_sample=-1"], "plan.videos_per_sample=-1 must be at least 0"),
    ],
)
def test_bad_values_of_the_job_are_refused_naming_the_key(overrides, message):
    assert message in refusal(overrides)


def test_data_workers_are_capped_by_the_usable_cores():
    cores = usable_cores()
    assert cores >= 1
    check_config(compose_typed([f"data.num_workers={WORKERS_PER_CORE * cores}"]))
    message = refusal([f"data.num_workers={WORKERS_PER_CORE * cores + 1}"])
    assert f"must lie in [0, {WORKERS_PER_CORE * cores}] ({WORKERS_PER_CORE} per usable core, {cores} here)" in message


def test_the_data_sets_own_ranges_hold_only_for_the_built_in_set():
    check_config(compose_typed(["data=llava_json", "data.path=x.json", "data.n_train=0"]))
    assert "data.n_train=0" in refusal(["data=shapes", "data.n_train=0"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("method.r=0", "method.r=0 must be a positive LoRA rank"),
        ("method.alpha=0", "method.alpha=0.0 must be positive (usually 2 x method.r)"),
        ("method.dropout=1", r"method.dropout=1.0 must lie in [0, 1)"),
    ],
)
def test_lora_ranges_hold_for_adapters_only(override, message):
    assert message in refusal(["method=lora", override])
    assert message in refusal(["method=qlora", override])
    check_config(compose_typed(["method=full"]))  # a full fine-tune has no adapter values to check


def test_the_tuners_ranges_are_checked_for_the_tuner_only():
    config = compose_typed(["tune.measure_steps=0"])
    check_config(config)  # a job does not read the tune group
    with pytest.raises(LauncherError, match=r"^tune.measure_steps=0 must be 1 or more$"):
        check_config(config, tuner=True)
    assert "tune.margin=-0.1 must be positive (or 0)" in refusal(["tune.margin=-0.1"], tuner=True)


def test_several_mistakes_report_the_model_first_then_the_job_then_the_training_knobs():
    assert refusal(["train.lr=0", "data.n_train=0", "model.hidden_size=48"]).startswith("model.hidden_size=48")
    assert refusal(["train.lr=0", "data.n_train=0"]).startswith("data.n_train=0")
    assert refusal(["train.lr=0", "train.warmup_steps=0"]).startswith("train.lr=0.0")  # relations last


def test_the_launcher_refuses_a_value_out_of_range_before_planning(tmp_path):
    """What `python train.py train.max_steps=null` ends with (tests/e2e/test_cli.py runs one such refusal
    as a subprocess): one line, exit code 2, no DeepSpeed dict written."""
    run_dir = tmp_path / "run"
    ran = run_here(["train.max_steps=null", "dry_run=true"], run_dir)
    assert (ran.outcome.status, ran.outcome.exit_code) == ("failed", 2)
    assert ran.error.startswith("train.max_steps=null and train.epochs=null: give the training length")
    assert ran.outcome.lines() == [(f"error: {ran.error}", True)]
    assert not (run_dir / "ds_config.json").exists() and not (run_dir / "job.json").exists()
