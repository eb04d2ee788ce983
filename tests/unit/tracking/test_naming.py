"""launcher.tracking.naming: what W&B shows of a run, decided without W&B or the network: the mode, a run
name from the overrides, one tag per group choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.tracking import naming


@pytest.mark.parametrize(
    ("requested", "env", "creds", "expected"),
    [
        ("auto", {}, False, "offline"),
        ("auto", {}, True, "online"),
        ("auto", {"WANDB_MODE": "offline"}, True, "offline"),
        ("auto", {"WANDB_MODE": "online"}, False, "online"),
        ("auto", {"WANDB_MODE": "dryrun"}, True, "offline"),
        ("auto", {"WANDB_MODE": "disabled"}, True, "disabled"),
        ("auto", {"WANDB_DISABLED": "true"}, True, "disabled"),
        ("auto", {"WANDB_MODE": "nonsense"}, True, "online"),
        ("online", {"WANDB_MODE": "offline"}, False, "online"),
        ("offline", {}, True, "offline"),
        ("online", {"WANDB_DISABLED": "1"}, True, "disabled"),
        ("disabled", {"WANDB_MODE": "online"}, True, "disabled"),
    ],
)
def test_resolve_mode(requested: str, env: dict, creds: bool, expected: str) -> None:
    assert naming.resolve_mode(requested, env, creds) == expected


def test_resolve_mode_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="not one of auto, online, offline, disabled"):
        naming.resolve_mode("cloud", {}, False)


def test_has_credentials_from_env_and_netrc(tmp_path: Path) -> None:
    netrc = tmp_path / "netrc"
    assert naming.has_credentials({"WANDB_API_KEY": "k" * 40, "NETRC": str(netrc)})
    assert not naming.has_credentials({"WANDB_API_KEY": "  ", "NETRC": str(netrc)})  # blank: none
    assert not naming.has_credentials({"NETRC": str(netrc)})  # no such file
    netrc.write_text("machine example.com\n  login user\n  password pw\n")
    assert not naming.has_credentials({"NETRC": str(netrc)})
    assert naming.has_credentials({"NETRC": str(netrc), "WANDB_BASE_URL": "https://example.com"})
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert naming.has_credentials({"NETRC": str(netrc)})
    netrc.write_text("machine api.forge.coreweave.com\n  login user\n  password " + "k" * 40 + "\n")
    assert naming.has_credentials({"NETRC": str(netrc)})  # W&B 0.31's default endpoint
    netrc.write_text("machine api.wandb.ai login\n")  # unparsable: not credentials, no exception
    assert not naming.has_credentials({"NETRC": str(netrc)})


def test_run_name() -> None:
    overrides = [
        "precision=bf16",
        "deepspeed=z3_offload",
        "hydra.run.dir=/tmp/x",
        "hydra/launcher=joblib",
        "paths.output_dir=/tmp/y",
        "+hf_token=abc",
        "wandb.mode=offline",
        "data.root=/data",
    ]
    assert naming.run_name(overrides) == "deepspeed=z3_offload,precision=bf16"
    assert naming.run_name([]) == "default"
    assert naming.run_name(["hydra.verbose=true"]) == "default"
    assert naming.run_name(["++train.lr=1e-4", "~model.extra"]) == "train.lr=1e-4"
    assert len(naming.run_name([f"k{i}=v{i}" for i in range(100)])) == 128


def test_experiment_overrides_leave_out_paths_secrets_and_hydras_own() -> None:
    given = ["+train.lr=3e-4", "logger.project=p", "data.image_root=/imgs", "model.hf_token=x", "hydra.job.num=0",
             "~model.extra", "deepspeed_extra.comet.api_key=k", "precision=bf16", "cache_dir=/c"]  # fmt: skip
    assert naming.experiment_overrides(given) == ["train.lr=3e-4", "precision=bf16"]


def test_the_data_and_the_model_stay_as_the_last_two_parts_of_their_paths() -> None:
    """Runs on other data or another model are other experiments: the comparison must show it (issue 44)."""
    given = ["data.path=/data/sets/train.json", "model.path=outputs/runs/2026-12-05/10-00-00/model",
             "model.path=Qwen/Qwen2-VL-2B-Instruct", "deepspeed_json=ds.json",
             "data.eval_path=/d/val.json"]  # fmt: skip
    assert naming.experiment_overrides(given) == [
        "data.path=sets/train.json", "model.path=10-00-00/model", "model.path=Qwen/Qwen2-VL-2B-Instruct",
        "deepspeed_json=ds.json", "data.eval_path=d/val.json",
    ]  # fmt: skip


def test_tags_from_choices() -> None:
    choices = {
        "model": "tiny_llava",
        "precision": "bf16",
        "comm": "default",
        "offload": "none",
        "zero": "stage3",
        "hydra/launcher": "basic",
        "hydra/output": "default",
        "deepspeed": None,
    }
    assert naming.tags_from_choices(choices) == [
        "zero=stage3",
        "offload=none",
        "precision=bf16",
        "comm=default",
        "model=tiny_llava",
    ]
    assert naming.tags_from_choices({**choices, "deepspeed": "z3"})[0] == "deepspeed=z3"
    # groups W&B does not order come after, by name; a tag is at most 64 characters
    assert naming.tags_from_choices({"method": "lora", "data": "x" * 100, "logger": "wandb"}) == [
        ("data=" + "x" * 100)[:64],
        "logger=wandb",
        "method=lora",
    ]
