"""What a run's terminal shows, and what only its train.log gets.

The terminal shows the launcher's own lines (what it decided, progress, warnings, errors), Hydra's,
and one summary at the end; the libraries' chatter goes to the run directory's train.log at most:

- DeepSpeed's logger prints to stdout through a handler of its own, from `import deepspeed` on
  ("Setting accelerator to CPU" in every process, "Attempting to get learning rate from scheduler
  before it has started" on every rank). `route_library_logs`, called before deepspeed is imported,
  hands its records to the root logger's handlers instead: train.log, and the terminal through
  `TerminalFilter`.
- Other libraries' INFO records reach train.log only. Among them, the compiler probe of DeepSpeed's op
  builders (`gcc ... test.c`: AsyncIOBuilder.has_function, run when `deepspeed.ops.__compatible_ops__`
  is first read), which setuptools' distutils logs at INFO on the `compilers.C` loggers.
- Known noise (`NOISE`: warnings that say nothing a user can act on, the Optuna sweeper's setup lines)
  reaches train.log only; every other warning, and every error, stays on the terminal.
- transformers' progress bars (loading and writing weights) are off (`quiet_transformers`); the hub's
  download bars stay: a download is a long step that must show progress.
- Ranks other than 0 print errors only: their warnings repeat rank 0's, and the launcher reports the
  first failing rank's error in one line.
- W&B prints nothing of its own (launcher.wandb_logger starts it silent); the run summary names the run.

Hydra's console handlers get `TerminalFilter` from conf/hydra/job_logging/launcher.yaml and
conf/hydra/hydra_logging/launcher.yaml (selected in conf/config.yaml); a rank's come from `setup_rank_log`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from launcher.core.credentials import redact_text

# A launcher record carrying this `extra` goes to train.log only (a detail, e.g. a cache reused).
FILE_ONLY = {"terminal": False}

# (logger name prefix, message pattern): records that reach train.log but not the terminal.
NOISE = (
    ("DeepSpeed", re.compile(r"Setting accelerator to CPU")),  # the launcher's job line names the device
    ("DeepSpeed", re.compile(r"Attempting to get learning rate from scheduler before it has started")),
    ("hydra_plugins.hydra_optuna_sweeper", re.compile(r"(Study name|Storage|Sampler|Directions): ")),
    # bitsandbytes at import on a CPU with AVX512-BF16: a kernel for inference, which the launcher turns off
    # (launcher.model.method.keep_4bit_layout); it would not speed up training.
    ("bitsandbytes", re.compile(r"Failed to load CPU gemm_4bit_forward")),
)

# Loggers whose INFO records the terminal shows: the launcher's, and Hydra's (a sweep's "#1 : ...").
_SHOWN = ("launcher", "hydra", "hydra_plugins", "__main__")

LINE_FORMAT = "[%(asctime)s][%(levelname)s] %(message)s"
FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def is_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return any(record.name.startswith(name) and pattern.search(message) for name, pattern in NOISE)


class TerminalFilter(logging.Filter):
    """Lets a console handler print the launcher's and Hydra's lines and everyone's warnings, less `NOISE`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "terminal", True) is False or is_noise(record):
            return False
        if record.name.split(".")[0] in ("hydra", "hydra_plugins"):  # a sweep's "#0 : a=1 +x.api_key=..."
            message = record.getMessage()
            if (public := redact_text(message)) != message:
                record.msg, record.args = public, None
        return record.levelno >= logging.WARNING or record.name.split(".")[0] in _SHOWN


class _ThroughRoot(logging.Filter):
    """On DeepSpeed's logger: its records go to the root logger's handlers, not to its own stdout one.

    Where nothing configured the root logger (a library use), DeepSpeed prints as before, less the noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        handlers = logging.getLogger().handlers
        if not handlers:
            return not is_noise(record)
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
        return False


def route_library_logs() -> None:
    """Call before deepspeed is imported: its logger's records go where the root logger's go."""
    deepspeed_logger = logging.getLogger("DeepSpeed")  # the name deepspeed.utils.logging gives its logger
    if not any(isinstance(f, _ThroughRoot) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_ThroughRoot())


def quiet_transformers() -> None:
    """transformers' own progress bars off (loading and writing weights); the hub's download bars as they were."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    hub_bars = not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # also turns the hub's off
    if hub_bars:
        enable_progress_bars()


def setup_rank_log(train_log: Path, rank: int) -> None:
    """A rank's logging, set before deepspeed is imported: rank 0 writes train.log and prints through
    `TerminalFilter`; the other ranks print errors only. A process whose logging Hydra set up (a SLURM
    task trains in the Hydra job's process) keeps Hydra's handlers."""
    route_library_logs()
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    if root.handlers:  # Hydra's, with TerminalFilter on its console (conf/config.yaml)
        return
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter(LINE_FORMAT))
    if rank != 0:
        console.setLevel(logging.ERROR)
        root.addHandler(console)
        return
    file = logging.FileHandler(train_log)
    file.setFormatter(logging.Formatter(FILE_FORMAT))
    root.addHandler(file)
    console.addFilter(TerminalFilter())
    root.addHandler(console)
