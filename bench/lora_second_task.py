"""What people use LoRA for, measured: a trained model learns a second task through a small adapter.

1. The default job (`python train.py`: full fine-tune, the shape question) gives `model/`, unless
   --base names an existing one.
2. That model, unchanged, answers the colour question ("what colour is the shape?" -> "red") of the
   built-in set's held-out split: its exact match before any adapter.
3. `method=lora` on that model learns the colour question; held-out exact match every --eval-every
   steps, the trainable share of the parameters, wall and CPU time.
4. The same LoRA job at the ZeRO stages and world sizes the issue names, each --matrix-steps steps, to
   show each trains (loss falls) and how long a step takes there.

    .venv/bin/python bench/lora_second_task.py                       # about 5 min on the 2-core CPU box
    .venv/bin/python bench/lora_second_task.py --base outputs/runs/DAY/TIME/model --no-matrix

Results go to outputs/bench/lora_second_task.json; BENCHMARKS.md records them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from _common import ROOT, bench_env, own_cpu_seconds, read_metrics, wait_for_quiet

OUT = ROOT / "outputs" / "bench" / "lora_second_task"
MATRIX = {
    "z0 ws1": ["deepspeed=z0"],
    "z0 ws2": ["deepspeed=z0", "dist.nproc_per_node=2"],
    "z2 ws1": ["deepspeed=z2"],
    "z2 ws2": ["deepspeed=z2", "dist.nproc_per_node=2"],
    "z3 ws1": ["deepspeed=z3"],
    "z3 ws2": ["deepspeed=z3", "dist.nproc_per_node=2"],
    "z3_offload bf16 ws1": ["deepspeed=z3_offload", "precision=bf16"],
    "z3_offload bf16 ws2": ["deepspeed=z3_offload", "precision=bf16", "dist.nproc_per_node=2"],
}


def train(run_dir: Path, *overrides: str) -> dict:
    import shutil
    import subprocess

    shutil.rmtree(run_dir, ignore_errors=True)
    command = [sys.executable, "train.py", "logger=none", f"hydra.run.dir={run_dir}", *overrides]
    cpu_before, wall_before = own_cpu_seconds(), time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=bench_env(), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": round(time.perf_counter() - wall_before, 1),
        "cpu_s": round(own_cpu_seconds() - cpu_before, 1),
        "summary": summary,
        "metrics": read_metrics(run_dir),
    }


def accuracy_before(model_dir: Path, samples: int) -> float:
    """Exact match of the unchanged model on the colour question's held-out split."""
    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.data.accuracy import exact_match_accuracy
    from launcher.data.records import ConversationDataset, load_records
    from launcher.data.shapes import prepare_data
    from launcher.model.loading import load_model_and_processor

    data = typed(compose(["data=shapes", "data.task=colour"])).data
    _, eval_file, image_root = prepare_data(data, Path(bench_env()["VLM_LAUNCHER_CACHE"]))
    records, _ = load_records(eval_file, image_root)
    model, processor = load_model_and_processor(str(model_dir))
    correct, total = exact_match_accuracy(model, processor, ConversationDataset(records[:samples]), max_new_tokens=4)
    return correct / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=None, help="a trained model/ (default: train one)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--matrix-steps", type=int, default=20)
    parser.add_argument("--no-matrix", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    wait_for_quiet(0.3)
    results: dict = {}
    base = args.base
    if base is None:
        run = train(OUT / "base")
        base = OUT / "base" / "model"
        results["base"] = {k: run[k] for k in ("wall_s", "cpu_s")} | {"eval_accuracy": run["summary"]["eval_accuracy"]}
    lora = ["method=lora", "model.source=pretrained", f"model.path={base.resolve()}", "data.task=colour"]
    results["colour_before"] = accuracy_before(base, samples=200)
    run = train(OUT / "lora", *lora, f"train.max_steps={args.steps}", f"train.eval_every={args.eval_every}")
    summary = run["summary"]
    results["lora"] = {
        "wall_s": run["wall_s"],
        "cpu_s": run["cpu_s"],
        "params_trainable": summary["params_trainable"],
        "params_total": summary["params_total"],
        "trainable_fraction": summary["trainable_fraction"],
        "accuracy_by_step": {m["step"]: m["eval/accuracy"] for m in run["metrics"] if "eval/accuracy" in m},
        "samples_per_sec": summary["samples_per_sec"],
    }
    if not args.no_matrix:
        results["matrix"] = {}
        for label, overrides in MATRIX.items():
            wait_for_quiet(0.3)
            steps = [f"train.max_steps={args.matrix_steps}", "train.eval_every=0", "data.eval_accuracy=false"]
            run = train(OUT / label.replace(" ", "_"), *lora, *overrides, *steps)
            losses = [m["train/loss"] for m in run["metrics"]]
            results["matrix"][label] = {
                "wall_s": run["wall_s"],
                "first_loss": round(losses[0], 4),
                "last_loss": round(losses[-1], 4),
                "step_s_median": sorted(m["perf/step_time_s"] for m in run["metrics"])[len(losses) // 2],
            }
    (OUT.parent / "lora_second_task.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
