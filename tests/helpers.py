"""What the tests share: composing real configs, running a job in this process or `train.py` as a user
would, reading a run directory back, and a few tools (saved activations, a file size limit).

Most tests run the launcher in-process: `run_job` plans (and refuses) a job in a few hundred
milliseconds, where `python train.py` pays 5-10 s of interpreter start and imports. A job that trains
runs its one rank in this process too (`train_here`, on the gloo process group of the `process_group`
fixture). Subprocesses are kept for the command line's contract: exit codes, one-line errors, signals,
several ranks (tests/e2e).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from omegaconf import DictConfig, OmegaConf
from PIL import Image

from launcher.config.compose import compose, without_hydra
from launcher.config.schema import Config, register_configs, typed
from launcher.core.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

register_configs()


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# A test of what a CPU-only machine does (QLoRA and flash attention refused): it cannot hold on a GPU
# machine, where the same inputs are accepted.
cpu_only = pytest.mark.skipif(_has_cuda(), reason="asserts what happens on a machine without CUDA")


def _cpu_has_fp16() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


# fp16 on a CPU: DeepSpeed's CPU accelerator supports it where the processor does (avx512_fp16/amx_fp16).
no_fp16 = pytest.mark.skipif(_has_cuda() or _cpu_has_fp16(), reason="this machine supports fp16")

# A short job of the built-in model and data: what most tests that train run.
QUICK = (
    "logger=none",
    "train.max_steps=2",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "data.eval_accuracy=false",
)


# ----------------------------------------------------------------------------- configs
def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python train.py OVERRIDES` would run with (without Hydra's own node)."""
    return compose(list(overrides))


def compose_typed(overrides: Sequence[str] = ()) -> Config:
    return typed(compose(list(overrides)))


def compose_plain(overrides: Sequence[str] = ()) -> dict[str, Any]:
    return OmegaConf.to_container(compose(list(overrides)), resolve=True, enum_to_str=True)  # type: ignore[return-value]


# ----------------------------------------------------------------------------- jobs in this process
@dataclass
class Ran:
    """A job run by `run_here`: how it ended, and the launcher's lines (what it said, in order)."""

    outcome: Any  # launcher.launch.run.Outcome
    lines: list[str] = field(default_factory=list)
    run_dir: Path = Path()

    @property
    def error(self) -> str | None:
        return self.outcome.error

    def summary(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "summary.json").read_text())


def hydra_job(overrides: Sequence[str], run_dir: Path, *, multirun: bool = False) -> Any:
    """The HydraJob `python train.py OVERRIDES hydra.run.dir=RUN_DIR` runs as (its choices from Hydra)."""
    from launcher.job.spec import HydraJob, choices_of, run_group

    _, node = without_hydra(compose(list(overrides), with_hydra=True))
    return HydraJob(
        run_dir=Path(run_dir),
        overrides=tuple(overrides),
        choices=choices_of(node.runtime.choices),
        multirun=multirun,
        group=run_group(Path(run_dir)),
    )


def train_here(job: Any, run_dir: Any, *, env: dict[str, str], primary: bool = True, output: Path | None = None) -> Any:
    """`run_job`'s `start` for one rank trained in this process (on the `process_group` fixture's gloo
    group): what launcher.launch.ranks.start_ranks does with a child process, without its start-up."""
    from launcher.train.trainer import train

    assert job.world_size == 1, "a job trained in the test process has one rank"
    return train(job, run_dir.path)


def run_here(overrides: Sequence[str], run_dir: Path, *, start: Callable[..., Any] | None = None) -> Ran:
    """`python train.py OVERRIDES hydra.run.dir=RUN_DIR` in this process: planned and checked by the real
    launcher (launcher.launch.run.run_job). The ranks start as child processes unless `start` (e.g.
    `train_here`, with the `process_group` fixture) says otherwise."""
    from launcher.launch.run import run_job

    lines: list[str] = []
    extra = {} if start is None else {"start": start}
    outcome = run_job(compose(list(overrides)), hydra_job(overrides, run_dir), say=lines.append, **extra)
    return Ran(outcome, lines, Path(run_dir))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def one_rank_group() -> Iterator[None]:
    """This process as rank 0 of a one-rank group, for trainers run in it (`train_here`): gloo, and on a GPU
    machine NCCL for CUDA tensors beside it (what a rank's group is there; gloo keeps the CPU's tensors)."""
    import torch
    import torch.distributed as dist

    from launcher.train.ops import interpreter_path

    # PATH as a rank's (the interpreter's ninja first): else this process and the ranks would each
    # rebuild the other's DeepSpeed ops (launcher.train.ops).
    rank_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    saved = {key: os.environ.get(key) for key in (*rank_env, "MASTER_PORT", "PATH")}
    os.environ.update({**rank_env, "MASTER_PORT": str(free_port()), "PATH": interpreter_path(os.environ["PATH"])})
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ----------------------------------------------------------------------------- train.py as a user runs it
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


