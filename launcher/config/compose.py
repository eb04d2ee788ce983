"""The config `python train.py OVERRIDES` runs with, composed by Hydra's compose API (no job is run).

The planner, the tuner and a resume (which composes the old run's command line again) compose through
here, so they see exactly what train.py would: the same conf/ tree, schema and resolvers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, open_dict

from launcher.config.schema import Config, register_configs, typed
from launcher.core.errors import LauncherError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: Sequence[str], *, with_hydra: bool = False) -> DictConfig:
    """The composed config of `train.py OVERRIDES` (with Hydra's own node under "hydra" when asked).

    Inside a running Hydra app (a job of train.py) its own Hydra instance composes; elsewhere one is set
    up on conf/ for the call."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        return hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=with_hydra)


class ConfigNotComposed(LauncherError):
    """The overrides do not compose (a misspelt key, a preset that does not exist): exit code 1, as train.py's."""

    exit_code = 1


def compose_typed(overrides: Sequence[str]) -> Config:
    """The typed config of a tool's overrides (`python -m launcher.plan ...`, `launcher.prepare`), or
    ConfigNotComposed with the one line `composition_error` makes."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigNotComposed(composition_error(err)) from None
    check_keys(cfg)
    try:
        return typed(cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigNotComposed(composition_error(err)) from None


def check_keys(cfg: DictConfig) -> None:
    """ConfigNotComposed for a key a `+` added that the launcher does not read (it would be ignored)."""
    from launcher.config.keys import refusal, unknown_keys

    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigNotComposed(refusal(unknown))


def without_hydra(cfg: DictConfig) -> tuple[DictConfig, DictConfig]:
    """(the task config, Hydra's node) of a config composed `with_hydra`."""
    hydra_node = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, hydra_node


def composition_error(err: BaseException) -> str:
    """The one line a config that does not compose gets: Hydra's first line with the reason it gives
    below it or in its cause ("Could not override 'zero.stag': Key 'stag' not in 'ZeroConfig'"), and a
    preset group's choices inline."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = lines[0] if lines else type(err).__name__
    available = next((i for i, line in enumerate(lines) if line.startswith("Available options in")), None)
    if available is not None:  # a preset that does not exist: its group's choices, up to Hydra's search path
        end = next((i for i, line in enumerate(lines) if line.startswith("Config search path")), len(lines))
        return f"{text}; {lines[available].rstrip(':')}: {', '.join(lines[available + 1 : end])}"
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        text = f"{text.rstrip('.')}: {str(cause).strip().splitlines()[0]}"
    if (missing := _NOT_A_KEY.search(text)) is not None:  # a key the schema lacks: the one meant, if known
        from launcher.config.keys import hint

        advice = hint(missing.group(1))
        text += f"; {advice}" if advice else ""
    return text


_NOT_A_KEY = re.compile(r"Could not override '([^']+)'")
