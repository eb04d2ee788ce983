"""Shared fixtures: compose real configs with Hydra, and run `train.py` as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from launcher.config.schema import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

register_configs()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# A test of what a CPU-only machine does (fp16 refused, QLoRA and flash attention refused): it cannot
# hold on a GPU machine, where the same inputs are accepted.
cpu_only = pytest.mark.skipif(_has_cuda(), reason="asserts what happens on a machine without CUDA")


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """The config `python train.py OVERRIDES` would run with (without Hydra's own node)."""
    if GlobalHydra.instance().is_initialized():  # inside a module-wide Hydra context
        return compose(config_name="config", overrides=overrides or [])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


def compose_plain(overrides: list[str] | None = None) -> dict[str, Any]:
    return OmegaConf.to_container(compose_config(overrides), resolve=True)


def subprocess_env(directory: Path) -> dict[str, str]:
    """Environment for subprocess runs: W&B offline and contained in `directory`, caches shared across tests."""
    env = dict(os.environ)
    env.update(
        {
            "WANDB_MODE": "offline",
            "WANDB_DIR": str(directory / "wandb"),
            "WANDB_CACHE_DIR": str(directory / "wandb_cache"),
            "WANDB_CONFIG_DIR": str(directory / "wandb_config"),
            "WANDB_DATA_DIR": str(directory / "wandb_data"),
            "WANDB_SILENT": "true",
            "VLM_LAUNCHER_CACHE": str(ROOT / "outputs" / "cache"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("HYDRA_FULL_ERROR", None)
    return env


@pytest.fixture
def isolated_env(tmp_path: Path) -> dict[str, str]:
    return subprocess_env(tmp_path)


@pytest.fixture
def run_train(isolated_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `python train.py ARGS` in the project root and capture its output (`env`: variables to set,
    or to unset with None)."""

    def run(
        *args: str, timeout: float = 600, env: dict[str, str | None] | None = None
    ) -> subprocess.CompletedProcess[str]:
        merged = {**isolated_env, **(env or {})}
        return subprocess.run(
            [sys.executable, "train.py", *args],
            cwd=ROOT,
            env={key: value for key, value in merged.items() if value is not None},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


def saved_for_backward(model: Any, batch: dict[str, Any]) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward pass (each storage once,
    parameters left out): the activation memory the planner estimates."""
    import torch

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**batch)
    return sum(saved.values())


def limit_file_size(limit: int) -> Callable[[], None]:
    """A `preexec_fn` that caps the size of any file the child writes, as a full disk would."""

    def apply() -> None:
        import resource
        import signal

        # A write past the limit then fails with EFBIG instead of killing the process (SIGXFSZ).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply
