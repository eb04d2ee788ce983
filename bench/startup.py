"""Start-up cost of the launcher: `--cfg job`, `dry_run=true`, and time to the first training step.

    python bench/startup.py --repeats 5

Prints a Markdown table of medians (seconds) for BENCHMARKS.md. Each figure is the wall time of
a fresh `python train.py ...` process, as a user experiences it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def time_to_first_step(env: dict[str, str], run_dir: Path) -> float:
    """Seconds from process start until metrics.jsonl holds its first line."""
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", "train.max_steps=50", "logger=none"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = run_dir / "metrics.jsonl"
    try:
        while not (metrics.exists() and metrics.stat().st_size > 0):
            if process.poll() is not None:
                raise RuntimeError(f"training exited with {process.returncode} before its first step")
            time.sleep(0.02)
        return time.perf_counter() - start
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "WANDB_MODE": "offline"}
    with tempfile.TemporaryDirectory() as tmp:
        # Warm the built-in data and model cache once, so the timings measure start-up, not generation.
        time_to_first_step(env, Path(tmp) / "warm")
        rows = {
            "python train.py --cfg job": [timed(["--cfg", "job"], env) for _ in range(args.repeats)],
            "python train.py dry_run=true": [
                timed(["dry_run=true", f"hydra.run.dir={tmp}/dry{i}"], env) for i in range(args.repeats)
            ],
            "python train.py (to first step)": [
                time_to_first_step(env, Path(tmp) / f"first{i}") for i in range(args.repeats)
            ],
        }
    print("| command | median s | min s | max s | runs |\n|---|---|---|---|---|")
    for name, times in rows.items():
        print(f"| `{name}` | {statistics.median(times):.2f} | {min(times):.2f} | {max(times):.2f} | {len(times)} |")


if __name__ == "__main__":
    main()
