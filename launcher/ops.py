"""DeepSpeed's JIT-compiled ops: build only what the job needs, once, and say so when it does.

DeepSpeed compiles C++ ops the first time they are used (about a minute each on 2 cores), into
TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions). Measured on DeepSpeed 0.19.8:
- `fused_adam` is what an "AdamW" optimizer block builds when nothing is offloaded. The composition
  sets `"torch_adam": true` there instead (launcher.ds_config): torch's AdamW, no build, the same
  losses; ZeRO 0-3 accept it. Optimizer offload keeps DeepSpeed's `cpu_adam` (its fast CPU step).
- `deepspeed_shm_comm` is built by every `init_distributed` on a CPU, but only DeepSpeed's inference
  all-reduce (AutoTP) uses it; training collectives go through torch.distributed. It is skipped.
- A second ninja on PATH rebuilds everything: pip's ninja (in the venv) and the system's disagree on
  the build log's format, so the same venv activated or not rebuilt each op. The interpreter's own
  bin directory goes first on PATH, so one ninja serves every shell.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("launcher")

_prepared = False


def prepare_ops() -> None:
    """Call before `deepspeed.init_distributed`: one ninja, no shared-memory comm op, builds announced."""
    global _prepared
    if _prepared:
        return
    _prepared = True
    use_interpreter_ninja()
    import deepspeed.ops
    from deepspeed.ops.op_builder.builder import OpBuilder

    # DeepSpeed caches this table in the module and reads it before building the op (comm/torch.py).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    build = OpBuilder.jit_load

    def announced_jit_load(self: OpBuilder, verbose: bool = True):
        if not op_is_built(self.name):
            where = extensions_dir()
            log.warning("building DeepSpeed op %s, one time, about a minute (cached in %s)", self.name, where)
        return build(self, verbose)

    OpBuilder.jit_load = announced_jit_load


def use_interpreter_ninja() -> None:
    """Put the interpreter's bin directory (a venv's, with pip's ninja) first on PATH, as `activate` does."""
    bin_dir = str(Path(sys.executable).parent)
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if (Path(bin_dir) / "ninja").exists() and parts[:1] != [bin_dir]:
        os.environ["PATH"] = os.pathsep.join([bin_dir, *(part for part in parts if part != bin_dir)])


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
