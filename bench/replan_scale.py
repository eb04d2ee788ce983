"""What rank 0's memory plan from the records costs a run (launcher.train.trainer.plan_from_records), as the
data set grows to LLaVA-665K.

    python bench/replan_scale.py                       # a 4,000-record cache; the plan at 66,500 and 665,000
    python bench/replan_scale.py --records 4000 --planned 665000 --repeats 5

Once the ranks have built the data cache, rank 0 plans the job again from its records. That is two costs:

- reading the records' shapes (launcher.plan.data.cache_shapes): the cache's offset arrays, one small .npz per
  shard, and no pixel. Measured on a real cache of `--records` records (bench/data_scale.py's LLaVA records, its
  tiny processor) built twice, in shards of 2,048 (the launcher's) and of 16, so that the cost of a shard and
  of a record come apart. LLaVA-665K is 325 shards of 2,048.
- the plan from those shapes (launcher.plan.report.planned_from_cache): the model's figures from its config on
  the meta device, and, packed, the first epoch's packing plan of every record (launcher.data.packing.pack_rows).
  Measured on `--planned` records' shapes drawn at LLaVA-665K's lengths (image tokens plus a log-normal text
  length: median ~400, a long tail cut at data.max_length), for Qwen2-VL-2B's real architecture (its config ships
  with the launcher), padded and packed in rows of 8,192.

Each figure is wall and CPU seconds of this process: the first call (what a run pays: it plans once), and the
median of the `--repeats` - 1 after it (min-max beside it). Prints
one JSON line per measurement and a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import ROOT, print_markdown_table
from data_scale import tiny_processor, write_set

from launcher.config.compose import compose
from launcher.config.precision import Device
from launcher.config.schema import typed
from launcher.data.cache import RecordEncoder, ensure_cache
from launcher.data.formats import ReadOptions, read_records
from launcher.data.records import ConversationDataset
from launcher.job.planning import plan_job
from launcher.job.spec import HydraJob
from launcher.model.stats import RecordShapes
from launcher.plan.data import cache_shapes
from launcher.plan.report import planned_from_cache

LAUNCHER_SHARD = 2048
SMALL_SHARD = 16
LLAVA_665K = 665_000
H200 = Device("cuda", bf16=True, fp16=True)


def timed(work, repeats: int) -> tuple[dict[str, float], Any]:
    """Wall and CPU seconds of the first of `repeats` calls of `work()`, the median and range of the others,
    and the last result."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        result = work()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    # The first call apart: a run plans once, and the first call pays what later ones find cached (the
    # model's figures, the files in the page cache).
    figures = {"first_wall_s": walls[0], "first_cpu_s": cpus[0]}
    figures.update(wall_s=statistics.median(walls[1:]), cpu_s=statistics.median(cpus[1:]))
    figures["wall_range_s"] = f"{min(walls[1:]):.3f}-{max(walls[1:]):.3f}"
    return {key: round(value, 4) if isinstance(value, float) else value for key, value in figures.items()}, result


def cache_reads(records: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="replan_scale.") as tmp:
        root = Path(tmp)
        processor = tiny_processor(root, size=56)  # the image size changes no offset read
        items, _, _ = read_records(write_set(root / "set", records, size=56), ReadOptions())
        for shard in (LAUNCHER_SHARD, SMALL_SHARD):
            info = ensure_cache(
                root / f"cache{shard}", items, processor, "bench", RecordEncoder(processor, images="encoded"),
                ConversationDataset(items).__getitem__, on_bad_record="error", num_workers=0, shard_records=shard,
            )  # fmt: skip
            figures, shapes = timed(lambda path=info.path: cache_shapes(path, processor), repeats)
            assert len(shapes.lengths) == records
            shards = -(-records // shard)
            rows.append({"what": "cache_shapes", "records": records, "shards": shards, **figures})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def llava_665k_shapes(count: int, image_tokens: int, seed: int = 0) -> RecordShapes:
    """`count` records of one image each and a log-normal text length (median ~400 tokens, LLaVA-665K's
    conversations), cut at 8,192 as data.max_length cuts them."""
    rng = np.random.default_rng(seed)
    text = rng.lognormal(np.log(400), 0.8, count).astype(np.int64)
    return RecordShapes(np.minimum(text + image_tokens, 8192), np.ones(count, dtype=np.int64), where="synthetic")


def plans(counts: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    base = ["model=qwen2_vl_2b", "precision=bf16", "deepspeed=z0", "data.max_length=8192", "train.micro_batch_size=1"]
    for batching, extra in (("pad", []), ("pack", ["data.packing=true", "data.pack_length=8192"])):
        overrides = [*base, *extra]
        cfg = typed(compose(overrides))
        job = plan_job(cfg, HydraJob(run_dir=ROOT, overrides=tuple(overrides)), device=H200, validate=False)
        for count in counts:
            shapes = llava_665k_shapes(count, image_tokens=256)  # a 448 px image: 256 tokens after the merger
            figures, planned = timed(functools.partial(planned_from_cache, cfg, job, shapes), repeats)
            row = {"what": f"planned_from_cache qwen2_vl_2b {batching}", "records": count, "shards": "", **figures}
            rows.append({**row, "planned_mib": round(planned / 2**20)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=4000, help="records of the real cache read")
    parser.add_argument("--planned", type=int, nargs="+", default=[66_500, LLAVA_665K], help="records planned")
    parser.add_argument("--repeats", type=int, default=6, help="calls of each, the first reported apart")
    args = parser.parse_args()
    rows = cache_reads(args.records, args.repeats) + plans(args.planned, args.repeats)
    for row in rows:
        row.setdefault("planned_mib", "")
    print_markdown_table(rows)
    big, small = rows[0], rows[1]
    per_shard = (small["first_cpu_s"] - big["first_cpu_s"]) / (small["shards"] - big["shards"])
    per_record = max(0.0, big["first_cpu_s"] - big["shards"] * per_shard) / big["records"]
    shards = -(-LLAVA_665K // LAUNCHER_SHARD)
    read = shards * per_shard + LLAVA_665K * per_record
    print(
        f"\nreading shapes: {1e3 * per_shard:.2f} CPU ms a shard, {1e6 * per_record:.2f} CPU us a record; "
        f"LLaVA-665K ({shards} shards of {LAUNCHER_SHARD:,}): ~{read:.2f} CPU s"
    )


if __name__ == "__main__":
    main()
