"""The config `python train.py OVERRIDES` runs with, composed by Hydra's compose API (no job is run).

The planner, the tuner and a resume (which composes the old run's command line again) compose through
here, so they see exactly what train.py would: the same conf/ tree, schema and resolvers.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, open_dict

from launcher.config.schema import register_configs

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


def without_hydra(cfg: DictConfig) -> tuple[DictConfig, DictConfig]:
    """(the task config, Hydra's node) of a config composed `with_hydra`."""
    hydra_node = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg, hydra_node
