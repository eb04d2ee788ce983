"""The README's default job, `python train.py`, whole, at this checkout against another commit.

    .venv/bin/python bench/default_job.py --against 72be45e --repeats 3

Each contender runs from its own checkout (the other commit in a temporary git worktree) with this
project's virtualenv, its own warm caches (one unmeasured run first fills them: built-in data, tiny model,
data cache, DeepSpeed ops) and W&B offline, as a user's second run is. Runs alternate A B B A A B ...
(bench/_common.py), each once other processes leave the CPU alone. Per run: wall time, CPU seconds of
the whole process tree (the launcher, its rank, DataLoader workers, W&B's service: every descendant is
waited for, so `getrusage(RUSAGE_CHILDREN)` counts them) and the held-out exact match it printed.
Prints the medians and the ratio this / other of neighbouring runs, geometric mean with a 95% Student-t
interval. `--fresh`: every run with empty caches instead (a new user's first run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, ForeignLoad, interleaved_order, measured

T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_job(checkout: Path, caches: Path, out: Path) -> dict[str, float]:
    """One `python train.py` in `checkout`, its caches under `caches`, its run dir under `out`."""
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(out / "wandb"),
        "VLM_LAUNCHER_CACHE": str(caches / "cache"),
        "TORCH_EXTENSIONS_DIR": str(caches / "torch_extensions"),
    }
    env.pop("WANDB_API_KEY", None)
    probe, cpu, start = ForeignLoad(), children_cpu_s(), time.perf_counter()
    done = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={out / 'run'}"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    wall, cpu = time.perf_counter() - start, children_cpu_s() - cpu
    if done.returncode:
        raise SystemExit(f"{checkout}: python train.py exited {done.returncode}:\n{done.stderr[-3000:]}")
    text = done.stdout + done.stderr
    match = re.findall(r"(?:exact match|accuracy)\D{0,20}?([01]\.\d+)", text)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "exact_match": float(match[-1]) if match else math.nan,
        "foreign_cpu": probe.share(),
    }


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of `ratios` and its 95% Student-t interval (over the log ratios)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = T_975.get(len(logs) - 1, 1.96) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="72be45e", help="the other commit")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs of each")
    parser.add_argument("--fresh", action="store_true", help="every run with empty caches")
    parser.add_argument("--max-foreign-cpu", type=float, default=0.10)
    parser.add_argument("--out", type=Path, default=None, help="also write the runs as JSON here")
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    names = {"A": f"this ({head.stdout.strip()})", "B": args.against}
    with tempfile.TemporaryDirectory(prefix="default_job_") as tmp:
        work = Path(tmp)
        other = work / "other"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(other), args.against], check=True, cwd=ROOT)
        try:
            checkouts = {"A": ROOT, "B": other}
            if not args.fresh:
                for side in "AB":  # fill each contender's caches once, unmeasured
                    run_job(checkouts[side], work / f"caches_{side}", work / f"warm_{side}")
            runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
            for number, side in enumerate(interleaved_order(args.repeats)):
                caches = work / (f"fresh_{number}" if args.fresh else f"caches_{side}")
                run = measured(
                    lambda: run_job(checkouts[side], caches, work / f"run_{number}"),  # noqa: B023 - called at once
                    args.max_foreign_cpu,
                )
                runs[side].append(run)
                print(
                    f"  {names[side]}: {run['wall_s']:.1f} s wall, {run['cpu_s']:.1f} CPU s, "
                    f"exact match {run['exact_match']:.3f}, others {run['foreign_cpu']:.0%}",
                    file=sys.stderr,
                )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], check=False, cwd=ROOT)
    if args.out:
        args.out.write_text(json.dumps({names[side]: runs[side] for side in "AB"}, indent=1))
    print(f"\n`python train.py` ({'empty' if args.fresh else 'warm'} caches), {args.repeats} runs each, medians:\n")
    print("| checkout | wall s | CPU s | exact match |")
    print("|---|---:|---:|---:|")
    for side in "AB":
        rows = runs[side]
        print(
            f"| {names[side]} | {statistics.median(r['wall_s'] for r in rows):.1f} | "
            f"{statistics.median(r['cpu_s'] for r in rows):.1f} | "
            f"{statistics.median(r['exact_match'] for r in rows):.3f} |"
        )
    for key, label in (("cpu_s", "CPU"), ("wall_s", "wall")):
        ratios = [a[key] / b[key] for a, b in zip(runs["A"], runs["B"], strict=True)]
        mean, low, high = interval(ratios)
        print(f"\n{label} this / {args.against}: {mean:.3f} (95% CI {low:.3f}-{high:.3f}; pairs {ratios})")


if __name__ == "__main__":
    main()
