"""Bad input at size: a set with a share of corrupt images, trained under data.on_bad_record=skip.

    python bench/bad_records.py                            # 10,000 records, 1% of their images cut short
    python bench/bad_records.py --records 50000 --percent 2

Writes LLaVA-format JSON lines whose records each have their own 32-px JPEG; `percent` of the images are
cut to their first 200 bytes (the header survives, the pixels do not: only decoding finds them, as on a
real set). Prepares the data (`python -m launcher.prepare`), then trains one step on it, and checks that
every bad record is counted (summary.json's records_skipped) and listed (RUN/skipped_records.jsonl),
and that the job says so in one line. Prints the figures as JSON and exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import ROOT, bench_env
from PIL import Image


def write_set(root: Path, count: int, percent: float) -> tuple[Path, int]:
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    bad = set(rng.choice(count, int(count * percent / 100), replace=False).tolist())
    with (root / "train.jsonl").open("w") as out:
        for index in range(count):
            image = root / "images" / f"{index}.jpg"
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(image, quality=90)
            if index in bad:
                image.write_bytes(image.read_bytes()[:200])
            turns = [{"from": "human", "value": "<image>\nwhat colour?"}, {"from": "gpt", "value": "red"}]
            out.write(json.dumps({"id": str(index), "image": f"images/{index}.jpg", "conversations": turns}) + "\n")
    return root / "train.jsonl", len(bad)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--percent", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data, bad = write_set(root, args.records, args.percent)
        job = [
            "logger=none", "data=llava_json", f"data.path={data}", "data.on_bad_record=skip", "data.num_workers=2",
            "train.max_steps=1", "train.eval_every=0", "data.eval_accuracy=false", f"cache_dir={root / 'cache'}",
        ]  # fmt: skip
        env = bench_env()
        started = time.perf_counter()
        prepared = subprocess.run(
            [sys.executable, "-m", "launcher.prepare", *job], capture_output=True, text=True, cwd=ROOT, env=env
        )
        prepare_s = time.perf_counter() - started
        run_dir = root / "run"
        ran = subprocess.run(
            [sys.executable, "train.py", *job, f"hydra.run.dir={run_dir}"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        listed = (run_dir / "skipped_records.jsonl").read_text().splitlines()
        lines = [line for line in (ran.stdout + ran.stderr).splitlines() if "bad record(s) skipped" in line]
        figures = {
            "records": args.records,
            "bad": bad,
            "prepare_exit": prepared.returncode,
            "prepare_s": round(prepare_s, 1),
            "prepared_lines": prepared.stdout.splitlines()[-4:],
            "job_exit": ran.returncode,
            "records_skipped": summary.get("records_skipped"),
            "skipped_records_jsonl_lines": len(listed),
            "job_lines_saying_so": lines,
        }
        print(json.dumps(figures, indent=2))
        ok = prepared.returncode == ran.returncode == 0 and summary.get("records_skipped") == len(listed) == bad
        sys.exit(0 if ok and len(lines) == 1 else 1)


if __name__ == "__main__":
    main()
