"""What the terminal shows and what only train.log gets (launcher.logs)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from launcher.core.logs import FILE_ONLY, TerminalFilter
from tests.conftest import ROOT

LR_WARNING = "Attempting to get learning rate from scheduler before it has started"  # DeepSpeed, every rank


def _record(name: str, level: int, message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, message, None, None)
    record.__dict__.update(extra)
    return record


@pytest.mark.parametrize(
    ("name", "level", "message", "extra", "shown"),
    [
        ("launcher", logging.INFO, "step 1/30 | loss 5.8", {}, True),
        ("launcher.tracking.wandb_run", logging.INFO, "W&B offline run x started", FILE_ONLY, False),
        ("launcher", logging.WARNING, "building DeepSpeed op cpu_adam, one time, about a minute", {}, True),
        ("hydra._internal.core_plugins.basic_launcher", logging.INFO, "\t#1 : deepspeed=z2", {}, True),
        ("compilers.C.base", logging.INFO, "gcc -c /tmp/tmpx/test.c -o /tmp/tmpx/test.o", {}, False),
        ("DeepSpeed", logging.WARNING, "Setting accelerator to CPU. If you have GPU ...", {}, False),
        ("DeepSpeed", logging.WARNING, LR_WARNING, {}, False),
        ("DeepSpeed", logging.WARNING, "some other DeepSpeed warning", {}, True),
        ("DeepSpeed", logging.ERROR, "an error", {}, True),
        ("hydra_plugins.hydra_optuna_sweeper._impl", logging.INFO, "Study name: lr_search", {}, False),
        ("hydra_plugins.hydra_optuna_sweeper._impl", logging.INFO, "Best value: 3.9", {}, True),
        ("transformers.modeling_utils", logging.INFO, "loading weights", {}, False),
    ],
)
def test_the_terminal_shows_the_launchers_lines_and_warnings_less_the_noise(name, level, message, extra, shown):
    assert TerminalFilter().filter(_record(name, level, message, **extra)) is shown


def test_deepspeeds_lines_and_the_compiler_probe_reach_train_log_not_the_terminal(tmp_path):
    """In a rank's process: DeepSpeed's import-time accelerator line, the op builders' compiler probe
    (`gcc ... test.c`) and its scheduler warning go to train.log; the terminal gets none of them."""
    train_log = tmp_path / "train.log"
    code = f"""
import logging
from pathlib import Path
from launcher.core.logs import setup_rank_log
setup_rank_log(Path({str(train_log)!r}), 0)
import deepspeed.ops
deepspeed.ops.__compatible_ops__  # probes every op: AsyncIOBuilder compiles and links test.c
from deepspeed.utils import logger
logger.warning("Attempting to get learning rate from scheduler before it has started")
logger.warning("a DeepSpeed warning that matters")
logging.getLogger("launcher").info("step 1/2")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    terminal = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(terminal) == 2, terminal
    assert terminal[0].endswith("a DeepSpeed warning that matters") and terminal[1].endswith("step 1/2")
    log = train_log.read_text()
    assert "Setting accelerator to CPU" in log and "Attempting to get learning rate" in log
    assert "a DeepSpeed warning that matters" in log and "step 1/2" in log
    if "gcc" in log or "cc " in log:  # the probe logs its commands where a C compiler runs
        assert "test.c" in log and "test.c" not in result.stdout + result.stderr


def test_ranks_other_than_0_print_errors_only(tmp_path):
    code = f"""
import logging
from pathlib import Path
from launcher.core.logs import setup_rank_log
setup_rank_log(Path({str(tmp_path / "train.log")!r}), 1)
from deepspeed.utils import logger
logger.warning("a warning rank 0 prints too")
logging.getLogger("launcher").error("rank 1 failed")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    terminal = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(terminal) == 1 and terminal[0].endswith("rank 1 failed"), terminal
    assert not (tmp_path / "train.log").exists()  # rank 0 writes the run's log
