"""W&B offline runs read back with W&B's own CLI (`wandb leet inspect`), as a user would: shared by the
sweep and reshard tests (tests/helpers.py is shared by every test; this is theirs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _inspect(run: Path, env: dict[str, str], *flags: str) -> str:
    wandb_cli = Path(sys.executable).with_name("wandb")
    return subprocess.run(
        [str(wandb_cli), "leet", "inspect", *flags, "--json", str(run)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    ).stdout


def inspect_summary(run: Path, env: dict[str, str]) -> dict[str, Any]:
    """The run's config, summary, tags and state."""
    return json.loads(_inspect(run, env, "--summary"))


def inspect_run_record(run: Path, env: dict[str, str]) -> dict[str, Any]:
    """The run's own record (its group, its job type)."""
    records = [json.loads(line) for line in _inspect(run, env).splitlines() if line.strip()]
    return next(record for record in records if record.get("type") == "run")["run"]
