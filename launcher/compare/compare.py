"""Compare the runs of a sweep: one table, one picture, so a person can pick a configuration.

Usage::

    python -m launcher.compare outputs/multirun/2026-11-29/15-30-00         # a sweep directory
    python -m launcher.compare outputs/2026-11-29/10-00-00 outputs/2026-11-29/11-00-00  # runs
    python -m launcher.compare --wandb ENTITY/PROJECT --group GROUP          # the same, from W&B

Rows are runs, sorted by throughput (samples/s, highest first; failed runs last), each named by the
settings that tell it apart (``deepspeed=z2,precision=bf16``, `run_names`). Columns are the
config-group choices (and other overrides) that differ between the runs, then status, steps, losses,
accuracy, throughput, peak memory and wall time. Written next to the runs (into a sweep directory, or
the directory holding the given runs; ``--out`` elsewhere): ``compare.md`` (table, failed runs with
their error line, the picture), ``compare.csv`` (raw numbers, bytes and seconds) and ``compare.png``
(train/loss curves, throughput and peak-memory bars per configuration).

Local runs are read only from files the job writes (``summary.json``, ``metrics.jsonl``,
``.hydra/overrides.yaml``, ``.hydra/hydra.yaml``), so a copy of ``outputs/`` is enough. A run
directory without ``summary.json`` (a job killed hard) is listed as "incomplete", with whatever its
``metrics.jsonl`` holds.

The W&B path (`fetch_wandb_rows`) uses W&B's public API as documented for wandb 0.31:
``wandb.Api().runs("entity/project", filters={"group": GROUP})``, each run's ``summary_metrics``
(written by `launcher.wandb_logger.WandbRun.finish` with summary.json's keys), ``tags``
(``group=choice``) and ``scan_history(keys=["trainer/step", "train/loss"])`` for the curves. It needs
network access and credentials and is NOT exercised against a server in this repository's tests;
only the conversion of API run objects into rows (`row_from_wandb_run`) is tested, with stand-ins.
Everything after fetching rows is shared with the local path.

This module imports neither torch nor wandb at import time; matplotlib is imported only to draw.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.tracking.wandb_run import GROUP_ORDER, STEP_METRIC, experiment_overrides

FAILED = "failed"
INCOMPLETE = "incomplete"
OUTPUT_STEM = "compare"

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
    samples_per_sec: float | None = None
    tokens_per_sec: float | None = None
    peak_memory_bytes: int | None = None
    """A GPU run's peak reserved device memory; a CPU run's peak resident set (launcher.device_memory)."""
    host_memory_bytes: int | None = None
    """A GPU run's peak host resident set (where offloaded states live); None on a CPU (peak_memory_bytes)."""
    pinned_host_bytes: int | None = None
    wall_s: float | None = None
    error: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, train/loss) pairs."""


# --------------------------------------------------------------------------------------------------
# Finding and reading run directories


def is_run_dir(path: Path) -> bool:
    """A directory a training job wrote: it has summary.json, metrics.jsonl or .hydra/."""
    return (path / "summary.json").is_file() or (path / "metrics.jsonl").is_file() or (path / ".hydra").is_dir()


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
    summary = _read_json(run_dir / "summary.json")
    summary = summary if isinstance(summary, dict) else {}
    overrides = summary.get("overrides")
    if not isinstance(overrides, list):
        overrides = _read_yaml(run_dir / ".hydra" / "overrides.yaml")
    choices = summary.get("choices")
    if not isinstance(choices, dict):
        hydra = _read_yaml(run_dir / ".hydra" / "hydra.yaml")
        try:
            choices = hydra["hydra"]["runtime"]["choices"]
        except (TypeError, KeyError):
            choices = None
    last, curve = read_metrics(run_dir / "metrics.jsonl")
    status = summary.get("status") or INCOMPLETE
    return build_row(run_dir.name, str(run_dir), status, summary, choices, overrides, last, curve)


# --------------------------------------------------------------------------------------------------
# From W&B (not exercised against a server here; see the module docstring)


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


# --------------------------------------------------------------------------------------------------
# Shared by both sources


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
        samples_per_sec=pick("samples_per_sec", "perf/samples_per_sec"),
        tokens_per_sec=pick("tokens_per_sec", "perf/tokens_per_sec"),
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


# --------------------------------------------------------------------------------------------------
# Formatting


def human_bytes(n: float | None) -> str:
    """Bytes in binary units: "512 MiB", "1.50 GiB"."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.2f} {unit}" if value < 10 else f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"


