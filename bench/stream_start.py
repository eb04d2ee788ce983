"""What a streamed set (data.streaming) costs before its first batch, as the set grows: at the start, and
at a resume half-way through a rank's epoch, with JSON lines and parquet shards.

    python bench/stream_start.py                          # 10K, 100K and 1M records
    python bench/stream_start.py --records 10000 665000

The set: LLaVA-format records, two turns, one image each (16 distinct 336-px JPEGs shared by all
records, as in bench/record_index.py), written as 8 JSON lines shards and as 8 parquet shards (row
groups of 10,000 rows). Each figure comes from a fresh Python process that loads the processor of a
tiny LLaVA at 336 px / 14-px patches first (its time is left out), then takes rank 0's first micro-batch
of 8 (of 2 ranks: 4 of the 8 files, no DataLoader workers) through RecordStream and streamed_batches, as
a rank does:

    start    from the beginning of epoch 0
    resume   from the middle of rank 0's epoch 0 (what a resume does: whole files and parquet row groups
             skipped by their metadata, JSON lines counted unparsed, then the block re-read)

Prints one JSON line per (records, format, mode) and a table: CPU seconds, wall seconds and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
IMAGES, SHARDS, RANKS, MICRO = 16, 8, 2, 8

MEASURE = """
import json, resource, sys, time
from pathlib import Path
from launcher.data.cache import CachedCollator, RecordEncoder
from launcher.data.formats import ReadOptions, SkipTally
from launcher.data.stream import RecordStream, StreamOrder, stream_files, stream_options, streamed_batches
from launcher.model.loading import load_processor
from launcher.train.checkpoint import DataPosition
shards, model, start, ranks, micro = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
processor = load_processor(model)
before = resource.getrusage(resource.RUSAGE_SELF)
wall = time.perf_counter()
files = tuple(stream_files(shards))
order = StreamOrder(files, seed=0, rank=0, world_size=ranks, block=1000)
options = stream_options(ReadOptions(image_root=Path(shards).parent / "images"))
stream = RecordStream(order, options, RecordEncoder(processor, None, "pixels"), start=start)
position = DataPosition(records=start)
batch = next(streamed_batches(iter(stream), position, micro, CachedCollator(processor), "error", SkipTally()))
after = resource.getrusage(resource.RUSAGE_SELF)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(json.dumps({"cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 3),
                  "wall_s": round(time.perf_counter() - wall, 3), "position": position.records,
                  "peak_rss_mib": round(int(status["VmHWM"].split()[0]) / 1024, 1)}))
"""


def write_set(root: Path, count: int) -> dict[str, Path]:
    """The records as JSON lines shards and as parquet shards; returns each format's glob."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for index in range(IMAGES):
        pixels = rng.integers(0, 256, (336, 336, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"{index}.jpg", quality=90)
    for shard in range(SHARDS):
        rows = [
            {
                "id": f"r{index}",
                "image": f"{index % IMAGES}.jpg",
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat is in the picture, and what colour is it?"},
                    {"from": "gpt", "value": f"A {['red', 'blue', 'green'][index % 3]} shape on a plain background."},
                ],
            }
            for index in range(shard, count, SHARDS)
        ]
        (root / f"part-{shard:02d}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        pq.write_table(pa.Table.from_pylist(rows), root / f"part-{shard:02d}.parquet", row_group_size=10_000)
    return {"jsonl": root / "part-*.jsonl", "parquet": root / "part-*.parquet"}


def measure(shards: Path, model: Path, start: int) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(shards), str(model), str(start), str(RANKS), str(MICRO)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    from launcher.model.tiny import build_tiny_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model_dir(
            "tiny_llava", Path(tmp) / "model", ["What is in the picture, and what colour is it?",
            "A red shape on a plain background."], seed=0, hidden_size=64, num_layers=1, vision_hidden_size=32,
            vision_layers=1, image_size=336, patch_size=14,
        )  # fmt: skip
        for count in args.records:
            with tempfile.TemporaryDirectory() as data:
                formats = write_set(Path(data), count)
                per_rank = count // RANKS
                for fmt, shards in formats.items():
                    for mode, start in (("start", 0), ("resume", per_rank // 2)):
                        row = {"records": count, "format": fmt, "mode": mode, **measure(shards, model, start)}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    print(f"\n{'records':>9} {'format':>8} {'mode':>7} {'CPU s':>7} {'wall s':>7} {'peak RSS MiB':>13}")
    for row in rows:
        figures = f"{row['cpu_s']:>7} {row['wall_s']:>7} {row['peak_rss_mib']:>13}"
        print(f"{row['records']:>9} {row['format']:>8} {row['mode']:>7} {figures}")


if __name__ == "__main__":
    main()
