"""Credentials never reach a file a run writes; DeepSpeed and the ranks still get the real values.

A value is a credential when its key says so (api_key, token, secret, password, ...) or when it looks
like one (hf_..., sk-..., ghp_...): `launcher.wandb_logger.is_secret_key` and `redact` decide, for W&B
and for every file here alike. The launcher writes the run directory's files (ds_config.json,
job.json, summary.json, Hydra's .hydra/*.yaml) with those values replaced by "<redacted>", and hands
the real ones to the ranks it starts through their environment (`SECRETS_ENV`, never a file). A rank
puts them back into its config and DeepSpeed dict before DeepSpeed reads them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from launcher.tracking.wandb_run import redact, redact_override

SECRETS_ENV = "VLM_LAUNCHER_SECRETS"


def split(tree: Any, prefix: str = "") -> tuple[Any, dict[str, Any]]:
    """(tree with credentials redacted, {dotted path: real value}) of a nested dict/list."""
    public = redact(tree)
    return public, _differences(tree, public, prefix)


def _differences(real: Any, public: Any, prefix: str) -> dict[str, Any]:
    if isinstance(real, Mapping) and isinstance(public, Mapping):
        found: dict[str, Any] = {}
        for key, value in real.items():
            found.update(_differences(value, public.get(key), f"{prefix}{key}."))
        return found
    if isinstance(real, list | tuple) and isinstance(public, list):
        found = {}
        for index, (value, shown) in enumerate(zip(real, public, strict=True)):
            found.update(_differences(value, shown, f"{prefix}{index}."))
        return found
    return {} if real == public else {prefix.rstrip("."): real}


def restore(tree: Any, secrets: Mapping[str, Any]) -> Any:
    """`tree` (plain dicts and lists) with the real values put back at their dotted paths."""
    for path, value in secrets.items():
        *parents, last = path.split(".")
        node = tree
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return tree


def for_ranks(cfg_secrets: Mapping[str, Any]) -> dict[str, str]:
    """The environment entry that hands the config's real values to the ranks (empty when none)."""
    return {SECRETS_ENV: json.dumps(dict(cfg_secrets))} if cfg_secrets else {}


def from_environment() -> dict[str, Any]:
    """The config's real values the launcher handed to this rank."""
    return json.loads(os.environ.get(SECRETS_ENV) or "{}")


def of_deepspeed_dict(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The credentials of the DeepSpeed dict a config composes: only `deepspeed_json` and
    `deepspeed_extra` can bring any (the groups compose none); extra wins, as it is merged last."""
    from launcher.job.spec import load_deepspeed_json

    base = load_deepspeed_json(cfg["deepspeed_json"]) if cfg.get("deepspeed_json") else {}
    return {**split(base)[1], **split(cfg.get("deepspeed_extra") or {})[1]}


def redact_hydra_files(hydra_dir: Path, public_config: dict[str, Any] | None) -> None:
    """Rewrite Hydra's files of a run without credentials: the overrides, Hydra's own config (its
    `job.env_set`, the override lists), and the job's config when it holds any (`public_config`)."""
    overrides = hydra_dir / "overrides.yaml"
    if overrides.is_file():
        listed = yaml.safe_load(overrides.read_text()) or []
        redacted = [redact_override(str(item)) for item in listed]
        if redacted != listed:
            overrides.write_text(yaml.safe_dump(redacted, default_flow_style=False))
    hydra_yaml = hydra_dir / "hydra.yaml"
    if hydra_yaml.is_file():
        text = hydra_yaml.read_text()
        content = yaml.safe_load(text)
        public = redact(content)
        if public != content:
            hydra_yaml.write_text(yaml.safe_dump(public, default_flow_style=False, sort_keys=False))
    if public_config is not None:
        (hydra_dir / "config.yaml").write_text(yaml.safe_dump(public_config, default_flow_style=False, sort_keys=False))
