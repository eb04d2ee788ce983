"""Autotuner: measure the configurations that may fit, pick the fastest that does, show the trade-off.

    python -m launcher.tune model.hidden_size=512 dist.nproc_per_node=2 tune.memory_gb=1.2
    python -m launcher.tune tune.presets=[z0,z2,z3] tune.micro_batch_sizes=[4,8,16] tune.precisions=[fp32]
    python -m launcher.tune ... tune.prune=false tune.early_skip=false   # exhaustive: measure every candidate

Takes train.py's overrides (the job to tune) and `tune.*` (the search, docs/tune.md). The space is
ZeRO preset (stage and offload) x precision x micro batch size (gradient accumulation adjusted so
the global batch stays the job's) x gradient checkpointing (x attention implementation, when
`tune.attn_implementations` lists several). Each candidate is planned first; one predicted above
the memory budget by more than `tune.margin` is pruned. The rest run one at a time, each as
`python train.py OVERRIDES CANDIDATE` in a child process (same data order, same seed) for
`tune.warmup_steps` + `tune.measure_steps` steps, and are stopped once measured. A rank above the
budget (a CPU: its resident set size, polled; a GPU: CUDA out of memory too) ends its candidate as
"does not fit"; a crash is recorded with its one-line error; first losses that differ from the
reference candidate's mark it "wrong". The tune directory gets tune.md/tune.csv (sorted by speed),
tune.png (throughput against peak memory, Pareto front marked), experiment/best.yaml (with
best.yaml beside it) for `python train.py hydra.searchpath=[file://TUNE_DIR] experiment=best`,
and, with logger=wandb, one W&B run per candidate in one group plus a report run with a Table.

Why a program of its own rather than `train.py -m +experiment=autotune`: a Hydra sweep launches a
fixed list of jobs, while the tuner decides what to run from what it has measured (pruning with
calibrated predictions, stopping dominated candidates) and owns its children's memory budget.

The decisions (space, prediction, pruning, dominance, loss check, Pareto front, pick, reports) are
pure functions below; running children, polling their memory and logging are at the end.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.core import credentials
from launcher.core.errors import Interrupted, LauncherError, one_line
from launcher.core.rundir import RunDir, Summary
from launcher.job.spec import CUDA_MEMORY_CAP_ENV, override_key

MiB = 2**20
GiB = 2**30
ROOT = Path(__file__).resolve().parents[2]  # where train.py is
# The overrides a candidate sets; the user's own values of these are replaced (with the keys of
# launcher.job.variant_overrides: deepspeed, zero, offload, precision).
_CANDIDATE_KEYS = (
    "train.micro_batch_size",
    "train.grad_accum",
    "train.global_batch_size",
    "model.gradient_checkpointing",
    "model.vision_gradient_checkpointing",
)
# Overrides of the tuner itself, or of one job only, which a candidate's command line leaves out.
_TUNER_ONLY = ("tune", "hydra", "dry_run", "resume", "preflight", "logger")
# Test hook: "NAME:KEY=VALUE" adds KEY=VALUE to the environment of candidate NAME only (tests force a
# crash or a memory overrun on one candidate with launcher.recipe's fault hook).
CANDIDATE_ENV = "LAUNCHER_TEST_TUNE_ENV"


# ================================================================================ the space
@dataclass(frozen=True)
class Candidate:
    """One configuration: what `python train.py OVERRIDES CANDIDATE` changes."""

    preset: str
    precision: str
    micro: int
    accum: int
    checkpointing: bool
    attention: str | None = None  # None: the job's own model.attn_implementation

    @property
    def name(self) -> str:
        parts = [self.preset, self.precision, f"mb{self.micro}"]
        if self.checkpointing:
            parts.append("gc")
        if self.attention:
            parts.append(self.attention)
        return "-".join(parts)

    @property
    def group(self) -> tuple[str, str, bool, str | None]:
        """Candidates that differ only in micro batch size (memory grows with it)."""
        return (self.preset, self.precision, self.checkpointing, self.attention)

    def overrides(self, global_batch: int) -> list[str]:
        flag = "true" if self.checkpointing else "false"
        line = [
            f"deepspeed={self.preset}",
            f"precision={self.precision}",
            f"train.micro_batch_size={self.micro}",
            "train.grad_accum=null",
            f"train.global_batch_size={global_batch}",
            f"model.gradient_checkpointing={flag}",
            f"model.vision_gradient_checkpointing={flag}",
        ]
        if self.attention:
            line.append(f"model.attn_implementation={self.attention}")
        return line


def base_overrides(overrides: Sequence[str], *, tunes_attention: bool) -> list[str]:
    """The job's overrides without those a candidate sets or only the tuner reads."""
    from launcher.job.spec import VARIANT_KEYS

    replaced = (*VARIANT_KEYS, *_CANDIDATE_KEYS, *(("model.attn_implementation",) if tunes_attention else ()))
    kept = []
    for override in overrides:
        key = override_key(override)
        if key in replaced or key.split(".", 1)[0] in _TUNER_ONLY:
            continue
        kept.append(override)
    return kept


