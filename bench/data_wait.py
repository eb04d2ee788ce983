"""Does the step wait on its data? `perf/data_wait_frac` (the share of each step spent waiting for the next
batch) of a real `python train.py` on 336-px JPEGs with the images kept encoded in the data cache (the
workers decode and process every image of every batch), for data.num_workers 0, 2 and 4.

    python bench/data_wait.py                       # 512 records, 40 steps, workers 0 2 4
    python bench/data_wait.py --workers 0 2 --steps 60

The model is a tiny LLaVA whose vision tower takes 336-px images in 14-px patches (576 image tokens per
image, LLaVA-1.5's image work) and whose language model is tiny: the step is short, so this is the hard
case for the data path. One rank, micro-batch 8, the data cache prepared first (`python -m
launcher.prepare`); steps after the first 5 count. Prints, per worker count, the mean data-wait share,
the step time and samples/s, and the samples/s the data path would have to deliver for a step of
another length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import ROOT, bench_env, read_metrics
from data_scale import write_set

from launcher.model.tiny import build_tiny_model_dir

MICRO = 8
SKIP = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_set(root, args.records)
        model = build_tiny_model_dir(
            "tiny_llava", root / "model", ["What is in the picture?", "a red square", "a blue circle",
            "a green triangle", "two yellow stars"], seed=0, hidden_size=64, num_layers=1, vision_hidden_size=32,
            vision_layers=1, image_size=336, patch_size=14,
        )  # fmt: skip
        common = [
            "logger=none", "train.eval_every=0", "data.eval_accuracy=false", "data=llava_json", f"data.path={data}",
            f"data.image_root={root}", "model=tiny_llava", "model.source=pretrained", f"model.path={model}",
            f"train.micro_batch_size={MICRO}", f"cache_dir={root / 'cache'}",
        ]  # fmt: skip
        env = bench_env()
        subprocess.run([sys.executable, "-m", "launcher.prepare", *common], check=True, cwd=ROOT, env=env)
        rows = []
        for workers in args.workers:
            run_dir = root / f"run-w{workers}"
            job = [*common, f"train.max_steps={args.steps}", f"data.num_workers={workers}", f"hydra.run.dir={run_dir}"]
            subprocess.run([sys.executable, "train.py", *job], check=True, cwd=ROOT, env=env, capture_output=True)
            steps = read_metrics(run_dir)[SKIP:]
            step_s = statistics.median(row["perf/step_time_s"] for row in steps)
            wait = statistics.mean(row["perf/data_wait_frac"] for row in steps)
            row = {
                "workers": workers,
                "data_wait_frac": round(wait, 3),
                "step_s_median": round(step_s, 4),
                "samples_per_s": round(MICRO / step_s, 1),
                "compute_s": round(step_s * (1 - wait), 4),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(f"\n{'workers':>8} {'data wait':>10} {'step s':>8} {'samples/s':>10}")
    for row in rows:
        wait, step, rate = row["data_wait_frac"], row["step_s_median"], row["samples_per_s"]
        print(f"{row['workers']:>8} {wait:>10.1%} {step:>8} {rate:>10}")


if __name__ == "__main__":
    main()
