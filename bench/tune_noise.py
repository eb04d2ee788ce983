"""Does the tuner's pick survive a machine that other work loads in bursts? (issue 44 item 3)

    .venv/bin/python bench/tune_noise.py                # 2 trials each of: one run per candidate, and confirmed
    .venv/bin/python bench/tune_noise.py --trials 3 --burst-s 3

First a reference: the tuner on a quiet machine, every candidate measured (`tune.early_skip=false`), three
runs each for the fastest three; each candidate's quiet real tokens/s is that tuning's figure. Then, with
`--loaders` busy-loop processes switched on and off every `--burst-s` seconds for the whole tuning (the
load of a shared machine: a colleague's job, a compile), `--trials` tunings with one run per candidate
(`tune.confirm_runs=0`, the tuner before issue 44) and `--trials` with the confirmation round (the
default). Each pick is scored by its quiet throughput against the quiet best (1.00: the right pick).

The job: the built-in tiny model and data (the 0.3 M-parameter model of issue 44's report), fp32, 1 rank;
the space: z0, z2, z2_offload x micro batch 16, 32 (global batch 32), no checkpointing. Prints a Markdown
table for BENCHMARKS.md; the tunings are kept under outputs/bench/tune_noise/.
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ["train.micro_batch_size=16", "train.global_batch_size=32", "logger=none"]
SPACE = [
    "tune.presets=[z0,z2,z2_offload]",
    "tune.precisions=[fp32]",
    "tune.micro_batch_sizes=[16,32]",
    "tune.gradient_checkpointing=[false]",
]


def busy(stop_at: float) -> None:
    while time.time() < stop_at:
        pass


def bursts(loaders: int, burst_s: float, stop: multiprocessing.Event) -> None:
    """`loaders` busy processes for burst_s seconds, then none for burst_s, until `stop`."""
    while not stop.is_set():
        until = time.time() + burst_s
        procs = [multiprocessing.Process(target=busy, args=(until,)) for _ in range(loaders)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        stop.wait(burst_s)


def tune(directory: Path, extra: list[str]) -> tuple[float, dict[str, dict[str, str]], str, str]:
    """(wall s, tune.csv rows by candidate, the pick, tune.md's noise lines)."""
    started = time.perf_counter()
    command = [sys.executable, "-m", "launcher.tune", *JOB, *SPACE, *extra, f"tune.dir={directory}"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    with (directory / "tune.csv").open() as handle:
        rows = {row["candidate"]: row for row in csv.DictReader(handle)}
    pick = json.loads((directory / "tuning.json").read_text())["pick"]
    report = (directory / "tune.md").read_text()
    noise = report.split("## Noise", 1)[1].split("##", 1)[0].strip() if "## Noise" in report else ""
    return wall, rows, pick, noise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--loaders", type=int, default=2)
    parser.add_argument("--burst-s", type=float, default=4.0)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "tune_noise" / time.strftime("%H%M%S"))
    args = parser.parse_args()

    wall, rows, quiet_pick, noise = tune(args.out / "quiet", ["tune.early_skip=false"])
    quiet = {name: float(row["tokens_per_s"]) for name, row in rows.items() if row["tokens_per_s"]}
    best = max(quiet.values())
    print(f"quiet reference ({wall:.0f} s): pick {quiet_pick}; " + ", ".join(f"{n} {v:.0f}" for n, v in quiet.items()))
    print(noise)

    table = []
    for label, extra in (("one run each", ["tune.confirm_runs=0"]), ("confirmed (3 runs, the default)", [])):
        for trial in range(1, args.trials + 1):
            stop = multiprocessing.Event()
            load = multiprocessing.Process(target=bursts, args=(args.loaders, args.burst_s, stop))
            load.start()
            try:
                wall, rows, pick, noise = tune(args.out / f"{'confirmed' if extra == [] else 'single'}-{trial}", extra)
            finally:
                stop.set()
                load.join()
            score = quiet.get(pick, 0.0) / best
            busy_share = max((float(r["others_cpu"]) for r in rows.values() if r["others_cpu"]), default=0.0)
            table.append((label, trial, pick, score, wall, busy_share))
            print(f"{label} #{trial}: pick {pick} ({score:.2f} of the quiet best), {wall:.0f} s; {noise}", flush=True)

    print("\n| tuner | trial | pick | its quiet tokens/s / the quiet best | wall s | others' CPU share seen (max) |")
    print("|---|---:|---|---:|---:|---:|")
    for label, trial, pick, score, wall, busy_share in table:
        print(f"| {label} | {trial} | {pick} | {score:.2f} | {wall:.0f} | {busy_share:.0%} |")
    for label in dict.fromkeys(row[0] for row in table):
        scores = [row[3] for row in table if row[0] == label]
        print(f"{label}: median score {statistics.median(scores):.2f} over {len(scores)} trials")
    return 0


if __name__ == "__main__":
    sys.exit(main())
