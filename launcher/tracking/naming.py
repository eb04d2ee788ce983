"""What W&B shows of a run, decided without W&B or the network: the mode, a name, tags.

- `resolve_mode` decides online / offline / disabled without touching the network, so a job on a
  machine without credentials or without internet never prompts and never hangs.
- `run_name` and `tags_from_choices` turn the Hydra job into what W&B shows: a readable run name from the
  overrides, and one tag per config-group choice (filterable in the W&B UI, e.g. ``zero=stage3``).
"""

from __future__ import annotations

import netrc
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePath
from typing import Any
from urllib.parse import urlsplit

from launcher.core.credentials import is_secret_key
from launcher.core.overrides import override_key

MODES = ("auto", "online", "offline", "disabled")

# Hosts whose ~/.netrc entry means "logged in". W&B 0.31 defaults to the CoreWeave Forge endpoint,
# which accepts the same keys as api.wandb.ai; WANDB_BASE_URL adds a self-hosted server.
_KNOWN_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")


_TRUE = {"1", "true", "yes", "on"}


_ENV_MODE_ALIASES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline"}


def resolve_mode(requested: str, env: Mapping[str, str], has_credentials: bool) -> str:
    """Return the W&B mode to use: "online", "offline" or "disabled".

    "auto" defers to W&B's own variables (WANDB_MODE, WANDB_DISABLED) and otherwise goes online only
    when credentials exist, so a machine that is not logged in logs offline instead of prompting.
    An explicit "online"/"offline" wins over WANDB_MODE, except that the environment asking to
    disable W&B (WANDB_MODE=disabled or WANDB_DISABLED=true) always wins: turning logging off is
    never harmful, and it is how CI and tests mute W&B.
    """
    if requested not in MODES:
        raise ValueError(f"wandb mode {requested!r} is not one of {', '.join(MODES)}")
    env_mode = env.get("WANDB_MODE", "").strip().lower()
    if env_mode == "disabled" or env.get("WANDB_DISABLED", "").strip().lower() in _TRUE:
        return "disabled"
    if requested != "auto":
        return requested
    if env_mode in _ENV_MODE_ALIASES:
        return _ENV_MODE_ALIASES[env_mode]
    return "online" if has_credentials else "offline"


def has_credentials(env: Mapping[str, str] | None = None) -> bool:
    """True when W&B would find an API key without asking: WANDB_API_KEY, or a netrc entry.

    Reads the environment and the netrc file named by NETRC (default ~/.netrc) only; no network.
    """
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY", "").strip():
        return True
    path = Path(env.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        entries = netrc.netrc(str(path))
    except (OSError, netrc.NetrcParseError):
        return False
    hosts = list(_KNOWN_HOSTS)
    base_url = env.get("WANDB_BASE_URL", "").strip()
    if base_url:
        hosts.insert(0, urlsplit(base_url).netloc or base_url)
    for host in hosts:
        auth = entries.authenticators(host)
        if auth and auth[2]:
            return True
    return False


# Overrides that say nothing about the experiment: Hydra's own settings, paths and W&B settings.
_NOISY_OVERRIDE_ROOTS = ("hydra", "paths", "wandb", "logger")


_NOISY_OVERRIDE_WORDS = ("dir", "path", "file", "root", "url")


_MAX_NAME_LEN = 128


_MAX_TAG_LEN = 64


def _is_noisy_override(key: str) -> bool:
    parts = re.split(r"[./]", key)
    if parts[0] in _NOISY_OVERRIDE_ROOTS:
        return True
    last = parts[-1].lower()
    return is_secret_key(last) or any(word in last for word in _NOISY_OVERRIDE_WORDS)


# Paths that change what is measured (the data, the model, a DeepSpeed JSON): kept, as their last two parts.
_MEASURED_PATHS = ("data.path", "data.eval_path", "model.path", "deepspeed_json")


def experiment_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that describe the experiment, as ``key=value`` without Hydra's +/++/~ prefixes.

    Hydra settings (hydra.*), paths, W&B settings and secrets are left out: they differ between
    runs without changing what is measured, or must not be shown. The paths of the data, the model and a
    DeepSpeed JSON stay (two runs on other data are not the same experiment), shortened to their last two
    parts (``runs/model``, ``Qwen/Qwen2-VL-2B-Instruct``).
    """
    kept = []
    for override in overrides:
        if "=" not in override:
            continue
        key = override_key(override)
        if key in _MEASURED_PATHS:
            value = override.partition("=")[2].strip()
            kept.append(f"{key}={'/'.join(PurePath(value).parts[-2:]) if '/' in value else value}")
        elif not _is_noisy_override(key):
            kept.append(override.lstrip("+~").strip())
    return kept


def run_name(overrides: Sequence[str]) -> str:
    """A readable run name from Hydra overrides: ``deepspeed=z3_offload,precision=bf16``.

    Sorted so the same configuration always gets the same name; see `experiment_overrides` for
    what is left out. No overrides gives "default".
    """
    name = ",".join(sorted(experiment_overrides(overrides))) or "default"
    return name if len(name) <= _MAX_NAME_LEN else name[: _MAX_NAME_LEN - 3] + "..."


# The groups that decide speed and memory come first, in the order a person reads a configuration.
GROUP_ORDER = ("deepspeed", "zero", "offload", "precision", "comm", "model", "data")


def tags_from_choices(choices: Mapping[str, Any]) -> list[str]:
    """One ``group=choice`` tag per selected config group (Hydra's runtime choices).

    Hydra's own groups (``hydra/...``) and unselected groups are skipped; the DeepSpeed preset is
    included when one was used.
    """
    keys = [k for k in GROUP_ORDER if k in choices]
    keys += sorted(k for k in choices if k not in GROUP_ORDER)
    tags = []
    for key in keys:
        value = choices[key]
        if value is None or str(key).startswith("hydra"):
            continue
        tags.append(f"{key}={value}"[:_MAX_TAG_LEN])
    return tags