def search_space(
    presets: Sequence[str],
    precisions: Sequence[str],
    micro_batch_sizes: Sequence[int],
    checkpointing: Sequence[bool],
    attentions: Sequence[str | None],
    *,
    global_batch: int,
    world_size: int,
) -> tuple[list[Candidate], list[str]]:
    """Every combination, in the order they run (presets as given, fastest-first by convention; in a
    group, micro batch sizes ascending, so a group's first candidate calibrates the predictions for
    the larger ones); and a line per micro batch size left out because it cannot keep the global batch."""
    per_rank = global_batch // world_size
    micros, left_out = [], []
    for micro in sorted(set(micro_batch_sizes)):
        if micro < 1 or global_batch % (micro * world_size):
            left_out.append(
                f"micro batch {micro}: the global batch {global_batch} is no multiple of micro batch x "
                f"{world_size} rank(s)"
            )
        elif micro <= per_rank:
            micros.append(micro)
        else:
            left_out.append(f"micro batch {micro}: above the global batch per rank ({per_rank})")
    candidates = [
        Candidate(preset, precision, micro, global_batch // (micro * world_size), gc, attention)
        for preset in presets
        for precision in precisions
        for gc in checkpointing
        for attention in attentions
        for micro in micros
    ]
    return candidates, left_out


def default_micro_batch_sizes(micro: int) -> list[int]:
    return sorted({max(1, micro // 2), micro, micro * 2})


# ================================================================================ results
@dataclass
class Result:
    """What is known of one candidate: the plan, then the measurement."""

    candidate: Candidate
    planned: int | None = None  # bytes per rank, the planner's estimate
    components: dict[str, int] = field(default_factory=dict)  # the planned bytes by component
    status: str = "not run"  # fits | does not fit | pruned | skipped | dominated | failed | wrong | not run
    note: str = ""  # why: the error line, the prediction, the dominating candidate, the loss gap
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    peak: int | None = None  # bytes, the largest rank's peak
    losses: list[float] = field(default_factory=list)  # train/loss of steps 1, 2, ...
    steps: int = 0  # measured steps behind the throughput
    wall_s: float | None = None
    cpu_s: float | None = None  # CPU time of its ranks
    run_dir: str | None = None
    ds_config: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.candidate.name

    @property
    def measured(self) -> bool:
        """Ran to the end of its measurement: its peak and speed are the run's, not a bound."""
        return self.status in ("fits", "wrong")


STATUS_ORDER = ("fits", "wrong", "dominated", "does not fit", "failed", "skipped", "pruned", "not run")


def predict(candidate: Candidate, planned: int, results: Iterable[Result]) -> tuple[int, str]:
    """The peak a candidate should reach, from the plan calibrated by what was measured.

    A measured candidate of the same group (only the micro batch differs): its peak plus the planned
    difference, so whatever the planner leaves out (the runtime's own memory, a stage's overheads)
    cancels. Else the median of (measured - planned) over all measured candidates added to the plan.
    Else the plan alone (which, leaving the runtime's memory out, predicts low: it prunes nothing wrongly)."""
    measured = [r for r in results if r.measured and r.peak is not None and r.planned is not None]
    same_group = [r for r in measured if r.candidate.group == candidate.group]
    if same_group:
        ref = min(same_group, key=lambda r: abs(r.candidate.micro - candidate.micro))
        return ref.peak + planned - ref.planned, f"{ref.name} measured {ref.peak / MiB:.0f} MiB + planned difference"
    if measured:
        offset = statistics.median(r.peak - r.planned for r in measured)
        return int(planned + offset), f"plan + {offset / MiB:.0f} MiB measured offset ({len(measured)} candidates)"
    return planned, "plan alone"


def prune_reason(
    candidate: Candidate, planned: int | None, results: Sequence[Result], budget: int, margin: float
) -> str | None:
    """Why a candidate need not run (predicted above the budget), or None."""
    for other in results:
        same_group = other.candidate.group == candidate.group
        if other.status == "does not fit" and same_group and other.candidate.micro <= candidate.micro:
            return f"{other.name} (a smaller micro batch) did not fit"
    if planned is None:
        return None
    predicted, basis = predict(candidate, planned, results)
    if predicted > budget * (1 + margin):
        over = f"budget {budget / MiB:.0f} MiB x (1 + tune.margin={margin:g})"
        return f"predicted {predicted / MiB:.0f} MiB ({basis}) > {over}"
    return None


def skip_reason(candidate: Candidate, results: Sequence[Result]) -> str | None:
    """Why a candidate with gradient checkpointing cannot be the pick, so need not run, or None.

    Checkpointing recomputes each layer's forward during the backward: the same work as its twin
    without it (same preset, precision, micro batch, attention), plus that recomputation, for less
    memory. So when the twin fits, or lost to a faster candidate that fits, this one cannot be the
    fastest that fits; it is worth measuring only where the twin did not fit or was not measured."""
    if not candidate.checkpointing:
        return None
    for other in results:
        twin = other.candidate
        if twin.checkpointing or (twin.preset, twin.precision, twin.micro, twin.attention) != (
            candidate.preset,
            candidate.precision,
            candidate.micro,
            candidate.attention,
        ):
            continue
        if other.status in ("fits", "dominated"):
            how = "fits" if other.status == "fits" else "lost to a faster candidate that fits"
            return f"{other.name} (no gradient checkpointing) {how}; checkpointing only adds recomputation"
    return None


def dominating(samples_per_s: float, peak_so_far: int, results: Sequence[Result], margin: float) -> Result | None:
    """A measured candidate faster by more than `margin` that used no more memory than this one has
    already used: a peak only grows, so this one can never beat it on either."""
    better = [
        r
        for r in results
        if r.status == "fits"
        and r.samples_per_s is not None
        and r.peak is not None
        and r.samples_per_s > samples_per_s * (1 + margin)
        and r.peak <= peak_so_far
    ]
    return max(better, key=lambda r: r.samples_per_s) if better else None


def loss_mismatches(results: Sequence[Result], tolerance: float, low_precision_tolerance: float) -> dict[str, str]:
    """Candidates whose first losses differ from their reference's beyond the tolerance: name -> why.

    The reference is the first measured candidate with the same precision and micro batch size (the
    loss averages per micro batch, so another micro batch size may legitimately differ when records'
    lengths vary); the losses compared are the steps both measured, up to 3."""
    references: dict[tuple[str, int], Result] = {}
    wrong = {}
    for result in results:
        if not result.measured or not result.losses:
            continue
        key = (result.candidate.precision, result.candidate.micro)
        ref = references.setdefault(key, result)
        if ref is result:
            continue
        tol = tolerance if result.candidate.precision == "fp32" else low_precision_tolerance
        for step, (mine, theirs) in enumerate(zip(result.losses[:3], ref.losses[:3], strict=False), start=1):
            gap = abs(mine - theirs) / max(abs(theirs), 1e-12)
            if not math.isfinite(mine) or gap > tol:
                wrong[result.name] = (
                    f"loss at step {step} {mine:.6g} vs {theirs:.6g} of {ref.name} ({gap:.1e} relative > {tol:g})"
                )
                break
    return wrong


def pareto_front(results: Sequence[Result]) -> list[Result]:
    """The measured fitting candidates no other beats on both speed and memory, by memory."""
    pool = [r for r in results if r.status == "fits" and r.samples_per_s and r.peak]
    front = [
        r
        for r in pool
        if not any(
            o is not r
            and o.samples_per_s >= r.samples_per_s
            and o.peak <= r.peak
            and (o.samples_per_s > r.samples_per_s or o.peak < r.peak)
            for o in pool
        )
    ]
    return sorted(front, key=lambda r: r.peak)


def pick(results: Sequence[Result]) -> Result | None:
    """The fastest candidate that fits (less memory breaks a tie)."""
    pool = [r for r in results if r.status == "fits" and r.samples_per_s]
    return max(pool, key=lambda r: (r.samples_per_s, -(r.peak or 0))) if pool else None


def ordered(results: Sequence[Result]) -> list[Result]:
    """By status (fits first), then by speed."""
    return sorted(results, key=lambda r: (STATUS_ORDER.index(r.status), -(r.samples_per_s or 0.0)))


# ================================================================================ the planner, checked
COMPONENTS = ("model states", "activations", "step+buffers")


# The components fitted apart, or, when the measured candidates vary them together (e.g. model states
# and step buffers both change only with the preset), merged: the first grouping the data can tell apart.
GROUPINGS = (
    (("model states",), ("activations",), ("step+buffers",)),
    (("model states", "step+buffers"), ("activations",)),
    (("model states", "activations", "step+buffers"),),
)


def planner_fit(results: Sequence[Result]) -> tuple[dict[str, float], float] | None:
    """measured peak ~ baseline + sum of ratio x planned component, least squares over the measured
    candidates: (ratio per component, or per merged components "a + b", baseline bytes); None when
    even the total cannot be told from the baseline (fewer than 3 candidates, or one planned total)."""
    import numpy as np

    rows = [r for r in results if r.measured and r.peak is not None and r.components]
    target = np.array([r.peak for r in rows], dtype=float) / MiB
    for grouping in GROUPINGS:
        if len(rows) < len(grouping) + 2:  # at least one candidate more than unknowns
            continue
        design = np.array(
            [[*(sum(r.components[c] for c in group) / MiB for group in grouping), 1.0] for r in rows], dtype=float
        )
        if np.linalg.matrix_rank(design) < design.shape[1]:
            continue
        solution, *_ = np.linalg.lstsq(design, target, rcond=None)
        names = [" + ".join(group) for group in grouping]
        return dict(zip(names, (float(x) for x in solution[:-1]), strict=True)), float(solution[-1]) * MiB
    return None


def planner_lines(results: Sequence[Result]) -> list[str]:
    """What the measurements say about the planner: per component, and where it was off by > 10 %."""
    lines = []
    fit = planner_fit(results)
    if fit is None:
        lines.append(
            "measured/planned per component: not separable from these candidates (fewer than 3 measured, or "
            "all planned alike); per candidate below"
        )
    else:
        ratios, baseline = fit
        parts = [
            f"{name} x{ratio:.2f}" + (" (off > 10%)" if abs(ratio - 1) > 0.1 else "") for name, ratio in ratios.items()
        ]
        lines.append(
            f"measured/planned per component (least squares over the measured candidates): {', '.join(parts)}; "
            f"plus {baseline / MiB:.0f} MiB the planner does not model (the runtime: libraries, CUDA context, "
            "allocator)"
        )
    # Per candidate: against the plan plus the runtime's own memory where the fit measured it.
    baseline = fit[1] if fit is not None else 0.0
    against = "planned + the runtime's memory above" if fit is not None else "planned"
    off = [r for r in results if r.measured and r.peak and r.planned and abs(r.peak / (r.planned + baseline) - 1) > 0.1]
    if off:
        listed = ", ".join(f"{r.name} x{r.peak / (r.planned + baseline):.2f}" for r in off)
        lines.append(f"planner off by more than 10% (measured / {against}): {listed}")
    elif any(r.measured for r in results):
        lines.append(f"every measured peak is within 10% of {against}")
    return lines


# ================================================================================ reports
CSV_COLUMNS = (
    "candidate",
    "status",
    "fits",
    "samples_per_s",
    "tokens_per_s",
    "peak_mib",
    "planned_mib",
    "measured_over_planned",
    "measured_steps",
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
                "samples_per_s": None if r.samples_per_s is None else round(r.samples_per_s, 3),
                "tokens_per_s": None if r.tokens_per_s is None else round(r.tokens_per_s, 1),
                "peak_mib": None if r.peak is None else round(r.peak / MiB, 1),
                "planned_mib": None if r.planned is None else round(r.planned / MiB, 1),
                "measured_over_planned": round(r.peak / r.planned, 3) if r.peak and r.planned else None,
                "measured_steps": r.steps,
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
    _write_atomic(path, buffer.getvalue())


def markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    header = ["candidate", "status", "samples/s", "tokens/s", "peak MiB", "planned MiB", "measured/planned", "note"]
    keys = [
        "candidate",
        "status",
        "samples_per_s",
        "tokens_per_s",
        "peak_mib",
        "planned_mib",
        "measured_over_planned",
        "note",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = ["-" if row[k] is None or row[k] == "" else str(row[k]).replace("|", "\\|") for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
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

    def command_line(self, result: Result) -> str:
        return " ".join(["python train.py", *self.base, *result.candidate.overrides(self.global_batch)])


def report(t: Tuning) -> str:
    """tune.md."""
    best = pick(t.results)
    counts = {status: sum(r.status == status for r in t.results) for status in STATUS_ORDER}
    rows = table_rows(t.results, t.global_batch)
    lines = [
        "# Autotuning",
        "",
        f"job: `python train.py {' '.join(t.base) or '(the defaults)'}`; {t.world_size} rank(s), global batch "
        f"{t.global_batch}",
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
            f"**Pick: {best.name}**: {best.samples_per_s:.2f} samples/s, "
            + (f"{best.tokens_per_s:.0f} tokens/s, " if best.tokens_per_s else "")
            + f"peak {best.peak / MiB:.0f} MiB per rank",
            "",
            f"    {t.command_line(best)}",
            f"    python train.py hydra.searchpath=[file://{t.directory.resolve()}] experiment=best",
            "",
            f"best.yaml: {t.best_check}" if t.best_check else "",
        ]
    lines += ["", "## Candidates (fastest first)", "", markdown_table(rows), ""]
    lines += ["## The planner, checked", "", *planner_lines(t.results), ""]
    lines += [
        "## How",
        "",
        "Throughput: the global batch over the mean step time of the measured steps (after the warm-up ones). "
        "Peak: the largest rank's peak (a CPU: resident set size, polled by the tuner, and rank 0's own maximum; "
        "a GPU: the rank's reported peak). Pruned: predicted above the budget by more than tune.margin, or a "
        "smaller micro batch of the same configuration did not fit. Skipped: gradient checkpointing on, and the "
        "same candidate without it fits or lost to one that fits (checkpointing only adds recomputation). "
        "Dominated: stopped once a measured candidate "
        "was faster by more than tune.skip_margin while using no more memory than this one already had. "
        "Wrong: first losses differ from the reference candidate's (same precision and micro batch). "
        "tune.png: throughput against peak memory; the Pareto front joined.",
        "",
    ]
    return "\n".join(lines)


def best_yaml(t: Tuning, result: Result) -> str:
    """An experiment file that reproduces the pick: the job's overrides and the candidate's."""
    from launcher.job.resume import CONF_DIR

    groups = {path.name for path in CONF_DIR.iterdir() if path.is_dir()}  # model, deepspeed, data, ...
    group_choices, values = [], {}
    for override in [*t.base, *result.candidate.overrides(t.global_batch)]:
        key, _, value = override.partition("=")
        plain_key = key.lstrip("+")
        if plain_key in groups:  # model=..., deepspeed=...: a choice in the defaults list
            group_choices.append((plain_key, value))
        else:  # a value: train.lr=..., deepspeed_json=...
            values[plain_key] = value
    lines = [
        "# @package _global_",
        f"# Picked by python -m launcher.tune ({time.strftime('%Y-%m-%d %H:%M')}): {result.name}, "
        f"{result.samples_per_s:.2f} samples/s, peak {result.peak / MiB:.0f} MiB per rank.",
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
    """tune.png: samples/s against peak memory per rank; the Pareto front joined; the budget and the pick."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6), layout="constrained")
    ax = fig.add_subplot()
    styles = {"fits": ("o", "C0"), "wrong": ("x", "C3"), "dominated": ("s", "C7"), "does not fit": ("v", "C1")}
    for status, (marker, color) in styles.items():
        points = [r for r in t.results if r.status == status and r.samples_per_s and r.peak]
        if points:
            ax.scatter(
                [r.peak / MiB for r in points],
                [r.samples_per_s for r in points],
                marker=marker,
                color=color,
                label=status,
            )
            for r in points:
                ax.annotate(
                    r.name, (r.peak / MiB, r.samples_per_s), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
    front = pareto_front(t.results)
    if front:
        ax.plot([r.peak / MiB for r in front], [r.samples_per_s for r in front], "-", color="C2", label="Pareto front")
    best = pick(t.results)
    if best is not None:
        ax.scatter(
            [best.peak / MiB],
            [best.samples_per_s],
            s=250,
            facecolors="none",
            edgecolors="C2",
            label=f"pick: {best.name}",
        )
    ax.axvline(t.budget / MiB, color="C1", linestyle="--", label=f"budget {t.budget / MiB:.0f} MiB")
    ax.set_xlabel("peak memory per rank (MiB)")
    ax.set_ylabel("samples/s")
    ax.set_title(f"autotuning: {len(t.results)} candidates, global batch {t.global_batch}, {t.world_size} rank(s)")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(t: Tuning) -> None:
    """tune.md, tune.csv, tune.png, results.json, and best.yaml for the pick (rewritten as results come in)."""
    t.directory.mkdir(parents=True, exist_ok=True)
    write_csv(table_rows(t.results, t.global_batch), t.directory / "tune.csv")
    results = [{**r.__dict__, "candidate": r.candidate.__dict__, "name": r.name} for r in t.results]
    _write_atomic(t.directory / "results.json", json.dumps(results, indent=1, default=str))
    best = pick(t.results)
    totals = {"wall_s": t.wall_s, "cpu_s": t.cpu_s, "budget_bytes": t.budget, "global_batch": t.global_batch,
              "world_size": t.world_size, "pick": best.name if best else None, "best_check": t.best_check}  # fmt: skip
    _write_atomic(t.directory / "tuning.json", json.dumps(totals, indent=1))
    if best is not None:
        (t.directory / "experiment").mkdir(exist_ok=True)
        _write_atomic(t.directory / "experiment" / "best.yaml", best_yaml(t, best))
        link = t.directory / "best.yaml"
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(Path("experiment") / "best.yaml")
    _write_atomic(t.directory / "tune.md", report(t))


# ================================================================================ running a candidate
@dataclass
class Watch:
    """What the tuner has seen of a running candidate."""

    rank_peaks: dict[int, int] = field(default_factory=dict)  # pid -> peak RSS
    rank_cpu: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds (user + system) so far
    records: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows

    @property
    def peak(self) -> int:
        reported = max((int(r.get("mem/peak_bytes") or 0) for r in self.records), default=0)
        return max([reported, *self.rank_peaks.values()])


def rank_processes(root_pid: int) -> list[Any]:
    """The ranks under a train.py process: `launcher.worker` processes whose parent is no rank
    (a rank's DataLoader workers are its forks, sharing its pages)."""
    import psutil

    try:
        tree = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return []
    workers = {}
    for proc in tree:
        try:
            if _runs_module(proc.cmdline(), "launcher.launch.worker"):
                workers[proc.pid] = proc
        except psutil.Error:
            continue
    ranks = []
    for proc in workers.values():
        try:
            if proc.ppid() not in workers:
                ranks.append(proc)
        except psutil.Error:
            continue
    return ranks


def _runs_module(cmdline: Sequence[str], module: str) -> bool:
    """Whether a command line runs `python ... -m MODULE` (torchrun's own `-m launcher.torchrun ...
    -m launcher.worker` runs launcher.torchrun: its first -m decides)."""
    for index, arg in enumerate(cmdline[:-1]):
        if arg == "-m":
            return cmdline[index + 1] == module
    return False


def kill_ranks(root_pid: int) -> None:
    """SIGKILL the ranks and whatever they started: train.py survives them, cleans up and exits."""
    import psutil

    for rank in rank_processes(root_pid):
        try:
            family = [rank, *rank.children(recursive=True)]
        except psutil.Error:
            family = [rank]
        for proc in family:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)


def measure(records: Sequence[Mapping[str, Any]], warmup: int, global_batch: int) -> tuple[float, float, int] | None:
    """(samples/s, tokens/s, steps) over the steps after the warm-up ones; None before any."""
    measured = [r for r in records if int(r["step"]) > warmup and r.get("perf/step_time_s")]
    if not measured:
        return None
    seconds = sum(float(r["perf/step_time_s"]) for r in measured)
    tokens = sum(float(r.get("perf/tokens_per_sec") or 0) * float(r["perf/step_time_s"]) for r in measured)
    return global_batch * len(measured) / seconds, tokens / seconds, len(measured)


def _read_new_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]
    records = [json.loads(line) for line in complete.splitlines() if line.strip() and b'"step"' in line]
    return records, offset + len(complete)


def _error_line(output: str) -> str:
    """A job's one-line error from its output (train.py prints `error: ...`), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors[-1].removeprefix("error:").strip() if errors else lines[-1] if lines else "no output")[:500]


def _candidate_env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    hook = os.environ.get(CANDIDATE_ENV, "")
    for item in filter(None, hook.split(";")):
        who, _, assignment = item.partition(":")
        if who == name:
            key, _, value = assignment.partition("=")
            env[key] = value
    env.pop(CANDIDATE_ENV, None)
    return env


@contextlib.contextmanager
def _output_to(log_file: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (and its children's) to a file for a while."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with log_file.open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def run_candidate(t: Tuning, result: Result, tune_cfg: Any) -> None:
    """Run one candidate as train.py would, watch its memory and steps, stop it once measured.

    The job runs in this process (`launcher.entry.run_job`, the code behind train.py, which starts
    the ranks as child processes): the tuner pays the launcher's imports once, not per candidate.
    A watcher thread polls the ranks' memory and metrics.jsonl and ends the ranks (SIGKILL) once the
    candidate is measured, over the budget, dominated or too slow. Sets the result's status, figures
    and note."""
    from omegaconf import OmegaConf

    from launcher.job.spec import HydraJob
    from launcher.launch.run import run_job
    from launcher.plan.report import compose

    candidate = result.candidate
    run_dir = t.directory / "runs" / candidate.name
    log_file = t.directory / "logs" / f"{candidate.name}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    warmup, steps = int(tune_cfg.warmup_steps), int(tune_cfg.measure_steps)
    overrides = [
        *t.base,
        *candidate.overrides(t.global_batch),
        # One step more than measured: the last step of a run evaluates before it records its metrics,
        # and the candidate is stopped as soon as the last measured step is recorded.
        f"train.max_steps={warmup + steps + 1}",
        "train.eval_every=0",
        "train.save_every=0",
        "data.eval_accuracy=false",
        "logger=none",
        "preflight=off",
    ]
    cfg = compose(overrides)
    # What Hydra writes before a job starts: the ranks read the config from it.
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    choices = {"deepspeed": candidate.preset, "precision": candidate.precision}
    job = HydraJob(run_dir=run_dir, overrides=tuple(overrides), choices=choices, multirun=True, group="tune")
    result.run_dir = str(run_dir)

    started = time.time()
    watch = Watch()
    done = threading.Event()
    decided: list[tuple[str, str]] = []  # (status, note) when the tuner ended the candidate

    def watcher() -> None:
        offset = 0
        while not done.wait(0.05):
            # A CPU's memory is the ranks' resident set; a GPU's, what each rank reports per step.
            for proc in rank_processes(os.getpid()):
                try:
                    rss, cpu = proc.memory_info().rss, proc.cpu_times()
                except Exception:
                    continue
                watch.rank_cpu[proc.pid] = cpu.user + cpu.system
                if t.device_kind == "cpu":
                    watch.rank_peaks[proc.pid] = max(rss, watch.rank_peaks.get(proc.pid, 0))
            new, offset = _read_new_records(run_dir / "metrics.jsonl", offset)
            watch.records += new
            if decided:
                kill_ranks(os.getpid())  # again: a rank may have been starting the first time
                continue
            verdict = _verdict(t, watch, new, started, tune_cfg)
            if verdict is not None:
                decided.append(verdict)
                kill_ranks(os.getpid())

    thread = threading.Thread(target=watcher, name=f"tune-{candidate.name}", daemon=True)
    thread.start()
    env_before = dict(os.environ)
    os.environ.update(_candidate_env(candidate.name))
    if t.device_kind == "cuda":  # the allocator stops at the budget: exceeding it is a real CUDA OOM
        os.environ[CUDA_MEMORY_CAP_ENV] = f"{t.budget / GiB:.3f}"
    try:
        with _output_to(log_file):
            run_job(cfg, job)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
        done.set()
        thread.join()
    new, _ = _read_new_records(run_dir / "metrics.jsonl", 0)
    watch.records = new
    result.wall_s = round(time.time() - started, 1)
    result.cpu_s = round(sum(watch.rank_cpu.values()), 1)  # the ranks' (sampled every 50 ms)
    by_step = sorted(watch.records, key=lambda r: r["step"])
    result.losses = [float(r["train/loss"]) for r in by_step if "train/loss" in r]
    result.peak = watch.peak or None
    figures = measure(watch.records, warmup, t.global_batch)
    if figures is not None:
        result.samples_per_s, result.tokens_per_s, result.steps = figures
    summary = RunDir(run_dir).read_summary() or Summary(status="failed")
    stopped_from_outside = summary.status in ("interrupted", "preempted") or any(
        sign in str(summary.error) for sign in ("killed by SIGTERM", "killed by SIGINT", "KeyboardInterrupt")
    )
    if stopped_from_outside and not decided:  # Ctrl-C or a scheduler's SIGTERM: the tuning stops too
        raise Interrupted(f"tune: stopped during {candidate.name}; the results so far are in {t.directory}")
    if decided:
        result.status, result.note = decided[0]
    elif len(watch.records) >= warmup + steps:  # measured, then ended by the tuner
        result.status = "fits"
    else:
        error = summary.error or _error_line(log_file.read_text(errors="replace"))
        out_of_memory = "out of memory" in error.lower() or "can't allocate memory" in error.lower()
        result.status, result.note = ("does not fit" if out_of_memory else "failed"), error[:500]


def _verdict(t: Tuning, watch: Watch, new: list[dict[str, Any]], started: float, tc: Any) -> tuple[str, str] | None:
    """Whether to end a running candidate now, and as what."""
    warmup, steps = int(tc.warmup_steps), int(tc.measure_steps)
    if watch.peak > t.budget:
        return (
            "does not fit",
            f"a rank reached {watch.peak / MiB:.0f} MiB > budget {t.budget / MiB:.0f} MiB "
            f"in step {len(watch.records) + 1}",
        )
    if len(watch.records) >= warmup + steps:
        return ("fits", "")
    if time.time() - started > float(tc.candidate_timeout_s):
        return ("failed", f"did not finish within tune.candidate_timeout_s={tc.candidate_timeout_s:g} s")
    if new and tc.early_skip:
        so_far = measure(watch.records, warmup, t.global_batch)
        if so_far is not None:
            # One measured step is noisier than two: it must lose by twice the margin.
            margin = float(tc.skip_margin) * (2 if so_far[2] == 1 else 1)
            better = dominating(so_far[0], watch.peak, t.results, margin)
            if better is not None:
                return (
                    "dominated",
                    f"{better.name} is faster ({better.samples_per_s:.2f} > {so_far[0]:.2f} samples/s after "
                    f"{so_far[2]} steps) with no more memory",
                )
    return None


# ================================================================================ the whole tuning
_STATS: dict[str, Any] = {}


def planned_memory(candidate_cfg: Any, spec: Any, target: Any) -> tuple[int, dict[str, int]]:
    """The planner's bytes per rank for a candidate's job, and its components (on a CPU the offloaded
    states share the rank's memory: they count)."""
    from launcher.job.spec import plain
    from launcher.model.stats import model_stats, sequence
    from launcher.plan.memory import estimate, layout_from_ds_config

    key = json.dumps([plain(candidate_cfg.model), plain(candidate_cfg.method)], sort_keys=True, default=str)
    if key not in _STATS:  # building the meta model takes a moment; candidates share a few
        _STATS[key] = model_stats(candidate_cfg)
    stats = _STATS[key]
    seq_len, images = sequence(candidate_cfg, stats)
    layout = layout_from_ds_config(spec.ds_config, world_size=spec.world_size, ranks_per_node=spec.ranks_per_node)
    est = estimate(stats, layout, seq_len=seq_len, images=images)
    states = est.states.on_device
    if target.kind == "cpu":
        states += est.cpu_per_node // layout.ranks_per_node
    components = {"model states": states, "activations": est.activations, "step+buffers": est.step + est.buffers}
    return sum(components.values()), components


def tune(overrides: Sequence[str], *, echo: Callable[[str], None] = print) -> Tuning:
    """Plan, prune, measure and report; returns the tuning (its pick: `pick(t.results)`)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from launcher.job.spec import HydraJob, plan_job, world_size_of
    from launcher.plan.memory import PRESETS
    from launcher.plan.report import compose, target_device

    cfg = compose(overrides)
    tc = cfg.tune
    for key in ("warmup_steps", "measure_steps"):
        if int(tc[key]) < (0 if key == "warmup_steps" else 1):
            raise LauncherError(f"tune.{key}={tc[key]} must be {'0 or more' if key == 'warmup_steps' else '1 or more'}")
    for key in ("margin", "skip_margin", "loss_tolerance", "low_precision_loss_tolerance", "candidate_timeout_s"):
        if not float(tc[key]) > 0 and not (key == "margin" and float(tc[key]) == 0):
            raise LauncherError(f"tune.{key}={tc[key]} must be positive" + (" (or 0)" if key == "margin" else ""))
    if tc.memory_gb is not None and tc.memory_gb <= 0:
        raise LauncherError(f"tune.memory_gb={tc.memory_gb} must be positive (GiB per rank), or null for the planner's")
    tunes_attention = bool(tc.attn_implementations)
    base = base_overrides(overrides, tunes_attention=tunes_attention)
    # The job as given (its own batch sizes) sets the global batch every candidate keeps.
    spec = plan_job(cfg, HydraJob(run_dir=Path("."), overrides=tuple(overrides)), validate=False)
    world_size = world_size_of(cfg)
    global_batch = int(spec.ds_config["train_batch_size"])
    target = target_device(cfg.plan)
    presets = [str(p) for p in (tc.presets or [p for p in PRESETS if p != "z3_nvme"])]
    precisions = [str(p) for p in (tc.precisions or target.precisions)]
    if "fp16" in precisions and target.kind == "cpu":
        precisions.remove("fp16")  # refused on a CPU (train.py says so); not a candidate
    micros = [
        int(m)
        for m in (tc.micro_batch_sizes or default_micro_batch_sizes(spec.ds_config["train_micro_batch_size_per_gpu"]))
    ]
    attentions: list[str | None] = [str(a) for a in tc.attn_implementations] if tunes_attention else [None]
    candidates, left_out = search_space(
        presets,
        precisions,
        micros,
        [bool(b) for b in tc.gradient_checkpointing],
        attentions,
        global_batch=global_batch,
        world_size=world_size,
    )
    if not candidates:
        raise LauncherError(
            f"tune: no candidate: {'; '.join(left_out) or 'an empty list in tune.*'}; give tune.micro_batch_sizes that "
            f"divide {global_batch // world_size} (the global batch {global_batch} over {world_size} rank(s))"
        )
    if tc.memory_gb is not None:
        budget, source = int(float(tc.memory_gb) * GiB), f"tune.memory_gb={tc.memory_gb:g}"
    else:
        per_rank = target.usable_device // (spec.ranks_per_node if target.kind == "cpu" else 1)
        budget, source = per_rank, f"the planner's usable memory ({target.source}, plan.headroom={target.headroom:g})"
    directory = Path(tc.dir or time.strftime("outputs/tune/%Y-%m-%d/%H-%M-%S")).expanduser()
    if (directory / "tune.md").exists():
        raise LauncherError(f"tune.dir={directory} already holds a tuning (tune.md): choose a new directory")
    t = Tuning(
        directory, base, global_batch, world_size, budget, source, left_out=left_out, device_kind=spec.device.kind
    )
    for candidate in candidates:
        result = Result(candidate)
        try:
            candidate_cfg = compose([*base, *candidate.overrides(global_batch)])
            candidate_spec = plan_job(candidate_cfg, HydraJob(run_dir=Path(".")), validate=False)
            result.planned, result.components = planned_memory(candidate_cfg, candidate_spec, target)
            # The dict of the job itself (train.max_steps as given, not the measurement's few steps):
            # what best.yaml must reproduce. As train.py writes it: credentials left out, JSON types.
            result.ds_config = json.loads(json.dumps(credentials.split(candidate_spec.ds_config)[0]))
        except (LauncherError, HydraException, OmegaConfBaseException) as err:
            result.status, result.note = "failed", one_line(err)  # e.g. a preset this method refuses
        t.results.append(result)
    echo(
        f"tune: {len(candidates)} candidates ({len(presets)} presets x {len(precisions)} precisions x "
        f"{len(set(c.micro for c in candidates))} micro batch sizes x {len(tc.gradient_checkpointing)} checkpointing"
        + (f" x {len(attentions)} attention" if tunes_attention else "")
        + f"), global batch {global_batch} on {world_size} rank(s); budget {budget / MiB:.0f} MiB per rank ({source}); "
        f"writing {directory}"
    )
    write_outputs(t)
    for index, result in enumerate(t.results, start=1):
        if result.status != "not run":
            echo(f"[{index}/{len(t.results)}] {result.name}: {result.status}: {result.note}")
            continue
        reason = (
            prune_reason(result.candidate, result.planned, t.results, budget, float(tc.margin)) if tc.prune else None
        )
        status = "pruned"
        if reason is None and tc.early_skip:
            reason, status = skip_reason(result.candidate, t.results), "skipped"
        if reason is not None:
            result.status, result.note = status, reason
            echo(f"[{index}/{len(t.results)}] {result.name}: {status}: {reason}")
            write_outputs(t)
            continue
        run_candidate(t, result, tc)
        wrong = loss_mismatches(t.results, float(tc.loss_tolerance), float(tc.low_precision_loss_tolerance))
        if result.name in wrong and result.status == "fits":
            result.status, result.note = "wrong", wrong[result.name]
        echo(f"[{index}/{len(t.results)}] {describe(result)}")
        write_outputs(t)
    t.wall_s = round(time.time() - t.started, 1)
    t.cpu_s = round(sum(r.cpu_s or 0 for r in t.results) + _own_cpu_s(), 1)
    best = pick(t.results)
    if best is not None:
        write_outputs(t)
        t.best_check = check_best(t, best)
    write_outputs(t)
    return t


def _own_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def describe(result: Result) -> str:
    figures = ""
    if result.samples_per_s:
        figures = f" {result.samples_per_s:.2f} samples/s over {result.steps} steps,"
    peak = f" peak {result.peak / MiB:.0f} MiB" if result.peak else ""
    planned = f" (planned {result.planned / MiB:.0f})" if result.planned else ""
    note = f"; {result.note}" if result.note else ""
    return f"{result.name}: {result.status}:{figures}{peak}{planned} [{result.wall_s or 0:.0f} s]{note}"


def check_best(t: Tuning, best: Result) -> str:
    """Compose best.yaml as train.py would (a dry run) and compare its DeepSpeed dict with the candidate's."""
    check_dir = t.directory / "best_check"
    command = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.searchpath=[file://{t.directory.resolve()}]",
        "experiment=best",
        "dry_run=true",
        f"hydra.run.dir={check_dir}",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    try:
        produced = json.loads((check_dir / "ds_config.json").read_text())
    except (OSError, ValueError):
        return f"NOT verified: the dry run of best.yaml failed ({_error_line(done.stderr)})"
    if best.ds_config is None:
        return "not verified: the candidate's ds_config.json is missing"
    if produced == best.ds_config:
        return "verified: a dry run of best.yaml writes the candidate's ds_config.json exactly"
    differing = sorted(k for k in set(produced) | set(best.ds_config) if produced.get(k) != best.ds_config.get(k))
    return f"NOT verified: its ds_config.json differs from the candidate's in {', '.join(differing)}"


# ================================================================================ W&B
def log_to_wandb(t: Tuning, overrides: Sequence[str]) -> str | None:
    """One W&B run per candidate that ran, in one group, and a report run with the Table and the
    picture; the report run's directory, or None when W&B is off."""
    from launcher.plan.report import compose
    from launcher.tracking.wandb_run import WandbRun, has_credentials, resolve_mode

    cfg = compose(overrides)
    if cfg.logger.name == "none" or not cfg.logger.get("enabled", True):
        return None
    # W&B prints a block per run; the tuner prints where the runs are instead.
    os.environ.setdefault("WANDB_SILENT", "true")
    mode = resolve_mode(str(cfg.logger.get("mode") or "auto"), os.environ, has_credentials())
    if mode == "disabled":
        return None
    project = str(cfg.logger.get("project") or "vlm-ds-launcher")
    group = f"tune-{t.directory.parent.name}-{t.directory.name}"
    wandb_dir = t.directory / "wandb_runs"
    for result in t.results:
        if result.status in ("pruned", "skipped", "not run"):
            continue
        run = WandbRun.start(
            wandb_dir / result.name,
            project=project,
            entity=cfg.logger.get("entity"),
            mode=mode,
            group=group,
            name=result.name,
            tags=["tune", result.status.replace(" ", "_")],
            config={
                "candidate": result.candidate.__dict__,
                "overrides": result.candidate.overrides(t.global_batch),
                "ds_config": result.ds_config or {},
            },
        )
        summary = {k: v for k, v in table_rows([result], t.global_batch)[0].items() if v is not None}
        run.finish(summary, hint=False)
    run = WandbRun.start(
        wandb_dir / "report",
        project=project,
        entity=cfg.logger.get("entity"),
        mode=mode,
        group=group,
        name="tune-report",
        tags=["tune", "report"],
        config={"budget_mib": t.budget / MiB, "global_batch": t.global_batch, "world_size": t.world_size},
    )
    rows = table_rows(t.results, t.global_batch)
    run.log_table("tune/candidates", list(CSV_COLUMNS), [[row[c] for c in CSV_COLUMNS] for row in rows])
    if (t.directory / "tune.png").exists():
        run.log_image("tune/throughput_vs_memory", t.directory / "tune.png")
    best = pick(t.results)
    run.finish(
        {"pick": best.name if best else None, "pick_samples_per_s": best.samples_per_s if best else None}, hint=False
    )
    if mode == "offline":
        return f"{wandb_dir} (offline; upload with `wandb sync {wandb_dir}/*/wandb/offline-run-*`)"
    return str(wandb_dir)


# ================================================================================ command line
def main(argv: Sequence[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        t = tune(overrides)
        write_plot(t, t.directory / "tune.png")  # tune() wrote the tables and best.yaml already
        wandb_dir = log_to_wandb(t, overrides)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except LauncherError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    best = pick(t.results)
    for line in planner_lines(t.results):
        print(f"planner: {line}")
    print(f"tune: {t.directory / 'tune.md'} ({t.wall_s:.0f} s)" + (f"; W&B: {wandb_dir}" if wandb_dir else ""))
    if best is None:
        print(
            f"error: no candidate fits the budget of {t.budget / MiB:.0f} MiB per rank ({t.budget_source}): raise "
            f"tune.memory_gb, add ranks or widen the space; see {t.directory / 'tune.md'}",
            file=sys.stderr,
        )
        return 1
    print(f"pick: {describe(best)}")
    print(f"  {t.command_line(best)}")
    print(f"  best.yaml {t.best_check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
