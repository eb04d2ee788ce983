"""launcher.core.credentials: credentials never reach a file a run writes; the ranks get the real values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config.compose import compose, without_hydra
from launcher.config.precision import Device
from launcher.core import credentials
from launcher.core.credentials import REDACTED, SECRETS_ENV, is_secret_key, redact, redact_override
from launcher.job.planning import plan_job
from launcher.job.resume import replayed_environment
from launcher.job.spec import HydraJob, choices_of, read_job, run_group
from launcher.launch.run import run_job
from tests.helpers import compose_typed, hydra_job, train_here


@pytest.mark.parametrize(
    "key",
    [
        "api_key",
        "wandb.api_key",
        "HF_TOKEN",
        "hf_token",
        "token",
        "access_token",
        "wandb_key",
        "password",
        "client-secret",
    ],
)
def test_keys_that_name_a_secret(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key", ["pad_token", "eos_token", "pad_token_id", "max_tokens", "tokens_per_sec", "cache_key", "monkey", "name"]
)
def test_keys_that_are_config(key):
    assert not is_secret_key(key)


def test_values_that_look_like_credentials_are_redacted_whatever_their_key():
    tree = {
        "comet": {"api_key": "k1", "enabled": False},
        "note": "hf_" + "a" * 24,
        "list": ["sk-" + "b" * 24, "plain", "hf_token=abc", {"password": None}],
        "pad_token": "<pad>",
    }
    assert redact(tree) == {
        "comet": {"api_key": REDACTED, "enabled": False},
        "note": REDACTED,
        "list": [REDACTED, "plain", f"hf_token={REDACTED}", {"password": None}],  # None hides nothing
        "pad_token": "<pad>",
    }
    assert redact_override("+deepspeed_extra.comet.api_key=k1") == f"+deepspeed_extra.comet.api_key={REDACTED}"
    assert redact_override("model.token_budget=ghp_" + "c" * 24) == f"model.token_budget={REDACTED}"
    assert redact_override("train.lr=1e-4") == "train.lr=1e-4" and redact_override("~wandb") == "~wandb"


def test_split_and_restore_put_the_real_values_back_at_their_paths():
    tree = {"a": {"api_key": "k1", "n": 1}, "items": [{"token": "t0"}, "sk-" + "d" * 24]}
    public, secrets = credentials.split(tree)
    assert secrets == {"a.api_key": "k1", "items.0.token": "t0", "items.1": "sk-" + "d" * 24}
    assert REDACTED in json.dumps(public) and "k1" not in json.dumps(public)
    assert credentials.restore(json.loads(json.dumps(public)), secrets) == tree
    assert credentials.for_ranks({}) == {}


def test_the_ranks_get_the_real_values_back(tmp_path, monkeypatch):
    """What the launcher writes (job.json, ds_config.json) and hands over, and what a rank reads back
    (launcher.job.spec.read_job), as launcher.launch.run does."""
    base = tmp_path / "ds.json"
    base.write_text(json.dumps({"wandb": {"enabled": False, "api_key": "sk-" + "b" * 30}}))
    overrides = [f"deepspeed_json={base}", "+deepspeed_extra.comet.enabled=false", "+deepspeed_extra.comet.api_key=k1"]
    job = plan_job(
        compose_typed(overrides),
        hydra_job(overrides, tmp_path / "run"),
        device=Device("cpu", bf16=True, fp16=False),
        hidden_size=64,
        validate=False,
    )
    assert job.ds_config["comet"]["api_key"] == "k1" and job.ds_config["wandb"]["api_key"] == "sk-" + "b" * 30
    public_ds = json.loads(json.dumps(credentials.split(job.ds_config)[0]))
    assert public_ds["comet"]["api_key"] == public_ds["wandb"]["api_key"] == REDACTED
    public_job, secrets = credentials.split(job.to_json())
    assert public_job["config"]["deepspeed_extra"]["comet"]["api_key"] == REDACTED
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "job.json").write_text(json.dumps(public_job))
    assert "k1" not in (tmp_path / "run" / "job.json").read_text()
    monkeypatch.setenv(*next(iter(credentials.for_ranks(secrets).items())))
    assert read_job(tmp_path / "run") == job
    monkeypatch.delenv(SECRETS_ENV)
    assert read_job(tmp_path / "run").ds_config["comet"]["api_key"] == REDACTED  # no environment, no secret


@pytest.mark.slow
def test_credentials_reach_no_file_a_run_writes(train_in_process, tmp_path, monkeypatch):
    """Fake credentials in deepspeed_extra, Hydra's env_set and the environment; every file is grepped
    (checkpoints, the final model, the .hydra/ files, W&B's offline run). The job is planned with Hydra's
    own node, as train.py's is (HydraJob.from_hydra), and its one rank trained in this process."""
    comet_key = "sk-" + "c" * 32
    hf_token = "hf_" + "h" * 30
    wandb_key = "w" * 40
    run_dir = tmp_path / "run"
    monkeypatch.setenv("WANDB_API_KEY", wandb_key)
    monkeypatch.setenv("WANDB_DIR", str(run_dir))
    monkeypatch.setenv("HF_TOKEN", hf_token)  # what Hydra's env_set does in train.py's process
    task = [
        "train.max_steps=2",
        "train.save_every=1",
        "train.micro_batch_size=4",
        "train.eval_every=0",
        "data.eval_accuracy=false",
        "logger=wandb",
        "+deepspeed_extra.comet.enabled=false",
        f"+deepspeed_extra.comet.api_key={comet_key}",
        f"logger.tags=[{hf_token},mine]",  # a token inside a list: W&B's tags, job.json, .hydra/
    ]
    cfg, node = without_hydra(compose([*task, f"+hydra.job.env_set.HF_TOKEN={hf_token}"], with_hydra=True))
    hydra = HydraJob(
        run_dir=run_dir,
        overrides=tuple(task),
        choices=choices_of(node.runtime.choices),
        group=run_group(run_dir),
        node=node,
    )
    outcome = run_job(cfg, hydra, say=lambda line: None, start=train_here)
    assert outcome.status == "completed", outcome.error
    files = [path for path in Path(run_dir).rglob("*") if path.is_file()]
    assert any(path.suffix == ".pt" for path in files) and any("wandb" in path.parts for path in files)
    assert (run_dir / ".hydra" / "hydra.yaml").is_file() and (run_dir / "model").is_dir()
    for path in files:
        content = path.read_bytes()
        for secret in (comet_key, hf_token, wandb_key):
            assert secret.encode() not in content, f"{secret[:6]}... in {path.relative_to(run_dir)}"
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    assert ds_config["comet"]["api_key"] == REDACTED
    assert "env_set" in (run_dir / ".hydra" / "hydra.yaml").read_text()  # Hydra's node was written, redacted


@pytest.mark.parametrize(
    ("given", "public"),
    [
        ("logger.tags=[hf_" + "a" * 24 + ",x]", "logger.tags=<redacted>"),
        (
            "+deepspeed_extra.comet.api_key=sk-" + "a" * 24 + ",sk-" + "b" * 24,
            "+deepspeed_extra.comet.api_key=<redacted>",
        ),
        ("api_key=abc,def", "api_key=<redacted>"),  # a sweep of a secret key's values
        ("a=1,tags=[x,hf_" + "c" * 24 + "],b=[1,2]", "a=1,tags=<redacted>,b=[1,2]"),  # Hydra's override_dirname
        ("a=1,b=[1,2]", "a=1,b=[1,2]"),
    ],
)
def test_override_strings_lose_the_credentials_in_lists_sweeps_and_joined_forms(given, public):
    assert redact(given) == public


def test_a_log_line_loses_its_credentials_word_by_word():
    line = "\t#0 : lr=1 +x.api_key=sk-" + "a" * 24 + " logger.tags=[hf_" + "b" * 24 + ",y] ghp_" + "c" * 24
    assert credentials.redact_text(line) == "\t#0 : lr=1 +x.api_key=<redacted> logger.tags=<redacted> <redacted>"


def test_a_credential_override_is_recorded_as_the_environment_variable_a_resume_reads(monkeypatch):
    recorded = credentials.recorded_override("+deepspeed_extra.comet.api_key=sk-" + "a" * 24)
    variable = "VLM_LAUNCHER_SECRET_DEEPSPEED_EXTRA_COMET_API_KEY"
    assert recorded == f"+deepspeed_extra.comet.api_key='${{oc.decode:${{oc.env:{variable}}}}}'"
    assert credentials.recorded_override("train.lr=0.1") == "train.lr=0.1"
    monkeypatch.delenv(variable, raising=False)
    assert credentials.missing_secret_overrides([recorded, "train.lr=0.1"]) == [
        ("deepspeed_extra.comet.api_key", variable)
    ]
    monkeypatch.setenv(variable, "sk-" + "a" * 24)
    assert credentials.missing_secret_overrides([recorded]) == []
    assert compose([recorded]).deepspeed_extra.comet.api_key == "sk-" + "a" * 24  # composes as given


def test_a_yaml_file_another_program_wrote_is_scrubbed_in_place(tmp_path):
    path = tmp_path / "multirun.yaml"
    task = "    task:\n    - api_key=abc,def\n    - lr=1\n"
    path.write_text(f"hydra:\n  overrides:\n{task}  job:\n    override_dirname: api_key=abc,lr=1\n")
    credentials.scrub_file(path)
    text = path.read_text()
    assert "abc" not in text and "def" not in text and "lr=1" in text and (path.stat().st_mode & 0o777) == 0o600
    credentials.scrub_file(tmp_path / "absent.yaml")  # nothing to do


def test_a_run_started_with_a_credential_resumes_with_it_from_the_environment(train_in_process, tmp_path, monkeypatch):
    """No file holds the credential, so a resume reads it from the variable `.hydra/overrides.yaml` names,
    and says which one when it is not set (it used to fail in Hydra's parser on "<redacted>")."""
    key, variable = "sk-" + "k" * 30, "VLM_LAUNCHER_SECRET_DEEPSPEED_EXTRA_COMET_API_KEY"
    monkeypatch.delenv(variable, raising=False)
    run_dir = tmp_path / "run"
    job = ["train.max_steps=2", "train.save_every=1", "train.micro_batch_size=4", "train.eval_every=0",
           "data.eval_accuracy=false", "logger=none", "+deepspeed_extra.comet.enabled=false",
           f"+deepspeed_extra.comet.api_key={key}"]  # fmt: skip
    assert train_in_process(*job, run_dir=run_dir).outcome.status == "completed"
    assert variable in (run_dir / ".hydra" / "overrides.yaml").read_text()
    refused = train_in_process(f"resume={run_dir}", "train.max_steps=3", run_dir=run_dir).outcome
    assert refused.exit_code == 2 and refused.error == (
        f"resume={run_dir}: the run was started with a credential in deepspeed_extra.comet.api_key, which no file "
        f"of the run holds: set {variable} to it (or give deepspeed_extra.comet.api_key=... again) and resume"
    )
    monkeypatch.setenv(variable, key)
    resumed = train_in_process(f"resume={run_dir}", "train.max_steps=3", run_dir=run_dir).outcome
    assert resumed.status == "completed" and resumed.summary.steps == 3, resumed.error
    for path in (p for p in run_dir.rglob("*") if p.is_file()):
        assert key.encode() not in path.read_bytes(), path


def test_a_resume_gives_the_ranks_the_first_runs_hydra_environment_again(process_group, tmp_path, monkeypatch):
    """`+hydra.job.env_set.X=...` of the first run reaches the resumed run's ranks too (it used to be dropped:
    overrides.yaml holds the task's overrides only); a credential among them is read from this job's
    environment, and without it the resume stops in one line naming the variable."""
    token = "hf_" + "e" * 30
    run_dir = tmp_path / "run"
    monkeypatch.delenv("HF_TOKEN", raising=False)
    task = ["train.max_steps=1", "train.save_every=1", "train.micro_batch_size=4", "train.eval_every=0",
            "data.eval_accuracy=false", "logger=none"]  # fmt: skip
    hydra_settings = ["+hydra.job.env_set.VISIBLE_SETTING=kept", f"+hydra.job.env_set.HF_TOKEN={token}"]
    cfg, node = without_hydra(compose([*task, *hydra_settings, "hydra.verbose=false"], with_hydra=True))
    first = HydraJob(run_dir=run_dir, overrides=tuple(task), choices=choices_of(node.runtime.choices),
                     group=run_group(run_dir), node=node)  # fmt: skip
    assert run_job(cfg, first, say=lambda line: None, start=train_here).status == "completed"

    given: dict[str, str] = {}

    def start_here(job, directory, *, env, **kwargs):
        given.update(env)
        return train_here(job, directory, env=env, **kwargs)

    def resume(*overrides):
        again = [f"resume={run_dir}", *overrides]
        lines: list[str] = []
        outcome = run_job(compose(again), hydra_job(again, run_dir), say=lines.append, start=start_here)
        return outcome, lines

    refused, _ = resume("train.max_steps=2")
    assert refused.exit_code == 2 and refused.error == (
        f"resume={run_dir}: the run was started with hydra.job.env_set.HF_TOKEN, a credential no file of the run "
        "holds: export HF_TOKEN (or give +hydra.job.env_set.HF_TOKEN=... again) and resume"
    )
    monkeypatch.setenv("HF_TOKEN", token)
    resumed, lines = resume("train.max_steps=2")
    assert resumed.status == "completed" and resumed.summary.steps == 2, resumed.error
    assert given["VISIBLE_SETTING"] == "kept" and given["HF_TOKEN"] == token
    # Under dist=slurm the tasks that do not plan give their ranks the same entries.
    again = [f"resume={run_dir}", "train.max_steps=2"]
    replayed = replayed_environment(compose(again), hydra_job(again, run_dir))
    assert replayed == {"VISIBLE_SETTING": "kept", "HF_TOKEN": token}
    not_replayed = "resume: the first run's hydra.verbose=false shaped Hydra's own start and is not replayed"
    assert not_replayed in "\n".join(lines)
    recorded = (run_dir / ".hydra" / "hydra.yaml").read_text()  # so that the next resume replays them too
    assert "VISIBLE_SETTING: kept" in recorded and f"HF_TOKEN: {REDACTED}" in recorded
    for path in (p for p in run_dir.rglob("*") if p.is_file()):
        assert token.encode() not in path.read_bytes(), path
