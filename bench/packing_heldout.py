"""Held-out loss after the same records, packed or not: does packing change what the model learns?

    python bench/packing_heldout.py                  # 3 epochs of the variable-length set, 3 seeds per arm

The set: bench/vs_hf_trainer.py's 2,000 variable-length records (20-400 tokens, 1-3 images) for training
and 200 more (another seed) held out (their images copied beside the training images); the built-in
tiny LLaVA; ZeRO 0, fp32, 1 rank. Three arms, as in
bench/packing.py: plain padding and `data.group_by_length=true` at 8 records per micro-batch, and
`data.packing=true data.pack_length=2048` at one row per micro-batch (about 10 records). Each arm trains
`--epochs` passes over the records: the padded arms exactly (epochs x 250 steps); the packed arm for the
steps that hold as many records (its rows per epoch, counted from the planner of launcher.data.packing
over the cached lengths). Every run reports its `eval/loss` at the end and the records it trained on;
the spread over the seeds (`train.seed`: initial weights and order) is the noise the arms are judged by.
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

PACK_LENGTH = 2048
ARMS = {
    "padding": ["train.micro_batch_size=8"],
    "grouping": ["train.micro_batch_size=8", "data.group_by_length=true"],
    "packing": ["train.micro_batch_size=1", "data.packing=true", f"data.pack_length={PACK_LENGTH}"],
}


def records_seen(run_dir: Path) -> int:
    """The records a run trained on: each step's records/s x its time (a packed row counts its records)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "perf/samples_per_sec" in r]
    return round(sum(r["perf/samples_per_sec"] * r["perf/step_time_s"] for r in steps))


def packed_rows_per_epoch(lengths_of: Path) -> int:
    """Rows of PACK_LENGTH tokens one epoch packs into, from the record lengths a padded run logged."""
    import numpy as np

    from launcher.data.packing import pack_rows

    lengths = np.asarray(json.loads(lengths_of.read_text()))
    return len(pack_rows(lengths, PACK_LENGTH, seed=0, epoch=0))


def held_out_set(out: Path, image_root: Path) -> Path:
    """200 more records of the same kind (another seed), their images copied beside the training set's
    as held_out_NAME (the held-out set is read with the training set's data.image_root)."""
    import shutil

    variable_length_data(out, records=200, seed=1)
    path = out / "held_out.json"
    rows = json.loads((out / "train.json").read_text())
    for row in rows:
        for name in row["images"]:
            shutil.copyfile(out / "img" / name, image_root / f"held_out_{name}")
        row["images"] = [f"held_out_{name}" for name in row["images"]]
    path.write_text(json.dumps(rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path("outputs/bench/packing_heldout"))
    args = parser.parse_args()
    train = variable_length_data(VARIABLE_DATA)
    data = [
        *train,
        f"data.eval_path={held_out_set(VARIABLE_DATA.with_name('variable_data_eval'), VARIABLE_DATA / 'img')}",
    ]
    padded_steps = args.epochs * 2000 // 8
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    packed_steps = None
    for seed in range(args.seeds):
        for arm, overrides in ARMS.items():
            if arm == "packing" and packed_steps is None:
                packed_steps = args.epochs * packed_rows_per_epoch(args.work_dir / "lengths.json")
            steps = packed_steps if arm == "packing" else padded_steps
            run_dir = args.work_dir / f"{arm}_{seed}"
            run = common.run_train_py(run_dir, steps, [*data, *overrides, f"train.seed={seed}"], timeout=3600)
            if arm == "padding" and seed == 0:  # the records' token lengths, for the packed arm's steps
                (args.work_dir / "lengths.json").write_text(json.dumps(record_lengths(run_dir)))
            row = {"arm": arm, "seed": seed, "steps": steps, "records": records_seen(run_dir),
                   "eval_loss": run["summary"]["eval_loss"], "final_loss": run["summary"]["final_loss"]}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows[arm].append(row)
    print(f"\n{'arm':>9} {'records':>8} {'eval loss (each seed)':>40} {'median':>8}")
    for arm, runs in rows.items():
        losses = [r["eval_loss"] for r in runs]
        each = ", ".join(f"{loss:.4f}" for loss in losses)
        print(f"{arm:>9} {runs[0]['records']:>8} {each:>40} {statistics.median(losses):>8.4f}")
    spread = max(r["eval_loss"] for r in rows["padding"]) - min(r["eval_loss"] for r in rows["padding"])
    for arm in ("grouping", "packing"):
        gaps = [a["eval_loss"] - b["eval_loss"] for a, b in zip(rows[arm], rows["padding"], strict=True)]
        print(
            f"{arm} - padding, per seed: {', '.join(f'{g:+.4f}' for g in gaps)} (padding's spread over seeds "
            f"{spread:.4f})"
        )


def record_lengths(run_dir: Path) -> list[int]:
    """Each training record's tokens, from the data cache the run used (the one its log names with the
    training set's 2,000 records)."""
    import re
    from types import SimpleNamespace

    from launcher.data.cache import CachedDataset

    found = re.findall(r"data cache (\S+): .*?\((\d+) records", (run_dir / "train.log").read_text())
    path = next(Path(where) for where, count in found if int(count) == 2000)
    no_images = SimpleNamespace(image_processor=None)  # lengths read no image
    return [int(n) for n in CachedDataset(path, no_images).lengths()]


if __name__ == "__main__":
    main()
