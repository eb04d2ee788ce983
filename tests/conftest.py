"""Fixtures; the helpers they use are in tests/helpers.py."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two test processes share the machine's cores (`-n 2`): each computes on one thread, and so does every
    # process it starts (the launcher keeps a set OMP_NUM_THREADS). With OpenMP's spinning threads of both
    # on two cores, a run of the built-in job took 8x as long.
    os.environ["OMP_NUM_THREADS"] = "1"

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # liger-kernel's Triton kernels (model.kernels=liger) run here in Triton's interpreter, on the CPU: the fused
    # loss is checked against the torch path. Triton reads this when the kernels are defined, at import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from launcher.train.ops import extensions_dir
from tests.helpers import QUICK, Ran, one_rank_group, run_here, run_train_py, subprocess_env, train_here

# One cache for every job the tests run, in this process or as a subprocess (tests/helpers.subprocess_env):
# a VLM_LAUNCHER_CACHE set in the shell gave the shared runs made here another tiny model's path than the
# resumes run as subprocesses, hence another data cache key, and four resumes failed ("the training data
# changed").
os.environ["VLM_LAUNCHER_CACHE"] = str(Path(__file__).resolve().parents[1] / "outputs" / "cache")
# One folder of DeepSpeed's JIT-built ops for every process the tests start, the benchmarks they run included
# (bench/_common.py gives benchmarks a folder of their own unless one is set): on a fresh machine the suite
# built shm_comm in both folders, about a minute each time.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))


@pytest.fixture
def isolated_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a subprocess: W&B offline inside the test's directory, shared caches."""
    return subprocess_env(tmp_path)


@pytest.fixture
def run_train(isolated_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `python train.py ARGS` in the project root and capture its output (`env`: variables to set,
    or to unset with None)."""

    def run(*args: str, timeout: float = 600, env: dict[str, str | None] | None = None):
        return run_train_py(isolated_env, *args, timeout=timeout, extra_env=env)

    return run


@pytest.fixture(scope="session")
def process_group() -> Iterator[None]:
    """This test process as the one rank of a gloo group, for jobs trained in it (`train_here`)."""
    with one_rank_group():
        yield


@pytest.fixture
def train_in_process(process_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Ran]:
    """Run a job with its one rank trained in this process: `train_in_process(*overrides, run_dir=...)`.
    W&B stays offline and inside the test's directory."""
    for key, value in subprocess_env(tmp_path).items():
        if key.startswith("WANDB_") or key == "VLM_LAUNCHER_CACHE":
            monkeypatch.setenv(key, value)

    def run(*overrides: str, run_dir: Path | None = None) -> Ran:
        return run_here(list(overrides), run_dir or tmp_path / "run", start=train_here)

    return run


@pytest.fixture(scope="session")
def quick_run(process_group: None, tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """One short run of the built-in job (2 steps, checkpointed, with its model/), shared by the tests that
    only read what a run writes."""
    run_dir = tmp_path_factory.mktemp("quick") / "run"
    ran = run_here([*QUICK, "logger=none"], run_dir, start=train_here)
    assert ran.outcome.status == "completed", ran.outcome.error
    return ran
