"""The files a run directory holds, written atomically so nothing half-written looks complete.

ds_config.json   the exact dict given to DeepSpeed
job.json         facts the ranks need from the Hydra job (overrides, choices, W&B group)
metrics.jsonl    one line per logged step
summary.json     the run's outcome (status "running" until it ends)
train.log        the log of rank 0
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

JOB_FILE = "job.json"
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
DS_CONFIG_FILE = "ds_config.json"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through a temporary file and a rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(obj, handle, indent=2, default=str)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def directory_problem(path: Path) -> str | None:
    """Why `path` cannot be made (or written) as a directory; None when it can.

    Probed by creating, and removing, a temporary directory in `path` or its nearest existing
    ancestor: permission bits alone do not tell (root, read-only mounts, /proc)."""
    path = Path(path).expanduser().absolute()
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".write-probe-", dir=ancestor)
    except OSError as err:
        return f"cannot create a directory in {ancestor}: {err.strerror or err}"
    os.rmdir(probe)
    return None


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def summary_skeleton(job: dict[str, Any]) -> dict[str, Any]:
    """The fields every summary.json has, with nulls where the run has not produced them."""
    choices = job.get("choices", {})
    return {
        "status": "running",
        "steps": 0,
        "wall_s": None,
        "final_loss": None,
        "eval_loss": None,
        "eval_accuracy": None,
        "samples_per_sec": None,
        "tokens_per_sec": None,
        "peak_memory_bytes": None,
        "world_size": job.get("world_size"),
        "zero_stage": None,
        "precision": choices.get("precision"),
        "offload": choices.get("offload"),
        "comm": choices.get("comm"),
        "deepspeed": choices.get("deepspeed"),
        "model": choices.get("model"),
        "error": None,
        "overrides": job.get("overrides", []),
        "choices": choices,
        "objective": None,
    }


def write_failed_summary(run_dir: Path, job: dict[str, Any], error: str, *, wall_s: float) -> None:
    """A job that could not start still leaves a summary saying why (sweeps list it as failed)."""
    path = run_dir / SUMMARY_FILE
    summary = read_json(path) if path.is_file() else summary_skeleton(job)
    summary.update({"status": "failed", "error": error.splitlines()[0] if error else error})
    if summary.get("wall_s") is None:
        summary["wall_s"] = round(wall_s, 3)
    write_json_atomic(path, summary)


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / METRICS_FILE, "a") as handle:
        handle.write(json.dumps(record) + "\n")
