"""Throughput and peak memory of the built-in job per DeepSpeed preset and precision, on this machine.

    .venv/bin/python bench/presets.py --steps 100 --skip 20
    .venv/bin/python bench/presets.py --presets z0 z3 --precisions bf16 --repeats 2

One fresh `python train.py deepspeed=PRESET precision=PRECISION` per cell (tiny_llava on `shapes`,
micro batch 32, no W&B, no periodic eval, no generation), presets x precisions in round-robin order,
`--repeats` rounds (medians over them). Per run, over steps skip+1..steps of metrics.jsonl:
  samples/s   micro batch / mean `perf/step_time_s` (what summary.json's figure is, after a longer warm-up);
  robust      micro batch / median `perf/step_time_s` (less moved by load from other processes);
  peak RSS    summary.json's `peak_memory_bytes` (the process's peak resident set size on a CPU). On a CPU
              "offload" moves states from CPU memory to CPU memory, so it cannot lower this figure.
Prints a Markdown table and draws throughput and peak-memory bars to bench/presets.png (--plot). Runs
wait for a quiet machine and are run again when other processes loaded it (as in overhead.py).
Optimizer offload needs DeepSpeed's cpu_adam op (JIT-built on first use, minutes; then cached).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
from _common import measured, run_train_py

PRESETS = ["z0", "z1", "z2", "z2_offload", "z3", "z3_offload"]
PRECISIONS = ["fp32", "bf16"]


def figures(run: dict[str, Any], skip: int) -> dict[str, Any]:
    summary = run["summary"]
    times = run["step_times"][skip:]
    micro = run["micro"]
    return {
        "samples_per_sec": micro / statistics.fmean(times),
        "robust_samples_per_sec": micro / statistics.median(times),
        "peak_mib": run["peak_bytes"] / 2**20,
        "wall_s": summary["wall_s"],
        "zero_stage": summary["zero_stage"],
        "offload": summary["offload"],
        "foreign_cpu": run["foreign_cpu"],
    }


def plot(rows: list[dict[str, Any]], presets: list[str], precisions: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(precisions)
    for offset, precision in enumerate(precisions):
        by_preset = {row["preset"]: row for row in rows if row["precision"] == precision}
        xs = [i + (offset - (len(precisions) - 1) / 2) * width for i in range(len(presets))]
        for axis, key in zip(axes, ("samples_per_sec", "peak_mib"), strict=True):
            values = [by_preset[p][key] if p in by_preset and by_preset[p].get(key) else 0 for p in presets]
            axis.bar(xs, values, width, label=precision)
    for axis, title in zip(axes, ("throughput (samples/s, higher is better)", "peak RSS (MiB)"), strict=True):
        axis.set_xticks(range(len(presets)), presets)
        axis.set_title(title)
    axes[0].legend(title="precision")  # the throughput bars fall to the right, leaving room there
    fig.suptitle("built-in job (tiny_llava, micro batch 32) per DeepSpeed preset, 2-core CPU")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out of the figures")
    parser.add_argument("--presets", nargs="+", default=PRESETS)
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS)
    parser.add_argument("--repeats", type=int, default=1, help="round-robin rounds (medians over them)")
    parser.add_argument("--plot", type=Path, default=Path(__file__).resolve().parent / "presets.png")
    parser.add_argument("--work-dir", type=Path, help="keep run directories here (default: a temporary one)")
    parser.add_argument(
        "--max-foreign-cpu",
        type=float,
        default=0.10,
        help="as in overhead.py: wait for, and re-run when, other processes use this share of the CPU (0: off)",
    )
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for every run")
    args = parser.parse_args()
    if args.skip < 0 or args.steps <= args.skip:
        parser.error("need 0 <= --skip < --steps")

    cells = [(preset, precision) for preset in args.presets for precision in args.precisions]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {cell: [] for cell in cells}
    errors: dict[tuple[str, str], str] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-presets-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for round_index in range(args.repeats):
            for preset, precision in cells:
                run_dir = work / f"{preset}-{precision}-{round_index}"
                overrides = [f"deepspeed={preset}", f"precision={precision}", *args.overrides]
                try:
                    run = measured(
                        lambda run_dir=run_dir, overrides=overrides: run_train_py(run_dir, args.steps, overrides),
                        args.max_foreign_cpu,
                    )
                except RuntimeError as error:
                    errors[(preset, precision)] = str(error).splitlines()[-1]
                    print(f"  {preset} {precision}: failed", file=sys.stderr)
                    continue
                run["micro"] = json.loads((run_dir / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"]
                results[(preset, precision)].append(figures(run, args.skip))
                print(
                    f"  {preset} {precision}: done at {time.perf_counter() - started:.0f} s, "
                    f"others used {run['foreign_cpu']:.0%} of the CPU",
                    file=sys.stderr,
                )
    wall = time.perf_counter() - started

    rows = []
    for preset, precision in cells:
        runs = results[(preset, precision)]
        row: dict[str, Any] = {"preset": preset, "precision": precision, "runs": len(runs)}
        if runs:
            row.update({key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "offload"})
            row["offload"] = runs[0]["offload"]
        rows.append(row)

    window = f"steps {args.skip + 1}-{args.steps}"
    print(f"\n{args.repeats} round(s), {window} of each run ({wall:.0f} s in all)\n")
    print(
        f"| preset | precision | samples/s ({window}) | robust samples/s | peak RSS MiB | run wall s | "
        "others' CPU share |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if not row["runs"]:
            error = errors.get((row["preset"], row["precision"]), "no run")
            print(f"| {row['preset']} | {row['precision']} | failed: {error} | | | | |")
            continue
        print(
            f"| {row['preset']} | {row['precision']} | {row['samples_per_sec']:.0f} | "
            f"{row['robust_samples_per_sec']:.0f} | {row['peak_mib']:.0f} | {row['wall_s']:.0f} | "
            f"{row['foreign_cpu']:.0%} |"
        )
    if args.plot:
        plot([row for row in rows if row["runs"]], args.presets, args.precisions, args.plot)
        print(f"\nPicture: {args.plot}")


if __name__ == "__main__":
    main()
