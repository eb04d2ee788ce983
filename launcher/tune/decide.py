"""What the tuner decides from what it has planned and measured (pure): predictions, pruning, skipping,
dominance, the loss check, the Pareto front and the pick; and what the measurements say of the planner."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from launcher.tune.space import Candidate

MiB = 2**20
GiB = 2**30


# ================================================================================ results
@dataclass
class Result:
    """What is known of one candidate: the plan, then the measurement."""

    candidate: Candidate
    planned: int | None = None  # bytes per rank, the planner's estimate
    components: dict[str, int] = field(default_factory=dict)  # the planned bytes by component
    status: str = "not run"  # fits | does not fit | pruned | skipped | dominated | failed | wrong | not run
    note: str = ""  # why: the error line, the prediction, the dominating candidate, the loss gap
    samples_per_s: float | None = None  # records/s (a packed row counts its records)
    tokens_per_s: float | None = None  # real (non-padding) tokens/s: what candidates are compared by
    padding_frac: float | None = None  # the measured steps' padding share of the tokens computed
    mfu: float | None = None  # model FLOPs utilisation (launcher.model.flops against the device's peak)
    peak: int | None = None  # bytes, the largest rank's peak
    losses: list[float] = field(default_factory=list)  # train/loss of steps 1, 2, ...
    steps: int = 0  # measured steps behind the throughput
    wall_s: float | None = None
    cpu_s: float | None = None  # CPU time of its ranks
    run_dir: str | None = None
    ds_config: dict[str, Any] | None = None
    # Real tokens/s of each run, the first and the confirmation runs (tokens_per_s: their median).
    runs: list[float] = field(default_factory=list)
    step_spread: float | None = None  # (max - min) / median of the measured steps' real tokens/s, first run
    others_cpu: float | None = None  # the largest share of the machine's CPUs other processes used before a run

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
        if twin.checkpointing or twin.twin_key != candidate.twin_key:
            continue
        if other.status in ("fits", "dominated"):
            how = "fits" if other.status == "fits" else "lost to a faster candidate that fits"
            return f"{other.name} (no gradient checkpointing) {how}; checkpointing only adds recomputation"
    return None


def dominating(tokens_per_s: float, peak_so_far: int, results: Sequence[Result], margin: float) -> Result | None:
    """A measured candidate faster (real tokens/s) by more than `margin` that used no more memory than
    this one has already used: a peak only grows, so this one can never beat it on either."""
    better = [
        r
        for r in results
        if r.status == "fits"
        and r.tokens_per_s is not None
        and r.peak is not None
        and r.tokens_per_s > tokens_per_s * (1 + margin)
        and r.peak <= peak_so_far
    ]
    return max(better, key=lambda r: r.tokens_per_s) if better else None


def loss_mismatches(results: Sequence[Result], tolerance: float, low_precision_tolerance: float) -> dict[str, str]:
    """Candidates whose first losses differ from their reference's beyond the tolerance: name -> why.

    The reference is the first measured candidate with the same precision, micro batch size and batching
    (grouping by length and packing put other records in a step; the loss is the mean over a step's
    answer tokens, so a split alone changes only the order of its sums); the losses compared are the
    steps both measured, up to 3.
    """
    references: dict[tuple[str, int, str | None, int | None], Result] = {}
    wrong = {}
    for result in results:
        if not result.measured or not result.losses:
            continue
        c = result.candidate
        key = (c.precision, c.micro, c.batching, c.pack_length)
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


# ================================================================================ noise
BUSY = 0.2  # other processes using more than this share of the CPUs make a measurement suspect


def step_spread(step_rates: Sequence[float]) -> float | None:
    """(max - min) / median of the measured steps' real tokens/s: how much one run's steps disagree."""
    rates = [rate for rate in step_rates if rate > 0]
    if len(rates) < 2:
        return None
    return (max(rates) - min(rates)) / statistics.median(rates)


def contenders(results: Sequence[Result], top: int) -> list[Result]:
    """What a confirmation round measures again, fastest first: the `top` fastest candidates that fit, and up to
    `top` more measured while other processes loaded the machine, that fit or were stopped as dominated (their
    one figure may hide the fastest: a burst during its run)."""
    pool = sorted((r for r in results if r.status == "fits" and r.tokens_per_s), key=lambda r: -(r.tokens_per_s or 0.0))
    busy = [r for r in results if (r.others_cpu or 0.0) > BUSY and r.status in ("fits", "dominated")]
    fastest_ids = {id(r) for r in pool[:top]}
    suspect = [r for r in sorted(busy, key=lambda r: -(r.tokens_per_s or 0.0)) if id(r) not in fastest_ids][:top]
    chosen = [*pool[:top], *suspect]
    return sorted(chosen, key=lambda r: -(r.tokens_per_s or 0.0))


def merge_rerun(result: Result, rerun: Result) -> None:
    """Fold a confirmation run into its candidate: real tokens/s becomes the median of the runs (samples/s
    scaled alike: the same records in the same order), the peak the larger. A rerun that did not fit or
    failed makes the candidate that: a pick that fits only sometimes is no pick."""
    if rerun.others_cpu is not None:
        result.others_cpu = max(result.others_cpu or 0.0, rerun.others_cpu)
    if result.status == "dominated":  # stopped while others loaded the machine: this run is its first whole one
        result.status, result.note = (
            rerun.status,
            (
                f"measured again: its first run, stopped as dominated, met other processes' load; {rerun.note}".rstrip(
                    "; "
                )
            ),
        )
        result.runs = [rerun.tokens_per_s] if rerun.status == "fits" and rerun.tokens_per_s else []
        result.tokens_per_s, result.samples_per_s, result.steps = rerun.tokens_per_s, rerun.samples_per_s, rerun.steps
        result.padding_frac, result.mfu, result.step_spread = rerun.padding_frac, rerun.mfu, rerun.step_spread
        result.peak = max(result.peak or 0, rerun.peak or 0) or None
        return
    if rerun.status != "fits" or not rerun.tokens_per_s or not result.tokens_per_s:
        result.status, result.note = rerun.status, f"in confirmation run {len(result.runs) + 1}: {rerun.note}"
        result.peak = max(result.peak or 0, rerun.peak or 0) or None
        return
    first = result.runs[0] if result.runs else result.tokens_per_s
    result.runs = [*(result.runs or [first]), rerun.tokens_per_s]
    median = statistics.median(result.runs)
    if result.samples_per_s is not None:
        result.samples_per_s *= median / result.tokens_per_s
    result.tokens_per_s = median
    result.peak = max(result.peak or 0, rerun.peak or 0) or None


def noise_lines(results: Sequence[Result]) -> list[str]:
    """What the runs say about the measurements' noise: the confirmed candidates' runs, whether the pick
    stands clear of the next, and candidates measured while the machine was busy."""
    lines = []
    confirmed = [r for r in results if len(r.runs) > 1]
    for r in sorted(confirmed, key=lambda r: -(r.tokens_per_s or 0.0)):
        runs = ", ".join(f"{rate:.0f}" for rate in r.runs)
        lines.append(f"{r.name}: {len(r.runs)} runs, real tokens/s {runs}; median {r.tokens_per_s:.0f}")
    best, tied, chosen = fastest(results), within_noise(results), pick(results)
    rivals = [r for r in confirmed if r is not best and r.status == "fits"]
    if best is not None and len(best.runs) > 1 and rivals and not tied:
        rival = max(rivals, key=lambda r: r.tokens_per_s or 0.0)
        if min(best.runs) > max(rival.runs):
            lines.append(f"the pick is clear: every run of {best.name} beat every run of {rival.name}")
        else:
            lines.append(
                f"the pick stands: no run of {rival.name} (the next) reached {best.name}'s median "
                f"({statistics.median(best.runs):.0f}); a slower run of the pick met other load"
            )
    elif best is not None and tied and chosen is not None:  # the runs cannot tell them apart
        names = ", ".join(r.name for r in tied)
        how = (
            f"picked {chosen.name}, the simplest configuration among them (no offload, a lower ZeRO stage, no "
            "checkpointing, torch's kernels come first)"
            if chosen is not best
            else f"kept {best.name}, no simpler configuration among them"
        )
        lines.append(
            f"the fastest, {best.name}, is within the noise of {names} (a run of theirs reached its median): "
            f"{how}; a quieter machine or more tune.confirm_runs can tell them apart"
        )
    busy = [r for r in results if r.others_cpu is not None and r.others_cpu > BUSY]
    if busy:
        worst = max(busy, key=lambda r: r.others_cpu or 0.0)
        lines.append(
            f"the machine was busy: other processes used up to {worst.others_cpu:.0%} of its CPUs before "
            f"{len(busy)} candidate run(s) ({worst.name}'s); their figures are suspect: tune on a quiet machine"
        )
    return lines


def pareto_front(results: Sequence[Result]) -> list[Result]:
    """The measured fitting candidates no other beats on both speed (real tokens/s) and memory, by memory."""
    pool = [r for r in results if r.status == "fits" and r.tokens_per_s and r.peak]
    front = [
        r
        for r in pool
        if not any(
            o is not r
            and o.tokens_per_s >= r.tokens_per_s
            and o.peak <= r.peak
            and (o.tokens_per_s > r.tokens_per_s or o.peak < r.peak)
            for o in pool
        )
    ]
    return sorted(front, key=lambda r: r.peak)


def fastest(results: Sequence[Result]) -> Result | None:
    """The fastest candidate that fits, by real (non-padding) tokens/s: records/s would favour short
    records, and a packed row holds several; less memory breaks a tie."""
    pool = [r for r in results if r.status == "fits" and r.tokens_per_s]
    return max(pool, key=lambda r: (r.tokens_per_s, -(r.peak or 0))) if pool else None


def within_noise(results: Sequence[Result]) -> list[Result]:
    """The confirmed candidates the runs cannot tell from the fastest: some run of theirs reached its median
    (one slow run of the fastest, in a burst of other work, does not make everyone its equal). Empty when
    nothing was confirmed."""
    best = fastest(results)
    if best is None or len(best.runs) < 2:
        return []
    typical = statistics.median(best.runs)
    return [r for r in results if r is not best and r.status == "fits" and len(r.runs) > 1 and max(r.runs) >= typical]


def simplicity(result: Result) -> tuple[bool, int, bool, bool]:
    """Simpler first: no offload, a lower ZeRO stage, no gradient checkpointing, torch's kernels (what a
    configuration runs, not its batch size)."""
    preset = result.candidate.preset
    stage = int(preset[1]) if preset[:1] == "z" and preset[1:2].isdigit() else 9
    liger = result.candidate.kernels == "liger"
    return ("offload" in preset or "nvme" in preset, stage, result.candidate.checkpointing, liger)


def pick(results: Sequence[Result]) -> Result | None:
    """The fastest candidate that fits (`fastest`); where confirmation runs cannot tell it from others
    (`within_noise`) and one of them is a simpler configuration (`simplicity`), the simplest (the fastest of
    those equally simple): no speed is given up that the runs can show."""
    best = fastest(results)
    tied = within_noise(results)
    if best is None or not tied:
        return best
    simplest = min(simplicity(r) for r in [best, *tied])
    if simplicity(best) == simplest:
        return best
    return max((r for r in tied if simplicity(r) == simplest), key=lambda r: r.tokens_per_s or 0.0)


def ordered(results: Sequence[Result]) -> list[Result]:
    """By status (fits first), then by speed (real tokens/s)."""
    return sorted(results, key=lambda r: (STATUS_ORDER.index(r.status), -(r.tokens_per_s or 0.0)))


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
