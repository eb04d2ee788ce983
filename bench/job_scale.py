"""A whole job's start-up as the data set grows: wall and CPU time of a one-step, two-rank `python train.py`
once its data is prepared, and the peak memory of its processes, at N records, for this checkout and for
another commit side by side (the one before the record index, by default).

    python bench/job_scale.py                              # 1K, 10K and 50K records, HEAD against f747c3a
    python bench/job_scale.py --records 1000 100000 --against f747c3a

Records are LLaVA-format JSON (two turns, one image each; 16 distinct 32-px PNGs, so the data cache's
build is cheap and the figures are the data path's, not the image processor's); the model is a tiny
LLaVA saved to a directory and loaded as a pretrained one (model.source=pretrained), as a user's model
would be. Per N and checkout, two runs in the same cache_dir: the first prepares the data (the record
index, where the checkout has one, and the data cache), the second finds it prepared; the second is the
start-up every later job (a resume, a sweep's next point) pays. CPU seconds and peak resident memory
(ru_maxrss, the largest of the launcher, torchrun and both ranks) are this bench's children's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
IMAGES = 16
COLOURS = ["red", "blue", "green", "yellow"]
ANSWERS = [f"a {colour} shape" for colour in COLOURS]
QUESTION = "what is in the picture?"


def write_set(root: Path, count: int) -> Path:
    """N records as JSON lines, written one at a time (this process stays small: its children inherit
    its peak memory figure)."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for index in range(IMAGES):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / "images" / f"{index}.png")
    path = root / "train.jsonl"
    with path.open("w") as out:
        for index in range(count):
            turns = [{"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": ANSWERS[index % 4]}]
            out.write(json.dumps({"id": f"r{index}", "image": f"{index % IMAGES}.png", "conversations": turns}) + "\n")
    return path


def build_model(root: Path) -> Path:
    code = (
        "import sys; from pathlib import Path; from launcher.model.tiny import build_tiny_model_dir; "
        f"build_tiny_model_dir('tiny_llava', Path(sys.argv[1]), {[*ANSWERS, QUESTION]!r}, seed=0, hidden_size=64, "
        "num_layers=1, vision_hidden_size=32, vision_layers=1, image_size=32, patch_size=8)"
    )
    subprocess.run([sys.executable, "-c", code, str(root / "model")], check=True, cwd=ROOT)
    return root / "model"


def run_job(checkout: Path, data: Path, model: Path, cache: Path, run_dir: Path, extensions: Path) -> dict:
    """One `python train.py` of one step on two ranks; its wall and CPU seconds and peak RSS (a child
    process of its own, so that the peak is this job's)."""
    args = [
        "logger=none", "train.max_steps=1", "train.micro_batch_size=4", "train.eval_every=0",
        "data.eval_accuracy=false", "data=llava_json", f"data.path={data}", f"data.image_root={data.parent / 'images'}",
        "model=tiny_llava", "model.source=pretrained", f"model.path={model}", "dist.nproc_per_node=2",
        f"cache_dir={cache}", f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(checkout), "WANDB_MODE": "offline", "TORCH_EXTENSIONS_DIR": str(extensions)}
    env.pop("VIRTUAL_ENV", None)
    measure = (
        "import resource, subprocess, sys, time, json; start = time.perf_counter(); "
        "code = subprocess.run(sys.argv[1:]).returncode; u = resource.getrusage(resource.RUSAGE_CHILDREN); "
        "print(json.dumps({'code': code, 'wall_s': time.perf_counter() - start, "
        "'cpu_s': u.ru_utime + u.ru_stime, 'peak_rss_mib': u.ru_maxrss / 1024}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", measure, sys.executable, str(checkout / "train.py"), *args],
        capture_output=True, text=True, cwd=checkout, env=env,
    )  # fmt: skip
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    if figures["code"] != 0:
        raise SystemExit(f"the job failed in {checkout}:\n{result.stderr[-3000:]}")
    return {key: round(value, 2) if isinstance(value, float) else value for key, value in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, nargs="+", default=[1_000, 10_000, 50_000])
    parser.add_argument("--against", default="f747c3a", help="the other commit (default: before the record index)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        other = base / "other"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(other), args.against], check=True, cwd=ROOT)
        try:
            model = build_model(base)
            for count in args.records:
                data = write_set(base / f"n{count}", count)
                for name, checkout in (("this", ROOT), (args.against, other)):
                    cache = base / f"cache-{name}-{count}"
                    for attempt in ("prepares", "prepared"):
                        row = {"records": count, "checkout": name, "run": attempt}
                        row.update(
                            run_job(checkout, data, model, cache, base / f"run-{name}-{count}-{attempt}", base / "ext")
                        )
                        print(json.dumps(row), flush=True)
                        rows.append(row)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], check=False, cwd=ROOT)
    print(f"\n{'records':>8} {'checkout':>9} {'run':>9} {'wall s':>7} {'CPU s':>7} {'peak RSS MiB':>13}")
    for row in rows:
        print(
            f"{row['records']:>8} {row['checkout']:>9} {row['run']:>9} {row['wall_s']:>7} {row['cpu_s']:>7} "
            f"{row['peak_rss_mib']:>13}"
        )


if __name__ == "__main__":
    main()
