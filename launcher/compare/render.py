"""The comparison written out: a terminal table, compare.md, compare.csv and compare.png."""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence
from pathlib import Path

from launcher.compare.runs import (
    FAILED,
    INCOMPLETE,
    RunRow,
    differing_keys,
    is_run_dir,
    load_runs,
    run_names,
    sort_rows,
)

OUTPUT_STEM = "compare"


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


def _percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1%}" if value < 0.1 else f"{value:.0%}"


_NUMERIC_HEADERS = (
    "steps",
    "final loss",
    "eval loss",
    "eval acc",
    "samples/s",
    "tokens/s",
    "padding",
    "MFU",
    "peak mem",
    "wall",
)


def _host_cell(row: RunRow) -> str:
    if row.host_memory_bytes is None:
        return "-"
    pinned = f" ({human_bytes(row.pinned_host_bytes)} pinned)" if row.pinned_host_bytes else ""
    return human_bytes(row.host_memory_bytes) + pinned


def _numeric_headers(rows: Sequence[RunRow]) -> tuple[str, ...]:
    """GPU runs add the host's memory beside the device's: an offload preset moves bytes, not saves them.
    Preference runs (loss=dpo|ipo) add their held-out reward accuracy after the exact match."""
    headers = _NUMERIC_HEADERS
    if any(row.reward_accuracy is not None for row in rows):
        at = headers.index("eval acc") + 1
        headers = (*headers[:at], "reward acc", *headers[at:])
    if any(row.host_memory_bytes is not None for row in rows):
        return (*headers[:-1], "host mem", headers[-1])
    return headers


def table(rows: Sequence[RunRow], keys: Sequence[str]) -> tuple[list[str], list[list[str]]]:
    """Headers and formatted cells of the comparison table (rows already sorted)."""
    host = "host mem" in _numeric_headers(rows)
    rewards = "reward acc" in _numeric_headers(rows)
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
            *([_fmt(row.reward_accuracy, 3)] if rewards else []),
            _fmt(row.samples_per_sec, 1),
            _fmt(row.tokens_per_sec, 0),
            _percent(row.padding_frac),
            _percent(row.mfu),
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


def count_line(rows: Sequence[RunRow]) -> str:
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
        f"{count_line(rows)}, sorted by samples/s (highest first), failed runs last."
        + (f" Columns between run and status: the settings that differ ({', '.join(keys)})." if keys else "")
        + (
            " peak mem: a GPU run's peak device memory reserved by torch's allocator (a CPU run's peak resident"
            " set); host mem: a GPU run's peak host resident set, with its page-locked part (offloaded states)."
            if "host mem" in headers
            else ""
        )
        + (
            " reward acc: the share of held-out preference pairs whose chosen answer's reward is the higher"
            " (loss=dpo|ipo)."
            if "reward acc" in headers
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
    "reward_accuracy",
    "samples_per_sec",
    "tokens_per_sec",
    "padding_frac",
    "mfu",
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
    fig.suptitle(f"{title}: {count_line(rows)}")

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
