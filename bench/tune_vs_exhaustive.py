"""The autotuner against an exhaustive sweep of the same space (issue 14's acceptance), on this machine.

    .venv/bin/python bench/tune_vs_exhaustive.py                      # hidden 512, 2 ranks, 1.0 GiB budget
    .venv/bin/python bench/tune_vs_exhaustive.py --memory-gb 1.1 --exhaustive-steps 39

Runs `python -m launcher.tune JOB SPACE` (pruning, early skip, warmup 1 + 4 measured steps), then the
same space with `tune.prune=false tune.early_skip=false tune.measure_steps=39` (every candidate, 1 + 39 = 40
steps: the length of the project's own sweeps, conf/experiment/zero_sweep.yaml), one after the
other, each timed (wall and CPU time of the whole command, children included). Then: the tuner's
pick, its throughput in the exhaustive sweep against the best candidate that fits there, and the
tuning's share of the exhaustive wall time. Writes outputs/bench/tune/{tuner,exhaustive}/ and
prints a Markdown summary for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = [
    "model.hidden_size=512",
    "model.num_layers=4",
    "dist.nproc_per_node=2",
    "train.micro_batch_size=8",
    "train.global_batch_size=32",
    "logger=none",
]
SPACE = [
    "tune.presets=[z0,z2,z3,z2_offload]",
    "tune.precisions=[fp32]",
    "tune.micro_batch_sizes=[4,8,16]",
    "tune.gradient_checkpointing=[false,true]",
]


def timed(command: list[str], directory: Path) -> tuple[float, float | None, int]:
    """(wall s of the whole command, CPU s, exit code). The CPU time is what the tuner records
    (tuning.json: its own, and its candidates' ranks', sampled every 50 ms): the ranks end by SIGKILL,
    so no rusage of the command's children holds theirs."""
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT)
    wall = time.perf_counter() - start
    cpu = json.loads((directory / "tuning.json").read_text()).get("cpu_s")
    return wall, cpu, done.returncode


def rows(directory: Path) -> dict[str, dict[str, str]]:
    with (directory / "tune.csv").open() as handle:
        return {row["candidate"]: row for row in csv.DictReader(handle)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-gb", type=float, default=1.0)
    parser.add_argument("--exhaustive-steps", type=int, default=39)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "tune")
    parser.add_argument(
        "--exhaustive-from",
        type=Path,
        help="compare with this earlier exhaustive sweep (its directory) instead of running one; its wall "
        "and CPU seconds are read from its timing.json",
    )
    args = parser.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tuner_dir, sweep_dir = args.out / f"{stamp}-tuner", args.exhaustive_from or args.out / f"{stamp}-exhaustive"
    common = [sys.executable, "-m", "launcher.tune", *JOB, *SPACE, f"tune.memory_gb={args.memory_gb}"]
    tuner = timed([*common, f"tune.dir={tuner_dir}"], tuner_dir)
    (tuner_dir / "timing.json").write_text(json.dumps(dict(zip(("wall_s", "cpu_s", "exit"), tuner, strict=True))))
    if args.exhaustive_from:
        timing = json.loads((sweep_dir / "timing.json").read_text())
        sweep = (timing["wall_s"], timing["cpu_s"], timing["exit"])
    else:
        sweep = timed(
            [
                *common,
                "tune.prune=false",
                "tune.early_skip=false",
                f"tune.measure_steps={args.exhaustive_steps}",
                f"tune.dir={sweep_dir}",
            ],
            sweep_dir,
        )
        (sweep_dir / "timing.json").write_text(json.dumps(dict(zip(("wall_s", "cpu_s", "exit"), sweep, strict=True))))
    tuned, exhaustive = rows(tuner_dir), rows(sweep_dir)
    fitting = {name: float(row["samples_per_s"]) for name, row in exhaustive.items() if row["status"] == "fits"}
    pick = next((name for name, row in tuned.items() if row["status"] == "fits"), None)  # tune.csv: fastest first
    best = max(fitting, key=fitting.get) if fitting else None
    print("\n## Autotuner against an exhaustive sweep\n")
    print(f"job: {' '.join(JOB)}; space: {' '.join(SPACE)}; tune.memory_gb={args.memory_gb}\n")
    print("| | wall s | CPU s | candidates run | exit |")
    print("|---|---|---|---|---|")
    for label, (wall, cpu, code), table in (("tuner", tuner, tuned), ("exhaustive", sweep, exhaustive)):
        ran = sum(row["status"] not in ("pruned", "skipped", "not run") for row in table.values())
        print(f"| {label} | {wall:.0f} | {'-' if cpu is None else f'{cpu:.0f}'} | {ran} of {len(table)} | {code} |")
    cpu_ratio = "n/a" if None in (tuner[1], sweep[1]) else f"{tuner[1] / sweep[1]:.3f}"
    print(f"\ntuning / exhaustive: wall {tuner[0] / sweep[0]:.3f}, CPU {cpu_ratio}")
    statuses = {status: sum(r["status"] == status for r in exhaustive.values()) for status in ("fits", "does not fit")}
    print(f"exhaustive: {statuses['fits']} fit, {statuses['does not fit']} do not fit the budget")
    if pick and best:
        in_sweep = fitting.get(pick)
        ratio = "n/a (did not fit there)" if in_sweep is None else f"{in_sweep / fitting[best]:.3f}"
        print(f"pick {pick}: {ratio} of the exhaustive best {best} ({fitting[best]:.2f} samples/s)")
        top = sorted(fitting.items(), key=lambda item: -item[1])[:5]
        print("exhaustive top 5: " + ", ".join(f"{name} {rate:.2f}" for name, rate in top))
    print(f"\ntuner: {tuner_dir}/tune.md; exhaustive: {sweep_dir}/tune.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
