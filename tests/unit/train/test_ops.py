"""launcher.train.ops: DeepSpeed's JIT-compiled ops on a first run: the optimizer fallback when cpu_adam
cannot be built, a build lock left by a killed build, and one ninja for every shell."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import pytest

from launcher.train import ops
from tests.helpers import losses, read_summary


def _ds(offload: str, **params) -> dict:
    return {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": offload}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, **params}},
    }


def test_only_an_offloaded_deepspeed_optimizer_has_an_op_to_fall_back_from():
    planned = _ds("none", torch_adam=True, fused=True)  # what the composition plans without offload
    assert ops.optimizer_fallback(planned) is None
    assert planned == _ds("none", torch_adam=True, fused=True)
    asked = _ds("cpu", torch_adam=True)  # a JSON that already asks for torch's optimizer
    assert ops.optimizer_fallback(asked) is None and "fused" not in asked["optimizer"]["params"]
    assert ops.optimizer_fallback({"zero_optimization": {"stage": 0}}) is None  # no optimizer block


def test_a_build_lock_older_than_any_build_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ops.extensions_dir() == tmp_path and not ops.op_is_built("cpu_adam")
    assert ops.stale_build_lock("cpu_adam") is None
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert ops.stale_build_lock("cpu_adam") is None  # a build may be running now
    old = time.time() - ops.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert ops.stale_build_lock("cpu_adam") == lock
    (tmp_path / "cpu_adam" / "cpu_adam.so").touch()
    assert ops.op_is_built("cpu_adam")


def test_the_default_extensions_dir_is_torchs(monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    where = ops.extensions_dir()
    assert where.parent == Path(get_default_build_root())
    assert where.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")


def test_the_interpreters_bin_directory_goes_first_on_path_once(monkeypatch):
    bin_dir = str(Path(sys.executable).parent)
    if not (Path(bin_dir) / "ninja").exists():
        pytest.skip("this interpreter's bin directory has no ninja: PATH is left as it is")
    assert ops.interpreter_path("/usr/bin:/bin") == f"{bin_dir}:/usr/bin:/bin"
    assert ops.interpreter_path(f"/usr/bin:{bin_dir}:/bin") == f"{bin_dir}:/usr/bin:/bin"
    assert ops.interpreter_path(f"{bin_dir}:/usr/bin") == f"{bin_dir}:/usr/bin"  # already first: unchanged
    monkeypatch.setenv("PATH", "/usr/bin")
    ops.use_interpreter_ninja()
    assert os.environ["PATH"] == f"{bin_dir}:/usr/bin"


@pytest.mark.slow
def test_an_offloaded_optimizer_trains_with_torch_adamw_when_cpu_adam_cannot_be_built(
    train_in_process, tmp_path, monkeypatch, caplog
):
    """No C++ compiler (CXX fails) and no cached op: one line says so, and the job trains anyway."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    # DeepSpeed keeps every op a process loaded (an earlier test in this process may have loaded cpu_adam):
    # this test is a process that never has.
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="launcher"):
        ran = train_in_process(
            "deepspeed=z2_offload",
            "logger=none",
            "train.max_steps=8",
            "train.micro_batch_size=4",
            "train.eval_every=0",
            "data.eval_accuracy=false",
            run_dir=run_dir,
        )
    assert ran.outcome.status == "completed", ran.outcome.error
    lines = [
        record.getMessage() for record in caplog.records if "cpu_adam op could not be built" in record.getMessage()
    ]
    assert len(lines) == 1 and "torch's fused AdamW" in lines[0], lines
    assert read_summary(run_dir)["optimizer"] == "AdamW"
    curve = losses(run_dir)
    assert curve[-1] < curve[0]
