"""Useful throughput with packing against length grouping and plain padding, on variable-length records.

    python bench/packing.py                                   # ZeRO 0, 1 rank, 3 repeats
    python bench/packing.py --ranks 2 deepspeed=z3            # ZeRO 3 on 2 ranks

The set: bench/vs_hf_trainer.py's variable-length records (2,000 records of 20-400 tokens, 1-3 images of
24-64 px each), the built-in tiny LLaVA, the data cache. Three arms, each a fresh `python train.py` run,
interleaved (their order rotates every repeat): plain padding and `data.group_by_length=true` at
`train.micro_batch_size=8` records, and `data.packing=true data.pack_length=2048` at 1 row per
micro-batch (~10 of these records: about the same tokens per step). Figures from each run's summary.json
(the steady state: the first steps left out): real (non-padding) tokens/s, padding share, MFU, records/s,
and real tokens per CPU-second of the whole process tree (ranks and workers, steps 8 to the last but
one). Prints one JSON line per run, then per arm the median and the paired ratios packing / grouping
and packing / padding of each repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _common as common
from vs_hf_trainer import VARIABLE_DATA, variable_length_data

SKIP = 8  # steps left out of the CPU window: warm-up
ARMS = {
    "padding": ["train.micro_batch_size=8"],
    "grouping": ["train.micro_batch_size=8", "data.group_by_length=true"],
    "packing": ["train.micro_batch_size=1", "data.packing=true", "data.pack_length=2048"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/bench/packing"))
    parser.add_argument("overrides", nargs="*", help="train.py overrides for every arm (e.g. deepspeed=z3)")
    args = parser.parse_args()
    data = variable_length_data(VARIABLE_DATA)
    ranks = [f"dist.nproc_per_node={args.ranks}"] if args.ranks > 1 else []
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    names = list(ARMS)
    for repeat in range(args.repeats):
        for arm in names[repeat % 3 :] + names[: repeat % 3]:  # each arm goes first once in three repeats
            extra = [*data, *ARMS[arm], *ranks, *args.overrides]  # run_train_py adds no W&B, no evaluation
            window = (SKIP, args.steps - 1)  # the process tree's CPU between these metrics lines
            run = common.run_train_py(
                args.work_dir / f"{arm}_{repeat}", args.steps, extra, timeout=1800, cpu_window=window
            )
            summary = run["summary"]
            step_s = statistics.median(run["step_times"][SKIP:])
            cpu_per_step = run["tree_cpu_per_step"]
            row = {
                "arm": arm,
                "repeat": repeat,
                "real_tokens_per_s": summary["tokens_per_sec"],
                "records_per_s": summary["samples_per_sec"],
                "padding_frac": summary["padding_frac"],
                "mfu": summary["mfu"],
                # real tokens per CPU-second of the whole process tree (ranks, workers): steadier than wall
                "real_tokens_per_cpu_s": summary["tokens_per_sec"] * step_s / cpu_per_step,
                "final_loss": summary["final_loss"],
                "others_cpu": run["foreign_cpu"],
            }
            print(json.dumps(row), flush=True)
            runs[arm].append(row)
    print(f"\n{'arm':>9} {'real tokens/s':>14} {'per CPU-s':>10} {'records/s':>10} {'padding':>8} {'MFU':>7}")
    for arm, rows in runs.items():
        tokens = statistics.median(r["real_tokens_per_s"] for r in rows)
        per_cpu = statistics.median(r["real_tokens_per_cpu_s"] for r in rows)
        records = statistics.median(r["records_per_s"] for r in rows)
        padding = statistics.median(r["padding_frac"] for r in rows)
        mfu = statistics.median(r["mfu"] for r in rows)
        print(f"{arm:>9} {tokens:>14.0f} {per_cpu:>10.0f} {records:>10.1f} {padding:>8.1%} {mfu:>7.2%}")
    for other in ("grouping", "padding"):
        for key in ("real_tokens_per_s", "real_tokens_per_cpu_s"):
            ratios = [packed[key] / rival[key] for packed, rival in zip(runs["packing"], runs[other], strict=True)]
            each = ", ".join(f"{r:.2f}" for r in ratios)
            print(f"packing / {other}: {key} x{statistics.median(ratios):.2f} (each repeat: {each})")


if __name__ == "__main__":
    main()
