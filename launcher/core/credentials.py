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
    GitHub, OpenAI-style tokens); override-like strings (``hf_token=abc``, Hydra's comma-joined
    ``override_dirname``) keep only the keys of their secrets."""
    if isinstance(obj, Mapping):
        return {k: REDACTED if is_secret_key(k) and v is not None else redact(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact(v) for v in obj]
    if isinstance(obj, str):
        if _SECRET_VALUE.match(obj.strip()):
            return REDACTED
        return ",".join(redact_override(part) for part in _overrides_in(obj)) if "=" in obj else obj
    return obj


def redact_override(override: str) -> str:
    """Redact the value of one Hydra override string (``hf_token=abc`` -> ``hf_token=<redacted>``): a secret
    key, a credential-shaped value, or a list or sweep value with one among its items (``tags=[hf_...,x]``)."""
    key, sep, value = override.partition("=")
    if not sep:
        return override
    items = [item.strip(" []()'\"") for item in value.split(",")]
    if is_secret_key(key.lstrip("+~")) or any(_SECRET_VALUE.match(item) for item in items):
        return f"{key}={REDACTED}"
    return override


def _overrides_in(text: str) -> list[str]:
    """The overrides of a comma-joined string (Hydra's override_dirname "a=1,b=[x,y]"); a part without "="
    continues the one before it (a sweep's values: "api_key=v1,v2")."""
    overrides: list[str] = []
    for part in _top_level_parts(text):
        if "=" in part or not overrides:
            overrides.append(part)
        else:
            overrides[-1] += "," + part
    return overrides


def _top_level_parts(text: str) -> list[str]:
    """`text` split at the commas outside brackets and quotes: Hydra's override_dirname ("a=1,b=[x,y]")."""
    parts, depth, quote, start = [], 0, "", 0
    for index, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[({":
            depth += 1
        elif char in "])}":
            depth = max(0, depth - 1)
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return [*parts, text[start:]]


SECRET_OVERRIDE_ENV_PREFIX = "VLM_LAUNCHER_SECRET_"


def secret_override_env(key: str) -> str:
    """The environment variable a resume reads a credential override's value from (never from a file)."""
    return SECRET_OVERRIDE_ENV_PREFIX + re.sub(r"[^A-Z0-9]+", "_", key.lstrip("+~").upper()).strip("_")


def recorded_override(override: str) -> str:
    """An override as `.hydra/overrides.yaml` records it: one holding a credential becomes
    KEY='${oc.decode:${oc.env:VLM_LAUNCHER_SECRET_KEY}}', so a resume composes it again from the environment
    (`missing_secret_overrides` names the variable when it is not set) and no file holds the value."""
    if redact_override(override) == override:
        return override
    key = override.partition("=")[0]
    return f"{key}={_from_environment(key)}"


def _from_environment(key: str) -> str:
    # Quoted: Hydra's override grammar takes a nested interpolation only inside quotes; oc.decode parses the
    # variable's text as the command line would have (a list stays a list).
    return f"'${{oc.decode:${{oc.env:{secret_override_env(key)}}}}}'"


def missing_secret_overrides(overrides: list[str]) -> list[tuple[str, str]]:
    """(key, variable) of each recorded credential override whose variable the environment lacks."""
    missing = []
    for override in overrides:
        key, _, value = override.partition("=")
        variable = secret_override_env(key)
        if value == _from_environment(key) and variable not in os.environ:
            missing.append((key.lstrip("+~"), variable))
    return missing


def redact_text(line: str) -> str:
    """A line of text (a log message, a command line) with every override-like word's secret value and
    every credential-shaped word redacted: Hydra's sweep lines ("#0 : a=1 +x.api_key=sk-..."), a tuner's
    command line."""
    words = line.split(" ")
    for index, word in enumerate(words):
        if "=" in word:
            words[index] = redact_override(word)
        elif _SECRET_VALUE.match(word.strip("[]'\",")):
            words[index] = REDACTED
    return " ".join(words)


def scrub_file(path: Any) -> None:
    """Rewrite a YAML file another program wrote (Hydra's multirun.yaml) with its credentials redacted, in
    place (atomically, mode 0600); nothing happens when it holds none or does not exist."""
    from pathlib import Path

    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return
    public = redact(data)
    if public == data:
        return
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(public, handle, sort_keys=False)
    os.replace(temporary, path)


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
