"""Planning a job (launcher.job.planning): the world size, a user's DeepSpeed JSON, a length given in
epochs counted in optimizer steps, what-if variants, and `plan_job` itself."""

from __future__ import annotations

import json
import math

import pytest

from launcher.config.precision import Device
from launcher.core.errors import LauncherError
from launcher.core.rundir import RunDir
from launcher.job.planning import (
    VARIANT_KEYS,
    job_credentials,
    load_deepspeed_json,
    plan_job,
    steps_for_epochs,
    training_length,
    variant_overrides,
    world_size_of,
)
from launcher.job.spec import HydraJob
from tests.helpers import compose_typed

GPU = Device("cuda", bf16=True, fp16=True, name="H100")


def planned(overrides: list[str], tmp_path, **kwargs):
    return plan_job(compose_typed(overrides), HydraJob(run_dir=tmp_path, overrides=tuple(overrides)), **kwargs)


# ----------------------------------------------------------------------------- length in epochs
def test_epochs_become_steps_over_the_records_at_the_global_batch():
    assert steps_for_epochs(1, 665_298, 128) == 5198  # LLaVA-1.5's mix665k at its global batch
    assert steps_for_epochs(3, 10, 16) == 2 and steps_for_epochs(0.01, 10, 16) == 1
    config = compose_typed(["train.max_steps=null", "train.epochs=2", "data.n_train=100", "train.micro_batch_size=8"])
    counted, line = training_length(config)
    assert counted.train.max_steps == 25 and line.endswith("train.max_steps=25"), line
    assert line == "train.epochs=2 over 100 training records at a global batch of 8: train.max_steps=25"
    assert config.train.max_steps is None and counted.train.epochs == 2  # the config given stays as it was
    config = compose_typed(
        [
            "train.max_steps=null",
            "train.epochs=1",
            "data.n_train=100",
            "train.global_batch_size=32",
            "train.micro_batch_size=8",
            "dist.nproc_per_node=2",
        ]
    )
    counted, line = training_length(config)
    assert counted.train.max_steps == math.ceil(100 / 32) and "at a global batch of 32" in line


def test_max_steps_wins_over_epochs_and_a_length_in_steps_is_left_as_it_is():
    config = compose_typed(["train.max_steps=50", "train.epochs=3"])
    assert training_length(config) == (config, None)
    config = compose_typed([])
    assert training_length(config) == (config, None)


def test_a_mixture_takes_steps_not_epochs():
    sources = "data.sources=[{path: a.json, weight: 3}, {path: b.json, weight: 1}]"
    config = compose_typed(["data=mixture", sources, "train.max_steps=null", "train.epochs=1"])
    with pytest.raises(LauncherError, match=r"^train.epochs with a data mixture .*give train.max_steps instead"):
        training_length(config)


def test_a_stream_takes_steps_not_epochs():
    stream = ["data=llava_json", "data.path=shards/*.jsonl", "data.streaming=true"]
    config = compose_typed([*stream, "train.max_steps=null", "train.epochs=1"])
    with pytest.raises(LauncherError, match=r"^train.epochs with data.streaming=true: .*give train.max_steps instead"):
        training_length(config)


def test_a_packed_run_takes_steps_not_epochs():
    config = compose_typed(["data.packing=true", "data.pack_length=256", "train.max_steps=null", "train.epochs=1"])
    with pytest.raises(LauncherError, match=r"^train.epochs with data.packing=true: .*give train.max_steps instead"):
        training_length(config)


@pytest.mark.slow
def test_a_run_given_in_epochs_trains_that_many_steps(train_in_process, tmp_path):
    run_dir = RunDir(tmp_path / "run")
    ran = train_in_process(
        "train.max_steps=null",
        "train.epochs=2",
        "data.n_train=64",
        "train.micro_batch_size=8",
        "logger=none",
        "train.eval_every=0",
        "data.eval_accuracy=false",
        run_dir=run_dir.path,
    )
    assert ran.outcome.status == "completed", ran.error
    assert "train.epochs=2 over 64 training records at a global batch of 8: train.max_steps=16" in ran.lines
    summary = ran.summary()
    assert summary["status"] == "completed" and summary["steps"] == 16
    ds = json.loads(run_dir.ds_config.read_text())
    assert ds["scheduler"]["params"]["total_num_steps"] == 16


# ----------------------------------------------------------------------------- the job
def test_the_world_size_is_ranks_per_node_times_nodes():
    assert world_size_of(compose_typed([])) == 1
    assert world_size_of(compose_typed(["dist.nproc_per_node=4", "dist.nnodes=2"])) == 8
    with pytest.raises(LauncherError, match=r"dist.nproc_per_node=0 x dist.nnodes=1 must be positive"):
        world_size_of(compose_typed(["dist.nproc_per_node=0"]))


