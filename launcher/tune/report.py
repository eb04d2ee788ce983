"""What a tuning writes: tune.md, tune.csv, tune.png, results.json, tuning.json and experiment/best.yaml
(rewritten as results come in)."""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.config.compose import CONF_DIR
from launcher.core.credentials import recorded_override, redact_override
from launcher.core.json_files import write_text_atomic
from launcher.tune.decide import STATUS_ORDER, MiB, Result, noise_lines, ordered, pareto_front, pick, planner_lines

# ================================================================================ reports
CSV_COLUMNS = (
    "candidate",
    "status",
    "fits",
    "tokens_per_s",
    "samples_per_s",
    "padding_frac",
    "mfu",
    "peak_mib",
    "planned_mib",
    "measured_over_planned",
    "measured_steps",
    "runs_tokens_per_s",
    "step_spread",
    "others_cpu",
    "wall_s",
    "rank_cpu_s",
    "first_loss",
    "overrides",
    "note",
)


def table_rows(results: Sequence[Result], global_batch: int) -> list[dict[str, Any]]:
    rows = []
    for r in ordered(results):
        rows.append(
            {
                "candidate": r.name,
                "status": r.status,
                "fits": {"fits": "yes", "wrong": "yes", "does not fit": "no", "pruned": "no (predicted)"}.get(
                    r.status, "?"
                ),
                "tokens_per_s": None if r.tokens_per_s is None else round(r.tokens_per_s, 1),
                "samples_per_s": None if r.samples_per_s is None else round(r.samples_per_s, 3),
                "padding_frac": None if r.padding_frac is None else round(r.padding_frac, 4),
                "mfu": None if r.mfu is None else round(r.mfu, 5),
                "peak_mib": None if r.peak is None else round(r.peak / MiB, 1),
                "planned_mib": None if r.planned is None else round(r.planned / MiB, 1),
                "measured_over_planned": round(r.peak / r.planned, 3) if r.peak and r.planned else None,
                "measured_steps": r.steps,
                "runs_tokens_per_s": " ".join(f"{rate:.1f}" for rate in r.runs) if len(r.runs) > 1 else None,
                "step_spread": None if r.step_spread is None else round(r.step_spread, 3),
                "others_cpu": None if r.others_cpu is None else round(r.others_cpu, 3),
                "wall_s": r.wall_s,
                "rank_cpu_s": r.cpu_s,
                "first_loss": r.losses[0] if r.losses else None,
                "overrides": " ".join(r.candidate.overrides(global_batch)),
                "note": r.note,
            }
        )
    return rows


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row[k] is None else row[k] for k in CSV_COLUMNS})
    write_text_atomic(path, buffer.getvalue())


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["candidate", "status", "real tokens/s", "samples/s", "padding", "MFU", "peak MiB", "planned MiB"]
    header += ["measured/planned", "note"]
    keys = [
        "candidate",
        "status",
        "tokens_per_s",
        "samples_per_s",
        "padding_frac",
        "mfu",
        "peak_mib",
        "planned_mib",
        "measured_over_planned",
        "note",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    shares = {"padding_frac": ".1%", "mfu": ".2%"}  # fractions in the CSV, percentages here
    for row in rows:
        cells = [
            "-" if row[k] is None or row[k] == "" else format(row[k], shares[k]) if k in shares else str(row[k])
            for k in keys
        ]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


@dataclass
class Tuning:
    """One tuning: its inputs and everything it decided."""

    directory: Path
    base: list[str]  # the job's overrides, as candidates' command lines carry them
    global_batch: int
    world_size: int
    budget: int  # bytes per rank
    budget_source: str
    results: list[Result] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    wall_s: float | None = None
    best_check: str = ""
    device_kind: str = "cpu"
    cpu_s: float | None = None  # the tuner's own CPU time and its candidates' ranks'
    space_line: str = ""  # what the space holds, as the tuner announces it
    # The job's own overrides of what candidates leave out but its best.yaml keeps (logger=, preflight=).
    best_extra: list[str] = field(default_factory=list)
    # What candidates train beside the job's overrides: with train.stages, the stage that needs the most
    # memory, alone (launcher.model.stats.heaviest_stage): a short run of the schedule would train the first.
    trial_overrides: list[str] = field(default_factory=list)

    def command_line(self, result: Result) -> str:
        """The pick's command line as printed and written (tune.md): a credential's value redacted."""
        words = [*self.base, *result.candidate.overrides(self.global_batch)]
        return " ".join(["python train.py", *(redact_override(word) for word in words)])


def report(t: Tuning) -> str:
    """tune.md."""
    best = pick(t.results)
    counts = {status: sum(r.status == status for r in t.results) for status in STATUS_ORDER}
    rows = table_rows(t.results, t.global_batch)
    job = " ".join(redact_override(override) for override in t.base)  # a credential's value left out
    lines = [
        "# Autotuning",
        "",
        f"job: `python train.py {job or '(the defaults)'}`; {t.world_size} rank(s), global batch {t.global_batch}",
        f"budget: {t.budget / MiB:.0f} MiB per rank ({t.budget_source})",
        f"candidates: {len(t.results)} ("
        + ", ".join(f"{n} {status}" for status, n in counts.items() if n)
        + f"); tuning took {t.wall_s or 0:.0f} s ({t.cpu_s or 0:.0f} CPU s: the tuner and the candidates' ranks)",
    ]
    lines += [f"left out: {line}" for line in t.left_out]
    lines.append("")
    if best is None:
        lines.append("**No candidate fits the budget**: raise tune.memory_gb, add ranks, or widen the space.")
    else:
        lines += [
            f"**Pick: {best.name}**: {best.tokens_per_s:.0f} real tokens/s ({best.samples_per_s:.2f} samples/s"
            + (f", {best.padding_frac:.1%} padding" if best.padding_frac is not None else "")
            + f"), peak {best.peak / MiB:.0f} MiB per rank",
            "",
            f"    {t.command_line(best)}",
            f"    python train.py hydra.searchpath=[file://{t.directory.resolve()}] experiment=best",
            "",
            f"best.yaml: {t.best_check}" if t.best_check else "",
        ]
    lines += ["", "## Candidates (fastest first)", "", markdown_table(rows), ""]
    noise = noise_lines(t.results)
    if noise:
        lines += ["## Noise", "", *(f"- {line}" for line in noise), ""]
    lines += ["## The planner, checked", "", *planner_lines(t.results), ""]
    lines += [
        "## How",
        "",
        "Throughput: real (non-padding) tokens over the time of the measured steps (after the warm-up ones); "
        "the pick is the fastest by it (samples/s favours short records, and a packed row holds several). "
        "Padding: the share of the tokens computed that were padding; MFU: model FLOPs (the vision tower per "
        "patch, the language model per token) over the device's peak. "
        "Peak: the largest rank's peak (a CPU: resident set size, polled by the tuner, and rank 0's own maximum; "
        "a GPU: the rank's reported peak). Pruned: predicted above the budget by more than tune.margin, or a "
        "smaller micro batch of the same configuration did not fit. Skipped: gradient checkpointing on, and the "
        "same candidate without it fits or lost to one that fits (checkpointing only adds recomputation). "
        "Dominated: stopped once a measured candidate "
        "was faster by more than tune.skip_margin while using no more memory than this one already had. "
        "Wrong: first losses differ from the reference candidate's (same precision and micro batch). "
        "Confirmation: the tune.confirm_top fastest that fit (and as many more measured on a busy machine) run "
        "tune.confirm_runs times more, in turn, and each is the median of its runs; where a run of another reached "
        "the fastest one's median and it is a simpler configuration (no offload, lower ZeRO stage, no "
        "checkpointing, torch's kernels), it is the pick. Others' CPU: the share of the machine other processes "
        "used before a run (sampled 0.5 s) or during it; a run that found more than 20% is never stopped as "
        "dominated and is named under Noise. tune.png: throughput against peak memory; the Pareto front joined.",
        "",
    ]
    return "\n".join(lines)


def describe(result: Result) -> str:
    figures = ""
    if result.tokens_per_s:
        figures = f" {result.tokens_per_s:.0f} real tokens/s ({result.samples_per_s or 0:.2f} samples/s"
        figures += f", {result.padding_frac:.1%} padding)" if result.padding_frac is not None else ")"
        figures += f" over {result.steps} steps"
        if len(result.runs) > 1:
            figures += f", median of {len(result.runs)} runs ({min(result.runs):.0f}-{max(result.runs):.0f})"
        elif result.step_spread is not None:
            figures += f" (steps within {result.step_spread:.0%})"
        figures += ","
    peak = f" peak {result.peak / MiB:.0f} MiB" if result.peak else ""
    planned = f" (planned {result.planned / MiB:.0f})" if result.planned else ""
    note = f"; {result.note}" if result.note else ""
    return f"{result.name}: {result.status}:{figures}{peak}{planned} [{result.wall_s or 0:.0f} s]{note}"


def best_yaml(t: Tuning, result: Result) -> str:
    """An experiment file that reproduces the pick: the job's overrides and the candidate's."""
    groups = {path.name for path in CONF_DIR.iterdir() if path.is_dir()}  # model, deepspeed, data, ...
    group_choices, values = [], {}
    # A credential is read from the environment (launcher.core.credentials.recorded_override names the variable).
    for override in [*map(recorded_override, [*t.base, *t.best_extra]), *result.candidate.overrides(t.global_batch)]:
        key, _, value = override.partition("=")
        plain_key = key.lstrip("+")
        if plain_key in groups:  # model=..., deepspeed=...: a choice in the defaults list
            group_choices.append((plain_key, value))
        else:  # a value: train.lr=..., deepspeed_json=...
            values[plain_key] = value
    lines = [
        "# @package _global_",
        f"# Picked by python -m launcher.tune ({time.strftime('%Y-%m-%d %H:%M')}): {result.name}, "
        f"{result.tokens_per_s:.0f} real tokens/s, peak {result.peak / MiB:.0f} MiB per rank.",
        f"#   python train.py hydra.searchpath=[file://{t.directory.resolve()}] experiment=best",
    ]
    if group_choices:
        lines.append("defaults:")
        lines += [f"  - override /{group}: {choice}" for group, choice in group_choices]
    body = _nested(values)
    from omegaconf import OmegaConf

    lines.append(OmegaConf.to_yaml(OmegaConf.create(body)).rstrip())
    return "\n".join(lines) + "\n"


def _nested(dotted: Mapping[str, str]) -> dict[str, Any]:
    """{"train.lr": "3e-4"} -> {"train": {"lr": 3e-4}}, values parsed as the command line would."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    tree: dict[str, Any] = {}
    for key, value in dotted.items():
        parsed = parser.parse_override(f"{key}={value}").value()
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = parsed
    return tree


def write_plot(t: Tuning, path: Path) -> None:
    """tune.png: real tokens/s against peak memory per rank; the Pareto front joined; the budget and the pick."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), layout="constrained")
    ax = fig.add_subplot()
    styles = {"fits": ("o", "C0"), "wrong": ("x", "C3"), "dominated": ("s", "C7"), "does not fit": ("v", "C1")}
    for status, (marker, color) in styles.items():
        points = [r for r in t.results if r.status == status and r.tokens_per_s and r.peak]
        if points:
            ax.scatter(
                [r.peak / MiB for r in points],
                [r.tokens_per_s for r in points],
                marker=marker,
                color=color,
                label=status,
            )
            for r in points:
                ax.annotate(
                    r.name, (r.peak / MiB, r.tokens_per_s), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    front = pareto_front(t.results)
    if front:
        ax.plot([r.peak / MiB for r in front], [r.tokens_per_s for r in front], "-", color="C2", label="Pareto front")
    best = pick(t.results)
    if best is not None:
        ax.scatter(
            [best.peak / MiB],
            [best.tokens_per_s],
            s=250,
            facecolors="none",
            edgecolors="C2",
            label=f"pick: {best.name}",
        )
    ax.axvline(t.budget / MiB, color="C1", linestyle="--", label=f"budget {t.budget / MiB:.0f} MiB")
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.set_ylabel("real (non-padding) tokens/s")
    ax.set_title(f"autotuning: {len(t.results)} candidates, global batch {t.global_batch}, {t.world_size} rank(s)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def write_outputs(t: Tuning) -> None:
    """tune.md, tune.csv, tune.png, results.json, and best.yaml for the pick (rewritten as results come in)."""
    t.directory.mkdir(parents=True, exist_ok=True)
    write_csv(table_rows(t.results, t.global_batch), t.directory / "tune.csv")
    results = [{**r.__dict__, "candidate": r.candidate.__dict__, "name": r.name} for r in t.results]
    write_text_atomic(t.directory / "results.json", json.dumps(results, indent=1, default=str))
    best = pick(t.results)
    totals = {"wall_s": t.wall_s, "cpu_s": t.cpu_s, "budget_bytes": t.budget, "global_batch": t.global_batch,
              "world_size": t.world_size, "pick": best.name if best else None, "best_check": t.best_check}  # fmt: skip
    write_text_atomic(t.directory / "tuning.json", json.dumps(totals, indent=1))
    if best is not None:
        (t.directory / "experiment").mkdir(exist_ok=True)
        write_text_atomic(t.directory / "experiment" / "best.yaml", best_yaml(t, best))
        link = t.directory / "best.yaml"
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(Path("experiment") / "best.yaml")
    write_text_atomic(t.directory / "tune.md", report(t))