def human_seconds(s: float | None) -> str:
    """Seconds as "42.0 s", "3m 05s" or "1h 02m"."""
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    minutes, seconds = divmod(round(s), 60)
    if minutes < 60:
        return f"{minutes}m {seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m"


def _fmt(value: float | None, digits: int) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


_NUMERIC_HEADERS = (
    "steps",
    "final loss",
    "eval loss",
    "eval acc",
    "samples/s",
    "tokens/s",
    "peak mem",
    "wall",
)


def _host_cell(row: RunRow) -> str:
    if row.host_memory_bytes is None:
        return "-"
    pinned = f" ({human_bytes(row.pinned_host_bytes)} pinned)" if row.pinned_host_bytes else ""
    return human_bytes(row.host_memory_bytes) + pinned


def _numeric_headers(rows: Sequence[RunRow]) -> tuple[str, ...]:
    """GPU runs add the host's memory beside the device's: an offload preset moves bytes, not saves them."""
    if any(row.host_memory_bytes is not None for row in rows):
        return (*_NUMERIC_HEADERS[:-1], "host mem", _NUMERIC_HEADERS[-1])
    return _NUMERIC_HEADERS


def table(rows: Sequence[RunRow], keys: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells of the comparison table (rows already sorted)."""
    host = "host mem" in _numeric_headers(rows)
    headers = ["run", *keys, "status", *_numeric_headers(rows)]
    cells = [
        [
            name,
            *(row.settings.get(k, "-") for k in keys),
            row.status,
            str(row.steps) if row.steps is not None else "-",
            _fmt(row.final_loss, 4),
            _fmt(row.eval_loss, 4),
            _fmt(row.eval_accuracy, 3),
            _fmt(row.samples_per_sec, 1),
            _fmt(row.tokens_per_sec, 0),
            human_bytes(row.peak_memory_bytes),
            *([_host_cell(row)] if host else []),
            human_seconds(row.wall_s),
        ]
        for name, row in zip(run_names(rows, keys), rows, strict=True)
    ]
    return headers, cells


def render_text(rows: Sequence[RunRow], keys: Sequence[str]) -> str:
    """The table for the terminal, numbers right-aligned, then failed runs with their error line."""
    headers, cells = table(rows, keys)
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    first_numeric = len(headers) - len(_numeric_headers(rows))

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if i >= first_numeric else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ).rstrip()

    out = [line(headers), line(["-" * w for w in widths]), *(line(c) for c in cells)]
    names = run_names(rows, keys)
    out += [f"{name} {row.status}: {row.error}" for name, row in zip(names, rows, strict=True) if row.error]
    return "\n".join(out)


def _count(rows: Sequence[RunRow]) -> str:
    return f"{len(rows)} run" if len(rows) == 1 else f"{len(rows)} runs"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(rows: Sequence[RunRow], keys: Sequence[str], title: str, image: str | None) -> str:
    """compare.md: the table, how it is sorted, the failed and incomplete runs, the picture."""
    headers, cells = table(rows, keys)
    first_numeric = len(headers) - len(_numeric_headers(rows))
    align = ["---:" if i >= first_numeric else "---" for i in range(len(headers))]
    lines = [
        f"# Run comparison: {title}",
        "",
        f"{_count(rows)}, sorted by samples/s (highest first), failed runs last."
        + (f" Columns between run and status: the settings that differ ({', '.join(keys)})." if keys else "")
        + (
            " peak mem: a GPU run's peak device memory reserved by torch's allocator (a CPU run's peak resident"
            " set); host mem: a GPU run's peak host resident set, with its page-locked part (offloaded states)."
            if "host mem" in headers
            else ""
        ),
        "",
        "| " + " | ".join(_md_cell(h) for h in headers) + " |",
        "| " + " | ".join(align) + " |",
        *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in cells),
    ]
    named = list(zip(run_names(rows, keys), rows, strict=True))
    failed = [(name, row) for name, row in named if row.status == FAILED or row.error]
    if failed:
        lines += ["", "## Failed runs", ""]
        for name, row in failed:
            status = "" if row.status == FAILED else f", {row.status}"
            lines.append(f"- run {_md_cell(name)} ({row.source}{status}): {_md_cell(row.error or 'no error recorded')}")
    incomplete = [(name, row) for name, row in named if row.status == INCOMPLETE]
    if incomplete:
        lines += ["", "## Incomplete runs (no summary.json: killed or still starting)", ""]
        lines += [f"- run {_md_cell(name)} ({row.source})" for name, row in incomplete]
    if image:
        lines += ["", f"![train loss, throughput and peak memory per run]({image})"]
    return "\n".join(lines) + "\n"


_CSV_FIELDS = (
    "status",
    "steps",
    "final_loss",
    "eval_loss",
    "eval_accuracy",
    "samples_per_sec",
    "tokens_per_sec",
    "peak_memory_bytes",
    "host_memory_bytes",
    "pinned_host_bytes",
    "wall_s",
    "error",
    "source",
)


def write_csv(rows: Sequence[RunRow], keys: Sequence[str], path: Path) -> None:
    """compare.csv: one line per run, raw numbers (bytes, seconds), empty where unknown."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", *keys, *_CSV_FIELDS])
        for name, row in zip(run_names(rows, keys), rows, strict=True):
            values = [getattr(row, field_name) for field_name in _CSV_FIELDS]
            writer.writerow([name, *(row.settings.get(k, "") for k in keys), *("" if v is None else v for v in values)])


