"""Credentials never reach a file a run writes, nor W&B; DeepSpeed and the ranks still get the real values.

A value is a credential when its key says so (api_key, token, secret, password, ...) or when it looks
like one (hf_..., sk-..., ghp_...): `is_secret_key` and `redact` decide, for every file and for W&B
alike. The launcher writes the run directory's files (job.json, ds_config.json, summary.json,
`.hydra/*.yaml`) with those values replaced by "<redacted>", and hands the real ones to the ranks it
starts through their environment (`SECRETS_ENV`, never a file): `split` on the way out, `restore` in
the rank before the job is read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

SECRETS_ENV = "VLM_LAUNCHER_SECRETS"
REDACTED = "<redacted>"

# Keys whose values are secrets. Matching is on the lower-cased key. "token" alone is too broad
# (pad_token_id, max_tokens, tokens_per_sec are config, not secrets), so token keys are matched by
# suffix and the tokenizer's special tokens are excused.
_SECRET_WORDS = ("password", "passwd", "secret", "apikey", "api_key", "private_key", "credential")
_SECRET_KEY_PREFIXES = ("api", "wandb", "access", "private", "secret", "hf", "auth", "openai", "ssh")
_SPECIAL_TOKEN_KEYS = re.compile(
    r"^(pad|bos|eos|unk|sep|cls|mask|image|video|audio|boi|eoi|boa|eoa|start|end|additional_special)"
    r"_token$"
)
# Values that look like credentials whatever their key (HF, GitHub, OpenAI-style, W&B v1 keys).
_SECRET_VALUE = re.compile(r"^(hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|wandb_v1_\S+)$")


def is_secret_key(key: object) -> bool:
    """True when a config key names a secret (api_key, hf_token, wandb_key, password, ...)."""
    k = str(key).strip().lower().replace("-", "_").rsplit(".", 1)[-1]
    if any(word in k for word in _SECRET_WORDS):
        return True
    if k == "token" or (k.endswith("token") and not _SPECIAL_TOKEN_KEYS.match(k)):
        return True
    if k.endswith("_key"):
        return k[: -len("_key")].rsplit("_", 1)[-1] in _SECRET_KEY_PREFIXES
    return k in {"key", "auth", "authorization"}


def redact(obj: Any) -> Any:
    """A copy of a nested config with secret values replaced by "<redacted>".

    Secrets are recognised by key (see `is_secret_key`) and by the shape of string values (HF,
    GitHub, OpenAI-style tokens); override-like strings (``hf_token=abc``) keep only their key."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_key(k) and v is not None else redact(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        if _SECRET_VALUE.match(obj.strip()):
            return REDACTED
        # Override-like strings ("hf_token=abc", e.g. in a list of Hydra overrides).
        return redact_override(obj) if "=" in obj else obj
    return obj


def redact_override(override: str) -> str:
    """Redact the value of one Hydra override string (``hf_token=abc`` -> ``hf_token=<redacted>``)."""
    key, sep, value = override.partition("=")
    if not sep:
        return override
    if is_secret_key(key.lstrip("+~")) or _SECRET_VALUE.match(value.strip()):
        return f"{key}={REDACTED}"
    return override


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


def for_ranks(secrets: Mapping[str, Any]) -> dict[str, str]:
    """The environment entry that hands the real values to the ranks (empty when there are none)."""
    return {SECRETS_ENV: json.dumps(dict(secrets))} if secrets else {}


def from_environment() -> dict[str, Any]:
    """The real values the launcher handed to this rank."""
    return json.loads(os.environ.get(SECRETS_ENV) or "{}")
