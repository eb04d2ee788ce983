"""Command-line overrides (`key=value`, `+key=value`, `~key`, `group@package=choice`): the one parser.

Every part of the launcher that asks "which key does this override set?" or "what did the command
line give KEY?" calls these, so the planner, the resume, the tuner and W&B agree on what an override is.
"""

from __future__ import annotations

from collections.abc import Sequence

# Hydra flags that print something instead of running a job.
NO_JOB_FLAGS = frozenset(
    {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--version", "--shell-completion"}
)


def override_key(override: str) -> str:
    """The key an override sets: `+model.lr@x=1` -> `model.lr`, `~deepspeed_extra` -> `deepspeed_extra`."""
    return override.split("=", 1)[0].strip().lstrip("+~").split("@", 1)[0]


def override_value(override: str) -> str | None:
    """The value an override gives, without quotes (None for `~key`, which deletes)."""
    _, sep, value = override.partition("=")
    return value.strip().strip("'\"") if sep else None


def argument(argv: Sequence[str], key: str) -> str | None:
    """The last value the command line `argv` (program name first) gives KEY, without quotes."""
    values = [override_value(arg) for arg in argv[1:] if "=" in arg and override_key(arg) == key]
    return values[-1] if values else None


def runs_a_job(argv: Sequence[str]) -> bool:
    """False for Hydra's flags that print a config or help instead of running the job."""
    return not any(arg.split("=", 1)[0] in NO_JOB_FLAGS for arg in argv[1:])


def is_multirun(argv: Sequence[str]) -> bool:
    return "-m" in argv or "--multirun" in argv


def replaced(old: Sequence[str], new: Sequence[str]) -> list[str]:
    """`old` overrides, each one whose key `new` also sets left out, then `new`: the new ones win."""
    new_keys = {override_key(arg) for arg in new}
    return [*(arg for arg in old if override_key(arg) not in new_keys), *new]