def _wrap_label(label: str, width: int = 28) -> str:
    """Lines of at most about `width` characters, broken after a comma or at a space."""
    parts, line = [], ""
    for word in re.findall(r"[^, ]+,?|[, ]", label):
        if line.strip() and len(line) + len(word) > width:
            parts.append(line.strip())
            line = word
        else:
            line += word
    return "\n".join([*parts, line.strip()])


def write_plot(rows: Sequence[RunRow], labels: Sequence[str], path: Path, title: str) -> None:
    """compare.png: train/loss vs step for every run; samples/s and peak memory bars per run."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    colors = [f"C{i % 10}" for i in range(len(rows))]
    wrapped = [_wrap_label(label) for label in labels]
    bar_height = max(3.0, 0.55 * len(rows) * max(w.count("\n") + 1 for w in wrapped))
    fig = Figure(figsize=(13, 4.5 + bar_height), layout="constrained")
    grid = fig.add_gridspec(2, 2, height_ratios=[4.5, bar_height])
    ax_loss = fig.add_subplot(grid[0, :])
    ax_speed = fig.add_subplot(grid[1, 0])
    ax_mem = fig.add_subplot(grid[1, 1])
    fig.suptitle(f"{title}: {_count(rows)}")

    linestyles = ["-", "--", "-.", ":"]
    for i, (row, label, color) in enumerate(zip(rows, labels, colors, strict=True)):
        if row.curve:
            steps, losses = zip(*row.curve, strict=True)
            suffix = "" if row.status == "completed" else f" ({row.status})"
            style = linestyles[(i // 10) % 4]
            ax_loss.plot(steps, losses, color=color, linestyle=style, label=label + suffix)
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("train/loss")
    ax_loss.set_title("training loss")
    ax_loss.grid(alpha=0.3)
    if any(row.curve for row in rows):
        ax_loss.legend(fontsize="small", loc="upper right")
    else:
        ax_loss.text(0.5, 0.5, "no train/loss logged", ha="center", va="center", transform=ax_loss.transAxes)

    positions = list(range(len(rows)))
    bars = [
        (ax_speed, [row.samples_per_sec for row in rows], "samples/s (higher is better)", lambda v: _fmt(v, 1)),
        (
            ax_mem,
            [row.peak_memory_bytes / 2**30 if row.peak_memory_bytes is not None else None for row in rows],
            "peak memory, GiB (lower is better)",
            lambda v: human_bytes(v * 2**30),
        ),
    ]
    for ax, values, xlabel, fmt in bars:
        known = [v for v in values if v is not None]
        top = max(known, default=1.0) or 1.0
        ax.barh(positions, [v or 0.0 for v in values], color=colors)
        for pos, value, row in zip(positions, values, rows, strict=True):
            text = fmt(value) if value is not None else row.status
            if value is not None and row.status != "completed":
                text += f" ({row.status})"
            ax.text((value or 0.0) + 0.01 * top, pos, text, va="center", fontsize="small")
        ax.set_yticks(positions, wrapped, fontsize="small")
        ax.invert_yaxis()
        ax.set_xlim(0, top * 1.4)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
    ax_mem.set_yticks(positions, [""] * len(rows))
    fig.savefig(path, dpi=110)


def write_outputs(rows: Sequence[RunRow], out_dir: Path, title: str, plot: bool = True) -> Path:
    """Write compare.md, compare.csv and compare.png for rows into out_dir; return the md path."""
    rows = sort_rows(rows)
    keys = differing_keys(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    image = None
    if plot and rows:
        image = f"{OUTPUT_STEM}.png"
        write_plot(rows, run_names(rows, keys), out_dir / image, title)
    write_csv(rows, keys, out_dir / f"{OUTPUT_STEM}.csv")
    md_path = out_dir / f"{OUTPUT_STEM}.md"
    md_path.write_text(render_markdown(rows, keys, title, image))
    return md_path


def terminal_table(rows: Sequence[RunRow]) -> str:
    """The comparison as the terminal shows it: rows sorted, columns for the settings that differ."""
    return render_text(sort_rows(rows), differing_keys(rows))


def written_line(md_path: Path, plot: bool = True) -> str:
    """The line that ends a comparison on the terminal: where its files are."""
    return f"comparison: {md_path} (+ compare.csv{', compare.png' if plot else ''})"


def default_out_dir(paths: Sequence[Path]) -> Path:
    """Where a comparison of local runs is written without --out: a sweep directory given alone; else
    the directory holding all the given runs (their common parent), as a sweep directory holds its jobs.
    Runs with nothing in common but the file system's root are compared into the current directory."""
    if len(paths) == 1 and not is_run_dir(paths[0]):
        return paths[0]
    resolved = [Path(path).resolve() for path in paths]
    common = Path(os.path.commonpath(resolved))
    if common in resolved and is_run_dir(common):  # a single run: next to it
        common = common.parent
    return Path.cwd() if common == Path(common.anchor) else common


