"""Is a projector-first schedule worth having? Held-out exact match of the built-in task after the same
number of steps, trained in one stage (everything from step 1) or in two (train.stages: the projector
alone, then everything), over several seeds.

    .venv/bin/python bench/stages.py --steps 200 --first 50 --seeds 0 1 2 3 4

Each run is `python train.py` (the built-in tiny LLaVA and shapes set, ZeRO 0, fp32) with
train.seed=S (initialisation, data order); both arms see the same steps, batch, rate and schedule rule
(each stage warms up anew and decays over its own steps). Prints one row per seed and the mean
difference (two-stage minus one-stage) with a 95% t-interval over seeds; BENCHMARKS.md records a run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._common import bench_env  # noqa: E402

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided, by df


def run(run_dir: Path, steps: int, seed: int, extra: list[str]) -> dict:
    command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"train.max_steps={steps}",
               f"train.seed={seed}", "logger=none", "train.eval_every=0", *extra]  # fmt: skip
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"accuracy": summary["eval_accuracy"], "eval_loss": summary["eval_loss"], "wall_s": time.time() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--first", type=int, default=50, help="steps of the projector-only stage")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("overrides", nargs="*", help="train.py overrides for both arms, e.g. train.lr=3e-4")
    args = parser.parse_args()
    schedule = (f"train.stages=[{{steps: {args.first}, train: [projector]}}, "
                "{train: [vision, projector, language]}]")  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as tmp:
        for seed in args.seeds:
            one = run(Path(tmp) / f"one-{seed}", args.steps, seed, args.overrides)
            two = run(Path(tmp) / f"two-{seed}", args.steps, seed, [*args.overrides, schedule])
            rows.append((seed, one, two))
            arms = [f"{label} {arm['accuracy']:.3f} (eval loss {arm['eval_loss']:.4f}, {arm['wall_s']:.0f} s)"
                    for label, arm in (("one stage", one), ("projector first", two))]  # fmt: skip
            print(f"seed {seed}: {' | '.join(arms)}", flush=True)
    for key in ("accuracy", "eval_loss"):
        differences = [two[key] - one[key] for _, one, two in rows]
        mean = statistics.fmean(differences)
        half = T95[len(rows) - 1] * statistics.stdev(differences) / len(rows) ** 0.5 if len(rows) > 1 else float("nan")
        ones, twos = (statistics.fmean(r[i][key] for r in rows) for i in (1, 2))
        print(f"{key}: one stage {ones:.4f}, projector first {twos:.4f}; difference {mean:+.4f} "
              f"(95% CI {mean - half:+.4f} .. {mean + half:+.4f}, {len(rows)} seeds)")  # fmt: skip


if __name__ == "__main__":
    main()
