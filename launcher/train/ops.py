"""DeepSpeed's JIT-compiled ops: build only what the job needs, once, and say so when it does.

DeepSpeed compiles C++ ops the first time they are used (about a minute each on 2 cores), into
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). Measured on DeepSpeed 0.19.8:
- `fused_adam` is what an "AdamW" optimizer block builds when nothing is offloaded. The composition
  sets `"torch_adam": true` there instead (launcher.ds_config): torch's AdamW, no build, the same
  losses; ZeRO 0-3 accept it. Optimizer offload keeps DeepSpeed's `cpu_adam` (its fast CPU step).
- `deepspeed_shm_comm` is built by every `init_distributed` on a CPU, but only DeepSpeed's inference
  all-reduce (AutoTP) uses it; training collectives go through torch.distributed. It is skipped.
- Where `cpu_adam` cannot be built (no C++ compiler, or DeepSpeed refuses a CUDA toolkit whose
  version differs from torch's), `optimizer_fallback` switches the job to torch's fused AdamW on the
  offloaded states (DeepSpeed accepts `torch_adam` with offload) and says so in one line.
- torch serialises a build with a `lock` file in the op's build folder; a build killed part-way
  leaves it, and every later build then waits for it forever. An old lock is named in a warning.
- A second ninja on PATH rebuilds everything: pip's ninja (in the venv) and the system's disagree on
  the build log's format, so the same venv activated or not rebuilt each op. The interpreter's own
  bin directory goes first on PATH, so one ninja serves every shell.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from launcher.core.errors import one_line

log = logging.getLogger("launcher")

_prepared = False


def prepare_ops() -> None:
    """Call before `deepspeed.init_distributed`: no shared-memory comm op, builds announced. The ninja that
    builds them is the interpreter's: a rank's PATH has its bin directory first (`interpreter_path`; a process
    that trains in itself, such as a test, sets its own PATH so), or each would rebuild the other's ops."""
    global _prepared
    if _prepared:
        return
    _prepared = True
    import deepspeed.ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    # DeepSpeed caches this table in the module and reads it before building the op (comm/torch.py).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    build = OpBuilder.jit_load

    def announced_jit_load(self: OpBuilder, verbose: bool = True):
        if not op_is_built(self.name):
            where = extensions_dir()
            log.warning("building DeepSpeed op %s, one time, about a minute (cached in %s)", self.name, where)
            if lock := stale_build_lock(self.name):
                log.warning(
                    "%s is %.0f minutes old: a build that was killed left it, and this build waits for it "
                    "forever; if no other build of %s is running, delete that file",
                    lock,
                    (time.time() - lock.stat().st_mtime) / 60,
                    self.name,
                )
        return build(self, verbose)

    OpBuilder.jit_load = announced_jit_load


def interpreter_path(path: str) -> str:
    """PATH with the interpreter's bin directory (a venv's, with pip's ninja) first, as `activate` puts it."""
    bin_dir = str(Path(sys.executable).parent)
    parts = path.split(os.pathsep)
    if not (Path(bin_dir) / "ninja").exists() or parts[:1] == [bin_dir]:
        return path
    return os.pathsep.join([bin_dir, *(part for part in parts if part != bin_dir)])


def use_interpreter_ninja() -> None:
    """This process's PATH as `interpreter_path` makes it: for the entry points of ranks (their `main`)."""
    os.environ["PATH"] = interpreter_path(os.environ.get("PATH", ""))


def extensions_dir() -> Path:
    """Where torch builds and caches JIT extensions (torch.utils.cpp_extension's rule, creating nothing)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        device = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        device = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        device = "cpu"
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_{device}"


def op_is_built(name: str) -> bool:
    return (extensions_dir() / name / f"{name}.so").is_file()


# A build takes a minute or two: a lock this much older was left by a build that did not finish.
STALE_LOCK_S = 15 * 60


def stale_build_lock(name: str, now: float | None = None) -> Path | None:
    """The op's build lock when it is older than any build would take (torch's FileBaton never expires it)."""
    lock = extensions_dir() / name / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    return lock if age > STALE_LOCK_S else None


def optimizer_fallback(ds_config: dict[str, Any]) -> str | None:
    """Use torch's fused AdamW when the optimizer's DeepSpeed op cannot be built; the line that says so.

    Only an offloaded optimizer uses a DeepSpeed op (`cpu_adam`, launcher.ds_config): it is built here,
    before `deepspeed.initialize`, so a build failure becomes a slower optimizer step instead of a
    failed job. None when the op loads, or when the dict already asks for torch's optimizer."""
    zero = ds_config.get("zero_optimization") or {}
    offloaded = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    params = (ds_config.get("optimizer") or {}).get("params")
    if not offloaded or params is None or params.get("torch_adam"):
        return None
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
        return None
    except Exception as error:  # a compiler, ninja or CUDA-version failure: all end the same way
        params["torch_adam"] = True
        params["fused"] = True
        reason = one_line(error)
        if "does not match" in reason and "CUDA" in reason:
            reason += "; DS_SKIP_CUDA_CHECK=1 lets DeepSpeed build with this toolkit anyway"
        return (
            f"DeepSpeed's cpu_adam op could not be built ({reason}): the offloaded optimizer states use torch's "
            "fused AdamW instead (same update, slower step); see the build output above for the cause"
        )
