"""Preference training (loss=dpo): the reference precomputed against a live frozen copy, side by side.

    .venv/bin/python bench/preference.py --repeats 3 --steps 12
    .venv/bin/python bench/preference.py --repeats 3 --steps 12 method=lora --variants precomputed adapter

Each variant trains the built-in preference task (data.task=colour, pairs: the right colour chosen over a
wrong one) on a built-in model made large enough that a second copy shows in the process's memory
(MODEL below: ~41M parameters), from the same start, in fresh processes alternating A B B A ... (so run i
of each ran next to the other). Per run: the median step time and CPU time per step (`perf/step_cpu_s`,
every thread of the rank) over the steps after --skip, the process's peak resident memory
(summary.json `peak_memory_bytes`), the parameters the reference holds (a live copy's; 0 otherwise) and,
for a precomputed reference, how long its pass took where the run computed it (the first run; later ones
read it). The ratio B / A is the geometric mean over neighbouring pairs with a 95% Student-t interval.
Both variants must give the same losses: the largest difference is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _common as common

# A built-in tiny LLaVA made wider: ~41M parameters, 155 MiB in fp32, so that a second copy is visible.
MODEL = ["model.hidden_size=768", "model.num_layers=4", "model.vision_hidden_size=256"]
JOB = ["loss=dpo", "data.task=colour", "data.n_train=2048", "data.n_eval=64", "train.micro_batch_size=8"]
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def run(work: Path, name: str, index: int, steps: int, overrides: list[str], limit: float) -> dict[str, Any]:
    run_dir = work / f"{name}_{index}"
    extra = [*JOB, *MODEL, f"loss.reference={name}", *overrides]
    return common.measured(lambda: common.run_train_py(run_dir, steps, extra), limit)


def summarise(runs: list[dict[str, Any]], skip: int) -> list[dict[str, float]]:
    rows = []
    for one in runs:
        reference = one["summary"].get("reference") or {}
        rows.append(
            {
                "step_s": statistics.median(one["step_times"][skip:]),
                "cpu_s": statistics.median(one["step_cpu"][skip:]),
                "peak_mib": one["peak_bytes"] / 2**20,
                "reference_params": float(reference.get("params_held", 0)),
                "reference_pass_s": float(reference.get("s") or math.nan),
            }
        )
    return rows


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean and 95% Student-t interval of ratios."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = T975[min(len(logs) - 2, len(T975) - 1)] * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=3, help="steps left out of the medians (warm-up)")
    parser.add_argument("--variants", nargs=2, default=["precomputed", "live"], metavar=("A", "B"))
    parser.add_argument("--max-foreign-cpu", type=float, default=0.10)
    parser.add_argument("overrides", nargs="*", help="train.py overrides for both variants")
    args = parser.parse_args()
    a_name, b_name = args.variants
    with tempfile.TemporaryDirectory(prefix="bench_preference_") as tmp:
        work = Path(tmp)
        found: dict[str, list[dict[str, Any]]] = {a_name: [], b_name: []}
        for index, contender in enumerate(common.interleaved_order(args.repeats)):
            name = a_name if contender == "A" else b_name
            one = run(work, name, len(found[name]), args.steps, args.overrides, args.max_foreign_cpu)
            found[name].append(one)
            step = statistics.median(one["step_times"][args.skip :])
            peak = one["peak_bytes"] / 2**20
            print(
                f"  {name}: step {step:.3f} s, peak {peak:.0f} MiB ({index + 1} of {2 * args.repeats})", file=sys.stderr
            )
        a_rows, b_rows = summarise(found[a_name], args.skip), summarise(found[b_name], args.skip)
        worst = max(
            abs(x - y)
            for ra, rb in zip(found[a_name], found[b_name], strict=True)
            for x, y in zip(ra["loss"], rb["loss"], strict=True)
        )
    print(f"| figure | {a_name} (median) | {b_name} (median) | {b_name} / {a_name} (95% interval) |")
    print("|---|---|---|---|")
    for key, label in (("step_s", "step time, s"), ("cpu_s", "CPU per step, s"), ("peak_mib", "peak memory, MiB")):
        ratios = [y[key] / x[key] for x, y in zip(a_rows, b_rows, strict=True)]
        mean, low, high = ratio_interval(ratios)
        a_median, b_median = statistics.median(r[key] for r in a_rows), statistics.median(r[key] for r in b_rows)
        print(f"| {label} | {a_median:.3f} | {b_median:.3f} | {mean:.3f} ({low:.3f}-{high:.3f}) |")
    for key, label in (("reference_params", "parameters the reference holds"),):
        print(f"| {label} | {a_rows[0][key]:,.0f} | {b_rows[0][key]:,.0f} | |")
    passes = [r["reference_pass_s"] for r in a_rows + b_rows if not math.isnan(r["reference_pass_s"])]
    print(f"\nprecomputed pass (where a run computed it): {passes} s; largest loss difference {worst:.2e}")
    print(json.dumps({"a": a_rows, "b": b_rows}), file=sys.stderr)


if __name__ == "__main__":
    main()