def test_a_deepspeed_json_must_be_a_readable_json_object(tmp_path):
    path = tmp_path / "ds.json"
    with pytest.raises(LauncherError, match=f"^deepspeed_json={path}: no such file$"):
        load_deepspeed_json(str(path))
    path.write_text('{"zero_optimization": {"stage": 2,}}')
    with pytest.raises(LauncherError, match=r"not valid JSON \(line 1, column 35: Expecting property name"):
        load_deepspeed_json(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(LauncherError, match="expected a JSON object at the top level"):
        load_deepspeed_json(str(path))
    path.write_text('{"zero_optimization": {"stage": 2}}')
    assert load_deepspeed_json(str(path)) == {"zero_optimization": {"stage": 2}}


def test_the_planned_job_holds_the_validated_dict_and_its_shape(tmp_path):
    overrides = ["deepspeed=z2", "train.micro_batch_size=4", "train.grad_accum=2"]
    job = planned(overrides, tmp_path)
    assert (job.world_size, job.ranks_per_node, job.hidden_size) == (1, 1, 64)  # the tiny model's hidden size
    assert job.explicit_groups == {"zero", "offload", "train.micro_batch_size", "train.grad_accum"}
    assert job.ds_config["zero_optimization"]["stage"] == 2 and job.global_batch == 8
    assert job.ds_config["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert job.config == compose_typed(overrides) and job.run_dir == tmp_path
    assert job.model_path is None and job.resume is None and job.launch_id is None  # the launcher adds those


def test_a_job_is_planned_for_another_device_without_this_machines_checks(tmp_path):
    job = planned(
        ["deepspeed=z3_offload", "precision=auto", "dist.nproc_per_node=8"], tmp_path, device=GPU, validate=False
    )
    assert job.device == GPU and job.precision == "bf16" and job.world_size == 8
    assert planned(["precision=auto"], tmp_path, device=GPU, hidden_size=4096).ds_config["bf16"]["enabled"]
    job = planned(["deepspeed=z2", "precision=auto"], tmp_path, device=GPU, hidden_size=4096, validate=False)
    assert job.hidden_size == 4096 and job.ds_config["zero_optimization"]["reduce_bucket_size"] == 4096 * 4096


def test_a_recipe_in_epochs_plans_before_its_data_is_counted(tmp_path):
    """The planner and the tuner plan a recipe's job before a run counts its records: the schedule's length
    changes no memory figure, so the dict holds a stand-in (a run plans the counted config)."""
    job = planned(["train.max_steps=null", "train.epochs=1"], tmp_path)
    assert job.ds_config["scheduler"]["params"]["total_num_steps"] == 1
    assert job.config.train.max_steps is None


def test_a_deepspeed_json_base_is_named_in_its_errors(tmp_path):
    base = tmp_path / "ds.json"
    base.write_text(json.dumps({"zero_opt": {}}))
    with pytest.raises(LauncherError, match=f"deepspeed_json={base}: unknown DeepSpeed key 'zero_opt'"):
        planned([f"deepspeed_json={base}"], tmp_path)


def test_the_credentials_of_a_job_are_found_in_its_config_and_its_deepspeed_dict(tmp_path):
    base = tmp_path / "ds.json"
    base.write_text(json.dumps({"comet": {"api_key": "from-the-file"}}))
    config = compose_typed([f"deepspeed_json={base}", "+deepspeed_extra.wandb.api_key=from-extra"])
    assert job_credentials(config) == {
        "config.deepspeed_extra.wandb.api_key": "from-extra",  # job.json's "config" holds deepspeed_extra too
        "ds_config.comet.api_key": "from-the-file",
        "ds_config.wandb.api_key": "from-extra",
    }
    assert job_credentials(compose_typed([])) == {}


# ----------------------------------------------------------------------------- what-if variants
def test_a_variant_replaces_the_users_zero_offload_and_precision_and_keeps_the_rest():
    overrides = [
        "deepspeed=z3",
        "zero.stage=2",
        "precision.dtype=bf16",
        "train.lr=1",
        "+offload.param=cpu",
        "offload=all",
    ]
    assert variant_overrides(overrides, "z2_offload", "fp16") == [
        "train.lr=1",
        "deepspeed=z2_offload",
        "precision=fp16",
    ]
    assert variant_overrides([], "z0", "fp32") == ["deepspeed=z0", "precision=fp32"]
    assert {"deepspeed", "zero", "offload", "precision"} <= set(VARIANT_KEYS)
