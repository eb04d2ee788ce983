"""How the data cache grows with the data set: disk per record, build time on 1 and 2 ranks, and the
samples/s DataLoader workers deliver, for images kept encoded (data.cache_images=encoded) and as pixels.

    python bench/data_scale.py                 # 500 and 2000 records of 336 x 336 JPEGs
    python bench/data_scale.py --records 500 5000
    python bench/data_scale.py --model tiny_qwen2_vl --size 448   # Qwen2-VL's dynamic resolution, 448 x 448

Records are LLaVA-format, one real-looking 336 x 336 JPEG each (smooth random colour fields with noise,
quality 90: ~20-40 KB, as photos of that size are), read through launcher.data.formats as a job reads
them. The processor is a tiny LLaVA's at 336 px, patch 14 (576 image tokens, the pixel values of
LLaVA-1.5): the image work per record is a real model's; the language model is tiny. Each build starts
from an empty cache directory; CPU seconds count this process and its children (the second rank, the
DataLoader workers). Prints one JSON line per (records, mode) and a table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import print_markdown_table
from PIL import Image, ImageFilter

from launcher.data.cache import CachedCollator, CachedDataset, Part, RecordEncoder, ensure_cache
from launcher.data.formats import ReadOptions, read_records
from launcher.data.records import ConversationDataset
from launcher.model.loading import load_model_and_processor
from launcher.model.tiny import build_tiny_model_dir

SIZE = 336
# Shards of 128 records (the launcher's are 2,048): a few thousand records split as a large set does.
SHARD_RECORDS = 128
ANSWERS = ["a red square", "a blue circle", "a green triangle", "two yellow stars"]


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def write_set(root: Path, count: int, seed: int = 0, size: int = SIZE) -> Path:
    """`count` LLaVA records, each with its own `size` x `size` JPEG."""
    rng = np.random.default_rng(seed)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(count):
        coarse = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
        field = Image.fromarray(coarse).resize((size, size), Image.BICUBIC).filter(ImageFilter.GaussianBlur(3))
        noise = rng.normal(0, 12, (size, size, 3))
        pixels = np.clip(np.asarray(field, dtype=np.float64) + noise, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(images / f"{index}.jpg", quality=90)
        turns = [
            {"from": "human", "value": "<image>\nWhat is in the picture?"},
            {"from": "gpt", "value": ANSWERS[index % len(ANSWERS)]},
        ]
        rows.append({"id": str(index), "image": f"images/{index}.jpg", "conversations": turns})
    path = root / "train.json"
    path.write_text(json.dumps(rows))
    return path


def tiny_processor(root: Path, architecture: str = "tiny_llava", size: int = SIZE):
    model = build_tiny_model_dir(
        architecture, root / "model", [*ANSWERS, "What is in the picture?"], seed=0, hidden_size=64, num_layers=1,
        vision_hidden_size=32, vision_layers=1, image_size=size, patch_size=14,
    )  # fmt: skip
    return load_model_and_processor(str(model))[1]


def _rank(args: tuple) -> None:
    rank, world, barrier, root, records, processor, images = args
    ensure_cache(
        root, records, processor, "bench", RecordEncoder(processor, images=images),
        ConversationDataset(records).__getitem__, on_bad_record="error", num_workers=0,
        part=Part(rank, world, barrier.wait), shard_records=SHARD_RECORDS,
    )  # fmt: skip


def build(root: Path, records: list[dict], processor, images: str, ranks: int) -> tuple[float, float, Path]:
    """(wall s, CPU s, cache path) of one build from an empty directory, on `ranks` processes."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    if ranks == 1:
        info = ensure_cache(
            root, records, processor, "bench", RecordEncoder(processor, images=images),
            ConversationDataset(records).__getitem__, on_bad_record="error", num_workers=0,
            shard_records=SHARD_RECORDS,
        )  # fmt: skip
        path = info.path
    else:
        context = multiprocessing.get_context("fork")
        barrier = context.Barrier(ranks)
        workers = [
            context.Process(target=_rank, args=((r, ranks, barrier, root, records, processor, images),))
            for r in range(ranks)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
            assert worker.exitcode == 0
        (path,) = [p for p in root.iterdir() if not p.name.startswith(".")]
    return time.perf_counter() - wall, cpu_seconds() - cpu, path


def read_rate(path: Path, processor, workers: int, seconds: float = 15.0) -> float:
    """Samples/s a DataLoader delivers from the cache (batches of 8, shuffled), over at most `seconds`."""
    from torch.utils.data import DataLoader

    dataset = CachedDataset(path, processor)
    loader = DataLoader(
        dataset, batch_size=8, shuffle=True, num_workers=workers, collate_fn=CachedCollator(processor),
        persistent_workers=False,
    )  # fmt: skip
    started, samples = time.perf_counter(), 0
    for batch in loader:
        samples += len(batch["input_ids"])
        if time.perf_counter() - started > seconds:
            break
    return samples / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--model", default="tiny_llava", choices=["tiny_llava", "tiny_qwen2_vl"])
    parser.add_argument("--size", type=int, default=SIZE, help="image side in pixels")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="data_scale.") as tmp:
        root = Path(tmp)
        processor = tiny_processor(root, args.model, args.size)
        for count in args.records:
            source = write_set(root / f"set{count}", count, size=args.size)
            records, _, _ = read_records(source, ReadOptions())
            image_bytes = sum(Path(r["images"][0]).stat().st_size for r in records)
            for images in ("encoded", "pixels"):
                row = {"model": args.model, "size": args.size, "records": count, "images": images}
                row["source_image_kb_per_record"] = round(image_bytes / count / 1e3, 1)
                for ranks in (1, 2):
                    wall, cpu, path = build(root / f"cache{count}-{images}-{ranks}", records, processor, images, ranks)
                    row[f"build_wall_s_{ranks}_ranks"] = round(wall, 2)
                    row[f"build_cpu_ms_per_record_{ranks}_ranks"] = round(1e3 * cpu / count, 2)
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                row["cache_kb_per_record"] = round(size / count / 1e3, 1)
                for workers in args.workers:
                    row[f"samples_per_s_{workers}_workers"] = round(read_rate(path, processor, workers), 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print_markdown_table(rows)


if __name__ == "__main__":
    main()
