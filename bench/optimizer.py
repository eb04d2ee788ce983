"""torch's fused AdamW (what train.py uses when nothing is offloaded) against DeepSpeed's compiled fused_adam.

    .venv/bin/python bench/optimizer.py --steps 150 --skip 20 --repeats 6

Both contenders are `python train.py` on the built-in job (tiny_llava on `shapes`, ZeRO stage 0, fp32,
micro batch 32, no W&B, no periodic eval), in fresh processes, interleaved A B B A ...:
  A  the composition's optimizer block: `"torch_adam": true, "fused": true` (no op to compile);
  B  the same job with a DeepSpeed JSON base whose optimizer block is plain AdamW ("auto" params, which
     the composition fills): DeepSpeed's FusedAdam, JIT-compiled once into the benchmark's op cache.
Per run, over steps skip+1..steps: the mean `perf/step_time_s` (wall) and the CPU seconds of the
whole process (its own and its children's, from getrusage) per measured step, the latter being less
moved by other load on the machine. Prints the median of each and the ratio A / B as the median of
the ratios of neighbouring runs, with a 95% interval (a t-interval on the log ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
from _common import interleaved_order, measured, run_train_py

# DeepSpeed's own AdamW: an optimizer block taken whole from the base (launcher.config.ds_config.ATOMIC_BLOCKS).
DEEPSPEED_ADAM = {"optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}}}
# Two-sided 97.5% quantiles of Student's t for small samples (df 1..10).
T975 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23]


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def one_run(run_dir: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    before = children_cpu_seconds()
    run = run_train_py(run_dir, args.steps, [*args.overrides, *extra])
    run["cpu_s"] = children_cpu_seconds() - before
    return run


def figures(run: dict[str, Any], skip: int, steps: int) -> dict[str, float]:
    times = run["step_times"][skip:]
    return {
        "step_s": statistics.fmean(times),
        # Whole-process CPU (start-up included, the same for both) spread over the measured steps.
        "cpu_per_step_s": run["cpu_s"] / (steps - skip),
        "final_loss": run["loss"][-1],
    }


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Median ratio and a 95% t-interval of the geometric mean ratio."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return statistics.median(ratios), math.nan, math.nan
    half = T975[min(len(logs) - 2, len(T975) - 1)] * statistics.stdev(logs) / math.sqrt(len(logs))
    return statistics.median(ratios), math.exp(mean - half), math.exp(mean + half)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--max-foreign-cpu", type=float, default=0.10)
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for both")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-optimizer-") as tmp:
        work = Path(tmp)
        base = work / "deepspeed_adam.json"
        base.write_text(json.dumps(DEEPSPEED_ADAM))
        extra = {"A": [], "B": [f"deepspeed_json={base}"]}
        results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for index, contender in enumerate(interleaved_order(args.repeats)):
            run = measured(lambda c=contender, i=index: one_run(work / f"{c}{i}", args, extra[c]), args.max_foreign_cpu)
            results[contender].append(figures(run, args.skip, args.steps))
            print(f"  {contender}: {results[contender][-1]}", file=sys.stderr)
    a, b = results["A"], results["B"]
    print("| figure | torch fused AdamW (A) | DeepSpeed fused_adam (B) | A / B, median of pairs [95% interval] |")
    print("|---|---|---|---|")
    for key, label in (("step_s", "step time, wall (ms)"), ("cpu_per_step_s", "CPU per step (ms)")):
        median_a = statistics.median(r[key] for r in a) * 1000
        median_b = statistics.median(r[key] for r in b) * 1000
        ratio, low, high = interval([x[key] / y[key] for x, y in zip(a, b, strict=True)])
        print(f"| {label} | {median_a:.1f} | {median_b:.1f} | {ratio:.3f} [{low:.3f}, {high:.3f}] |")
    same = all(x["final_loss"] == y["final_loss"] for x, y in zip(a, b, strict=True))
    print(f"\nfinal losses identical in every pair: {same} (A {a[0]['final_loss']:.6f}, B {b[0]['final_loss']:.6f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