def run_train_py(
    env: dict[str, str], *args: str, timeout: float = 600, extra_env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python train.py ARGS` in the project root, output captured (`extra_env`: variables to set, or to
    unset with None)."""
    merged = {**env, **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={key: value for key, value in merged.items() if value is not None},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_train(env: dict[str, str], *args: str, log: Path) -> subprocess.Popen:
    """`python train.py ARGS` started in its own process group (as a scheduler's job is), output to `log`."""
    handle = log.open("w")
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the job and every rank: torchrun starts its ranks in sessions of their own, so the
    process group alone would leave them running."""
    ranks = psutil.Process(process.pid).children(recursive=True)
    os.killpg(process.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    process.wait(timeout=120)
    psutil.wait_procs(ranks, timeout=60)


def signal_group(process: subprocess.Popen, signum: int = signal.SIGTERM) -> None:
    """Signal every process of the job's group, as `timeout` and SLURM do."""
    os.killpg(process.pid, signum)


def wait_for(process: subprocess.Popen, condition: Callable[[], bool], timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended (code {process.returncode}) before the condition held"
        assert time.time() < deadline, "timed out waiting for the run"
        time.sleep(0.05)


def last_step(run_dir: Path) -> int:
    path = RunDir(run_dir).metrics
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1])["step"] if lines and lines[-1].endswith("}") else 0


def latest(run_dir: Path) -> str | None:
    path = RunDir(run_dir).latest
    return path.read_text().strip() if path.is_file() else None


def signal_every_process(process: subprocess.Popen, signum: int) -> list[psutil.Process]:
    """Signal the job and every process under it (torch's agent, the ranks, their workers), as SLURM stops a
    step; returns them (torchrun starts its ranks in sessions of their own: no process group holds all)."""
    family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(signum)
    return family


# ----------------------------------------------------------------------------- run directories
def read_summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> list[float]:
    return [float(row["train/loss"]) for row in read_metrics(run_dir)]


# ----------------------------------------------------------------------------- data as people have it
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220)}


def write_images(root: Path) -> list[str]:
    """Images of three colours in three sizes (the processors resize them)."""
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for colour, rgb in COLOURS.items():
        for size in (24, 40, 56):
            name = f"{colour}_{size}.png"
            Image.new("RGB", (size, size + 8), rgb).save(root / name)
            names.append(name)
    return names


def conversation(index: int, images: list[str]) -> tuple[str, str]:
    """A question about `images` and its answer (the colours, in order); text-only records chat."""
    if not images:
        return f"say the number {index % 7}", f"number {index % 7}"
    return "which colours?", " ".join(name.split("_")[0] for name in images)


def plain(value: Any) -> Any:
    """Tensors and arrays as lists, recursively, so that saved states compare with ==."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    return value


# ----------------------------------------------------------------------------- tools
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

        # A write past the limit then fails with EFBIG instead of killing the process (SIGXFSZ).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


# ----------------------------------------------------------------------------- optimizer groups
# Every ZeRO stage and offload, with the optimizer class DeepSpeed steps there (DeepSpeedCPUAdam under the
# ZeRO optimizer with offload): what the parameter-group tests read their rates back from.
PRESET_OPTIMIZERS = (
    ("z0", "AdamW"),
    ("z1", "DeepSpeedZeroOptimizer"),
    ("z2", "DeepSpeedZeroOptimizer"),
    ("z3", "DeepSpeedZeroOptimizer_Stage3"),
    ("z2_offload", "DeepSpeedZeroOptimizer"),
    ("z3_offload", "DeepSpeedZeroOptimizer_Stage3"),
)


def rates_in_use(engine: Any) -> dict[str, tuple[float, float]]:
    """{group name: (peak rate, weight decay)} as DeepSpeed's optimizer and scheduler hold them."""
    groups, peaks = engine.engine.optimizer.param_groups, engine.scheduler.org_lrs
    return {group["name"]: (peak, group["weight_decay"]) for group, peak in zip(groups, peaks, strict=True)}


@contextmanager
def small_disk(where: Path, megabytes: int) -> Iterator[Callable[[int], None]]:
    """A tmpfs of `megabytes` at `where` (a real disk that fills: ENOSPC), resized by the callable; unmounted
    after. Skips where this machine allows no mount."""
    where.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)]
    if subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("no tmpfs mount here (mount needs privileges)")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}m", str(where)], check=True)

    try:
        yield resize
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
