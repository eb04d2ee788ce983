"""The runs a comparison reads: from run directories on disk (the files a job writes), or from W&B.

Local runs are read only from files the job writes (``summary.json``, ``metrics.jsonl``,
``.hydra/overrides.yaml``, ``.hydra/hydra.yaml``), so a copy of ``outputs/`` is enough. A run
directory without ``summary.json`` (a job killed hard) is listed as "incomplete", with whatever its
``metrics.jsonl`` holds. The W&B path (`fetch_wandb_rows`) is described in launcher.compare.cli.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.core.rundir import RunDir
from launcher.tracking.naming import GROUP_ORDER, experiment_overrides
from launcher.tracking.wandb_run import STEP_METRIC

FAILED = "failed"


INCOMPLETE = "incomplete"


# W&B run states, for runs whose summary lacks our "status" (killed before `finish`).
_WANDB_STATES = {
    "finished": "completed",
    "failed": FAILED,
    "crashed": INCOMPLETE,
    "killed": INCOMPLETE,
    "running": "running",
    "preempted": "preempted",
    "preempting": "preempted",
}


class NotARunError(ValueError):
    """A path given to compare is neither a run directory nor a sweep directory."""


@dataclass
class RunRow:
    """One run as the comparison sees it, whether read from disk or from W&B."""

    name: str
    source: str
    status: str
    settings: dict[str, str] = field(default_factory=dict)
    """Config-group choices plus other experiment overrides (``train.lr`` -> ``3e-4``)."""
    choices_known: bool = True
    """False when only the overrides were found: a group missing from settings is then unknown."""
    steps: int | None = None
    final_loss: float | None = None
    eval_loss: float | None = None
    eval_accuracy: float | None = None
    reward_accuracy: float | None = None  # a preference loss's held-out reward accuracy
    samples_per_sec: float | None = None
    tokens_per_sec: float | None = None
    """Real (non-padding) tokens per second."""
    padding_frac: float | None = None
    mfu: float | None = None
    """Model FLOPs utilisation (launcher.model.flops against launcher.train.peak)."""
    peak_memory_bytes: int | None = None
    """A GPU run's peak reserved device memory; a CPU run's peak resident set (launcher.device_memory)."""
    host_memory_bytes: int | None = None
    """A GPU run's peak host resident set (where offloaded states live); None on a CPU (peak_memory_bytes)."""
    pinned_host_bytes: int | None = None
    wall_s: float | None = None
    error: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, train/loss) pairs."""


def is_run_dir(path: Path) -> bool:
    """A directory a training job wrote: it has summary.json, metrics.jsonl or .hydra/."""
    run = RunDir(path)
    return run.summary.is_file() or run.metrics.is_file() or run.hydra.is_dir()


def _natural_key(path: Path) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name))


def find_run_dirs(path: Path) -> list[Path]:
    """The run directories under path: path itself if it is a run, else its run subdirectories."""
    if not path.is_dir():
        raise NotARunError(f"{path}: no such directory")
    if is_run_dir(path):
        return [path]
    runs = sorted((d for d in path.iterdir() if d.is_dir() and is_run_dir(d)), key=_natural_key)
    if not runs:
        raise NotARunError(
            f"{path} is neither a run directory (no summary.json, metrics.jsonl or .hydra/) "
            "nor a sweep directory (no such subdirectories); pass a run or a multirun sweep directory"
        )
    return runs


def load_runs(paths: Iterable[Path | str]) -> list[RunRow]:
    """Read every run under the given run or sweep directories (in the order given, jobs in order).

    Raises NotARunError for a path that is neither.
    """
    rows = []
    for path in paths:
        rows.extend(read_run(run_dir) for run_dir in find_run_dirs(Path(path)))
    return rows


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_yaml(path: Path) -> Any:
    if not path.is_file():
        return None
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def read_metrics(path: Path) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    """The last value of every metric in metrics.jsonl (max for mem/peak_bytes) and the loss curve.

    Lines that do not parse (a job killed mid-write) are skipped.
    """
    last: dict[str, Any] = {}
    curve: list[tuple[int, float]] = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return last, curve
    for line in lines:
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, TypeError, KeyError):
            continue
        if not isinstance(record, dict):
            continue
        last["step"] = max(step, last.get("step", step))
        for key, value in record.items():
            if key == "mem/peak_bytes" and isinstance(value, (int, float)):
                last[key] = max(value, last.get(key, value))
            elif key != "step":
                last[key] = value
        loss = _number(record.get("train/loss"))
        if loss is not None:
            curve.append((step, loss))
    return last, curve


def read_run(run_dir: Path) -> RunRow:
    """One run directory as a row; without summary.json it is "incomplete"."""
    run = RunDir(run_dir)
    summary = _read_json(run.summary)
    summary = summary if isinstance(summary, dict) else {}
    overrides = summary.get("overrides")
    if not isinstance(overrides, list):
        overrides = _read_yaml(run.overrides)
    choices = summary.get("choices")
    if not isinstance(choices, dict):
        hydra = _read_yaml(run.hydra_config)
        try:
            choices = hydra["hydra"]["runtime"]["choices"]
        except (TypeError, KeyError):
            choices = None
    last, curve = read_metrics(run.metrics)
    status = summary.get("status") or INCOMPLETE
    return build_row(run_dir.name, str(run_dir), status, summary, choices, overrides, last, curve)


def fetch_wandb_rows(project_path: str, group: str | None, *, api: Any = None, timeout_s: int = 30) -> list[RunRow]:
    """Rows for the runs of a W&B project ("entity/project"), optionally of one group only."""
    if api is None:
        import wandb

        api = wandb.Api(timeout=timeout_s)
    filters = {"group": group} if group else {}
    return [row_from_wandb_run(run) for run in api.runs(project_path, filters=filters)]


def row_from_wandb_run(run: Any) -> RunRow:
    """Turn a `wandb.apis.public.Run` into a row (summary keys are summary.json's, see wandb_logger)."""
    summary = dict(run.summary_metrics or {})
    status = summary.get("status") or _WANDB_STATES.get(run.state, run.state)
    choices = summary.get("choices")
    if not isinstance(choices, dict):
        choices = dict(tag.split("=", 1) for tag in (run.tags or []) if "=" in tag)
    overrides = summary.get("overrides") if isinstance(summary.get("overrides"), list) else []
    last = {"step": summary.get(STEP_METRIC), **summary}
    curve = []
    for record in run.scan_history(keys=[STEP_METRIC, "train/loss"]):
        loss = _number(record.get("train/loss"))
        step = _number(record.get(STEP_METRIC))
        if loss is not None and step is not None:
            curve.append((int(step), loss))
    source = getattr(run, "url", None) or "/".join(getattr(run, "path", []) or [run.name])
    return build_row(run.name, source, status, summary, choices, overrides, last, curve)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def build_row(
    name: str,
    source: str,
    status: str,
    summary: Mapping[str, Any],
    choices: Mapping[str, Any] | None,
    overrides: Sequence[str] | None,
    last: Mapping[str, Any],
    curve: list[tuple[int, float]],
) -> RunRow:
    """Assemble a row: summary figures first, the last logged metrics where the summary has none.

    A completed run's summary is final (null means "not defined", e.g. no eval); for a failed,
    preempted or incomplete run the last logged values show how far it got.
    """

    def pick(summary_key: str, metric_key: str) -> float | None:
        value = _number(summary.get(summary_key))
        if value is not None or (status == "completed" and summary_key in summary):
            return value
        return _number(last.get(metric_key))

    settings = {str(k): str(v) for k, v in (choices or {}).items() if v is not None and not str(k).startswith("hydra")}
    for override in experiment_overrides([str(o) for o in overrides or []]):
        key, _, value = override.partition("=")
        settings.setdefault(key, value)

    choices_known = bool(choices)
    steps = pick("steps", "step")
    peak = pick("peak_memory_bytes", "mem/peak_bytes")
    memory = summary.get("memory") if isinstance(summary.get("memory"), Mapping) else {}
    pinned = _number(memory.get("pinned_host_bytes", last.get("mem/pinned_host_bytes")))
    gpu = pinned is not None or "device_used_bytes" in memory or "mem/device_used_bytes" in last
    host = _number(memory.get("host_peak_bytes", last.get("mem/host_peak_bytes"))) if gpu else None
    error = summary.get("error")
    return RunRow(
        name=str(name),
        source=source,
        status=str(status),
        settings=settings,
        choices_known=choices_known,
        steps=int(steps) if steps is not None else None,
        final_loss=pick("final_loss", "train/loss"),
        eval_loss=pick("eval_loss", "eval/loss"),
        eval_accuracy=pick("eval_accuracy", "eval/accuracy"),
        reward_accuracy=pick("eval_rewards_accuracy", "eval/rewards_accuracy"),
        samples_per_sec=pick("samples_per_sec", "perf/samples_per_sec"),
        tokens_per_sec=pick("tokens_per_sec", "perf/tokens_per_sec"),
        padding_frac=pick("padding_frac", "perf/padding_frac"),
        mfu=pick("mfu", "perf/mfu"),
        peak_memory_bytes=int(peak) if peak is not None else None,
        host_memory_bytes=int(host) if host is not None else None,
        pinned_host_bytes=int(pinned) if pinned is not None else None,
        wall_s=_number(summary.get("wall_s")),
        error=str(error).strip().splitlines()[0] if error else None,
        curve=sorted(curve),
    )


def sort_rows(rows: Iterable[RunRow]) -> list[RunRow]:
    """Highest samples/s first; runs without a throughput after them; failed runs last."""
    return sorted(
        rows,
        key=lambda r: (
            r.status == FAILED,
            r.samples_per_sec is None,
            -(r.samples_per_sec or 0.0),
            r.name,
        ),
    )


def differing_keys(rows: Sequence[RunRow]) -> list[str]:
    """The settings whose value is not the same in every run.

    A setting absent from a run counts as a value of its own (the default), except in runs whose
    group choices are unknown (nothing but overrides found), where it is left out.
    """
    keys = {k for row in rows for k in row.settings}
    differing = {
        k for k in keys if len({row.settings.get(k) for row in rows if row.choices_known or k in row.settings}) > 1
    }
    return [k for k in GROUP_ORDER if k in differing] + sorted(differing - set(GROUP_ORDER))


def run_names(rows: Sequence[RunRow], keys: Sequence[str]) -> list[str]:
    """What each run is called in the table, the picture and the error lines: its differing settings
    (``deepspeed=z2,precision=bf16``, as W&B names runs), unique and short.

    A key joins the names only where it tells apart runs the keys before it do not (in `keys`' order):
    a sweep over deepspeed=z0,z2 is named by the preset, not also by the ZeRO stage it implies. Runs
    whose settings are the same get their directory (or W&B) name in brackets; with no differing
    setting a run is called by that name alone."""
    values = [[] for _ in rows]  # type: list[list[str]]
    for key in keys:
        before = len({tuple(v) for v in values})
        after = len({(*v, row.settings.get(key, "-")) for v, row in zip(values, rows, strict=True)})
        if after > before:
            for v, row in zip(values, rows, strict=True):
                v.append(f"{key}={row.settings.get(key, '-')}")
    names = [",".join(v) or row.name for v, row in zip(values, rows, strict=True)]
    counts = {name: names.count(name) for name in names}
    return [f"{name} [{row.name}]" if counts[name] > 1 else name for name, row in zip(names, rows, strict=True)]