def write_comparison(sweep_dir: Path | str, out_dir: Path | str | None = None) -> Path:
    """Compare the runs of a sweep directory and write compare.md/.csv/.png into it (or out_dir).

    Called by the end-of-multirun hook; returns the path of compare.md. Raises NotARunError when
    sweep_dir holds no runs.
    """
    sweep_dir = Path(sweep_dir)
    rows = load_runs([sweep_dir])
    return write_outputs(rows, Path(out_dir) if out_dir else sweep_dir, sweep_dir.name)


# --------------------------------------------------------------------------------------------------
# Command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.compare",
        description=(
            "Compare training runs: a table (rows = runs sorted by samples/s, failed last; columns = "
            "the choices that differ) in the terminal, and compare.md, compare.csv, compare.png on disk."
        ),
    )
    parser.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="PATH",
        help="a multirun sweep directory (its job subdirectories are the runs) or run directories",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=(
            "where to write compare.md/.csv/.png. Default: the sweep directory when PATH is a single "
            "sweep directory; otherwise the directory that holds all the given runs (their common parent); "
            "with --wandb the current directory. The last line printed says where they went"
        ),
    )
    parser.add_argument(
        "--wandb",
        metavar="ENTITY/PROJECT",
        help="read the runs from W&B's public API instead of from disk (needs network and credentials)",
    )
    parser.add_argument("--group", help="with --wandb: only the runs of this W&B group (e.g. the sweep)")
    parser.add_argument("--no-plot", action="store_true", help="skip compare.png (and matplotlib)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for paths that are not runs, with one line on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if bool(args.paths) == bool(args.wandb):
        parser.error("give run/sweep directories or --wandb ENTITY/PROJECT (one of the two)")
    if args.group and not args.wandb:
        parser.error("--group only applies with --wandb")

    if args.wandb:
        try:
            rows = fetch_wandb_rows(args.wandb, args.group)
        except Exception as exc:
            print(f"compare: error: cannot read runs from W&B {args.wandb}: {exc}".splitlines()[0], file=sys.stderr)
            return 1
        if not rows:
            print(f"compare: error: no W&B runs in {args.wandb} group {args.group!r}", file=sys.stderr)
            return 2
        title = f"{args.wandb} {args.group or ''}".strip()
        out_dir = args.out or Path.cwd()
    else:
        try:
            rows = load_runs(args.paths)
        except NotARunError as exc:
            print(f"compare: error: {exc}", file=sys.stderr)
            return 2
        single_sweep = len(args.paths) == 1 and not is_run_dir(args.paths[0])
        title = args.paths[0].resolve().name if single_sweep else _count(rows)
        out_dir = args.out or default_out_dir(args.paths)

    print(terminal_table(rows))
    try:
        md_path = write_outputs(rows, out_dir, title, plot=not args.no_plot)
    except OSError as exc:
        print(f"compare: error: cannot write to {out_dir}: {exc}", file=sys.stderr)
        return 1
    print("\n" + written_line(md_path.absolute(), plot=not args.no_plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
