"""What the terminal shows and what only train.log gets (launcher.core.logs)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from launcher.core import logs
from launcher.core.logs import FILE_ONLY, TerminalFilter, is_noise, route_library_logs, setup_rank_log
from tests.helpers import ROOT

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
        ("__main__", logging.INFO, "a line of train.py", {}, True),
        ("compilers.C.base", logging.INFO, "gcc -c /tmp/tmpx/test.c -o /tmp/tmpx/test.o", {}, False),
        ("DeepSpeed", logging.WARNING, "Setting accelerator to CPU. If you have GPU ...", {}, False),
        ("DeepSpeed", logging.WARNING, LR_WARNING, {}, False),
        ("DeepSpeed", logging.WARNING, "some other DeepSpeed warning", {}, True),
        ("DeepSpeed", logging.INFO, "DeepSpeed info", {}, False),
        ("DeepSpeed", logging.ERROR, "an error", {}, True),
        ("hydra_plugins.hydra_optuna_sweeper._impl", logging.INFO, "Study name: lr_search", {}, False),
        ("hydra_plugins.hydra_optuna_sweeper._impl", logging.INFO, "Best value: 3.9", {}, True),
        ("transformers.modeling_utils", logging.INFO, "loading weights", {}, False),
        ("transformers.modeling_utils", logging.WARNING, "some weights were not used", {}, True),
        ("launcher", logging.ERROR, "a detail for the log", FILE_ONLY, False),  # FILE_ONLY wins at any level
    ],
)
def test_the_terminal_shows_the_launchers_lines_and_warnings_less_the_noise(name, level, message, extra, shown):
    assert TerminalFilter().filter(_record(name, level, message, **extra)) is shown


def test_noise_is_known_by_logger_and_message():
    assert is_noise(_record("DeepSpeed", logging.WARNING, f"[rank0] {LR_WARNING}"))
    assert is_noise(_record("DeepSpeed.engine", logging.INFO, "Setting accelerator to CPU"))
    assert not is_noise(_record("launcher", logging.WARNING, LR_WARNING))  # the pattern is DeepSpeed's only
    assert not is_noise(_record("DeepSpeed", logging.WARNING, "Setting up the optimizer"))


# ----------------------------------------------------------------------------- a rank's logging, in this process
@contextmanager
def bare_logging() -> Iterator[None]:
    """The root logger without handlers, as in a fresh rank's process (entered in the test itself: pytest
    adds its own handlers for the call); what was there is put back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    deepspeed_filters = logging.getLogger("DeepSpeed").filters[:]
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        logging.getLogger("DeepSpeed").filters[:] = deepspeed_filters


def _deepspeed_logger() -> logging.Logger:
    from deepspeed.utils import logger

    return logger


def test_rank_0_prints_through_the_terminal_filter_and_writes_everything_to_train_log(tmp_path, capsys):
    train_log = tmp_path / "train.log"
    deepspeed = _deepspeed_logger()
    with bare_logging():
        setup_rank_log(train_log, 0)
        deepspeed.warning(LR_WARNING)
        deepspeed.warning("a DeepSpeed warning that matters")
        logging.getLogger("launcher").info("step 1/2")
        logging.getLogger("launcher").info("data cache reused", extra=FILE_ONLY)
        # Another library's INFO record (not transformers': once imported, it keeps its records to itself).
        logging.getLogger("some_library.loader").info("loading weights")
    captured = capsys.readouterr()
    terminal = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(terminal) == 2, terminal
    assert terminal[0].endswith("a DeepSpeed warning that matters") and terminal[1].endswith("step 1/2")
    assert terminal[1].startswith("[") and "][INFO] step 1/2" in terminal[1]  # LINE_FORMAT
    log = train_log.read_text()
    for line in (LR_WARNING, "a DeepSpeed warning that matters", "step 1/2", "data cache reused", "loading weights"):
        assert line in log
    assert "[launcher][INFO] - step 1/2" in log  # FILE_FORMAT names the logger


def test_ranks_other_than_0_print_errors_only(tmp_path, capsys):
    deepspeed = _deepspeed_logger()
    with bare_logging():
        setup_rank_log(tmp_path / "train.log", 1)
        deepspeed.warning("a warning rank 0 prints too")
        logging.getLogger("launcher").warning("a launcher warning")
        logging.getLogger("launcher").error("rank 1 failed")
    captured = capsys.readouterr()
    terminal = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(terminal) == 1 and terminal[0].endswith("rank 1 failed"), terminal
    assert not (tmp_path / "train.log").exists()  # rank 0 writes the run's log


def test_a_process_whose_logging_hydra_set_up_keeps_its_handlers(tmp_path):
    hydras = logging.StreamHandler()
    with bare_logging():
        logging.getLogger().addHandler(hydras)
        setup_rank_log(tmp_path / "train.log", 0)
        assert logging.getLogger().handlers == [hydras]
    assert not (tmp_path / "train.log").exists()


def test_deepspeeds_records_are_routed_once_and_print_less_the_noise_where_nothing_set_up_logging():
    with bare_logging():
        route_library_logs()
        route_library_logs()
        deepspeed = logging.getLogger("DeepSpeed")
        routed = [f for f in deepspeed.filters if isinstance(f, logs._ThroughRoot)]
        assert len(routed) == 1
        # No root handlers (a library use): DeepSpeed's own handler prints, less the noise.
        assert routed[0].filter(_record("DeepSpeed", logging.WARNING, "a warning")) is True
        assert routed[0].filter(_record("DeepSpeed", logging.WARNING, LR_WARNING)) is False


def test_transformers_bars_go_off_and_the_hubs_stay_as_they_were():
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    before = (hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled())
    try:
        for hub_disabled in (False, True):
            hf_logging.enable_progress_bar()
            (disable_progress_bars if hub_disabled else enable_progress_bars)()
            logs.quiet_transformers()
            assert not hf_logging.is_progress_bar_enabled()
            assert are_progress_bars_disabled() is hub_disabled
    finally:
        (hf_logging.enable_progress_bar if before[0] else hf_logging.disable_progress_bar)()
        (disable_progress_bars if before[1] else enable_progress_bars)()


# ----------------------------------------------------------------------------- a fresh process
@pytest.mark.slow
def test_deepspeeds_lines_and_the_compiler_probe_reach_train_log_not_the_terminal(tmp_path):
    """In a rank's process: DeepSpeed's import-time accelerator line, the op builders' compiler probe
    (`gcc ... test.c`) and its scheduler warning go to train.log; the terminal gets none of them. Only a
    fresh interpreter imports deepspeed after `setup_rank_log`, as a rank does."""
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
