"""The job (launcher.job.spec): what the launcher decides once and every rank reads back from job.json.

Runs are labelled by what they train: the final DeepSpeed dict, not the Hydra choices it overrode. A
`deepspeed_json=` job composes over the default preset (`deepspeed=z0`, `zero=stage0`, `offload=none`,
`precision=fp32`); job.json, summary.json, the comparison and W&B's tags must still say the stage,
offload and precision of the JSON it trains with.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.compare.runs import build_row
from launcher.config.precision import Device
from launcher.core import credentials
from launcher.core.json_files import write_json_atomic
from launcher.core.rundir import RunDir
from launcher.job.planning import plan_job
from launcher.job.spec import JOB_VERSION, HydraJob, Job, Resume, choices_of, read_job, run_group
from launcher.tracking.naming import tags_from_choices
from tests.helpers import compose_typed

GOLDEN_JSON = "tests/golden/z3_offload_bf16_ws1.json"  # ZeRO-3, optimizer and parameters on the CPU, bf16
# Hydra's choices for a command line that names no group (conf/config.yaml's defaults).
DEFAULT_CHOICES = {
    "zero": "stage0",
    "precision": "fp32",
    "offload": "none",
    "comm": "default",
    "train": "default",
    "deepspeed": "z0",
    "model": "tiny_llava",
    "method": "full",
    "data": "shapes",
    "dist": "local",
    "logger": "wandb",
}
JSON_LABELS = {"deepspeed": "json:z3_offload_bf16_ws1.json", "zero": "stage3", "offload": "all", "precision": "bf16"}
GPU = Device("cuda", bf16=True, fp16=True, name="H100")


def planned(overrides: tuple[str, ...], run_dir: Path, choices=DEFAULT_CHOICES, **kwargs) -> Job:
    hydra = HydraJob(run_dir=run_dir, overrides=overrides, choices=choices)
    return plan_job(compose_typed(list(overrides)), hydra, **kwargs)


def test_a_deepspeed_json_job_is_labelled_by_its_dict_in_job_json_summary_compare_and_wandb_tags(tmp_path):
    overrides = (f"deepspeed_json={GOLDEN_JSON}", "logger=none")
    spec = planned(overrides, tmp_path)
    job = spec.to_json()
    assert {key: job["choices"][key] for key in JSON_LABELS} == JSON_LABELS
    summary = spec.summary().to_json()  # what rank 0 writes first, before the engine exists
    assert (summary["zero_stage"], summary["offload"], summary["precision"]) == (3, "all", "bf16")
    assert summary["deepspeed"] == "json:z3_offload_bf16_ws1.json" and summary["choices"] == job["choices"]
    assert summary["status"] == "running" and summary["overrides"] == list(overrides)

    row = build_row("run", str(tmp_path), "completed", summary, summary["choices"], list(overrides), {}, [])
    assert {key: row.settings[key] for key in JSON_LABELS} == JSON_LABELS

    tags = tags_from_choices(job["choices"])  # what W&B's run is tagged with (launcher.tracking.wandb_run)
    assert tags[:4] == ["deepspeed=json:z3_offload_bf16_ws1.json", "zero=stage3", "offload=all", "precision=bf16"]


def test_the_facts_a_job_answers_are_read_from_its_dict(tmp_path):
    job = planned(
        (
            "deepspeed=z2_offload",
            "precision=bf16",
            "train.micro_batch_size=4",
            "train.grad_accum=2",
            "dist.nproc_per_node=2",
        ),
        tmp_path,
        choices={
            **DEFAULT_CHOICES,
            "deepspeed": "z2_offload",
            "zero": "stage2",
            "offload": "optimizer",
            "precision": "bf16",
        },
        device=GPU,
        hidden_size=128,
        validate=False,
    )
    assert (job.precision, job.zero_stage, job.offload_optimizer) == ("bf16", 2, "cpu")
    assert (job.micro_batch, job.global_batch, job.max_steps) == (4, 16, 1000)
    assert job.labels["offload"] == "optimizer" and job.labels["deepspeed"] == "z2_offload"
    assert job.describe() == (
        f"job: tiny_llava (full) on 2 ranks (cuda), ZeRO 2, offload optimizer, bf16; batch 16 = 4 per rank x 2 "
        f"accumulated x 2 ranks; run dir {tmp_path}"
    )
    plain = planned((), tmp_path)
    assert plain.offload_optimizer is None and plain.labels == DEFAULT_CHOICES
    assert plain.describe().startswith("job: tiny_llava (full) on 1 rank (")
    packed = planned(("data.packing=true", "data.pack_length=2048", "train.micro_batch_size=2"), tmp_path)
    assert "; batch 2 = 2 packed rows of 2048 tokens per rank x 1 accumulated x 1 rank;" in packed.describe()


def test_job_json_round_trips_and_holds_the_derived_facts_for_its_readers(tmp_path):
    from launcher.job.reshard import Reshard

    reshard = Reshard(
        saved_world_size=2, saved_zero_stage=3, saved_micro_batch=4, global_batch=32, world_size=1, zero_stage=3
    )
    job = planned(("deepspeed=z3", "train.max_steps=7"), tmp_path).replace(
        model_path="/models/x", launch_id="123.0", resume=Resume(tag="step4", reshard=reshard)
    )
    data = json.loads(json.dumps(job.to_json()))
    assert Job.from_json(data) == job
    assert data["version"] == JOB_VERSION
    assert (data["precision"], data["zero_stage"], data["max_steps"]) == ("fp32", 3, 7)
    assert data["choices"] == job.labels and data["ds_config"] == job.ds_config
    assert data["config"]["train"]["max_steps"] == 7 and data["hydra"]["overrides"] == [
        "deepspeed=z3",
        "train.max_steps=7",
    ]
    assert data["resume"]["tag"] == "step4" and data["resume"]["reshard"]["saved_world_size"] == 2
    assert Resume.from_json(Resume(tag="step4").to_json()) == Resume(tag="step4")
    with pytest.raises(ValueError, match=f"job.json of layout 1, this launcher reads layout {JOB_VERSION}"):
        Job.from_json({**data, "version": 1})


def test_a_rank_reads_its_job_with_the_credentials_the_launcher_handed_it(tmp_path, monkeypatch):
    job = planned(("+deepspeed_extra.comet.api_key=secret-value", "logger=none"), tmp_path)
    public, secrets = credentials.split(job.to_json())
    assert "secret-value" not in json.dumps(public)
    write_json_atomic(RunDir(tmp_path).job, public)  # what the launcher writes
    monkeypatch.setenv(credentials.SECRETS_ENV, credentials.for_ranks(secrets)[credentials.SECRETS_ENV])
    assert read_job(tmp_path) == job
    assert read_job(tmp_path).ds_config["comet"]["api_key"] == "secret-value"


def test_hydras_facts_round_trip_without_its_own_groups(tmp_path):
    hydra = HydraJob(run_dir=tmp_path / "run", overrides=("a=1",), choices={"zero": "stage2"}, multirun=True, group="g")
    assert HydraJob.from_json(json.loads(json.dumps(hydra.to_json()))) == hydra
    assert choices_of({"zero": "stage2", "hydra/launcher": "basic", "hydra/sweeper": "basic"}) == {"zero": "stage2"}
    assert run_group(Path("/outputs/runs/2026-01-02/10-11-12")) == "run-2026-01-02-10-11-12"
