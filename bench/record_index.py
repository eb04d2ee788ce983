"""What reading a data set's records costs each process, as the set grows: the records read into Python
lists (every process parses and checks the file) against the record index (launcher.data.index: the first
reader writes a memory-mapped Arrow file, every later one maps it).

    python bench/record_index.py                         # 10K, 50K and 200K records
    python bench/record_index.py --records 10000 665000

Records are LLaVA-format, two turns, one image each (16 distinct 336-px JPEGs shared by all records: the
header check opens one per record, as it would on a real set). Each figure comes from a fresh Python
process that imports the launcher first ("imports" is that alone): peak resident memory (ru_maxrss) and
CPU seconds (from /proc/self/status, so Linux only: the peak resident memory, and the private memory at
the end, which leaves out the index's mapped pages, shared through the page cache) of

    list     read_records into a list, then 1,000 random records (what the launcher and each rank did)
    build    the index written (once per data file, by the first reader; a file of 32 MiB or more in a
             child process, whose CPU is counted and whose peak memory is shown apart)
    open     the index mapped, then the same 1,000 random records (what every later reader does)

Prints one JSON line per (records, mode) and a table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

IMAGES = 16
MODES = ("imports", "list", "build", "open")

MEASURE = """
import json, resource, sys, time
from pathlib import Path
import numpy as np
from launcher.data.formats import ReadOptions, read_records
from launcher.data.index import Records, indexed_records
mode, path, index_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
start = resource.getrusage(resource.RUSAGE_SELF)
wall = time.perf_counter()
options = ReadOptions(image_root=path.parent / "images")
if mode == "list":
    records = read_records(path, options)[0]
elif mode in ("build", "open"):
    records = Records([indexed_records(str(path), options, index_dir)[0]])
    sources = records.sources
if mode != "imports":
    for i in np.random.default_rng(0).integers(0, len(records), 1000).tolist():
        records[i]["messages"]
end, child = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
# A large file is indexed in a child process: its CPU counts, its peak is reported apart.
cpu = end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime + child.ru_utime + child.ru_stime
# VmHWM: this process's own peak (ru_maxrss would carry the parent's over the fork). RssAnon: its private
# memory at the end, less the pages of mapped files (the index's, shared through the page cache).
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
mib = lambda key: round(int(status[key].split()[0]) / 1024, 1)
print(json.dumps({"cpu_s": round(cpu, 2), "wall_s": round(time.perf_counter() - wall, 2),
                  "peak_rss_mib": mib("VmHWM"), "private_mib": mib("RssAnon"),
                  "child_peak_mib": round(child.ru_maxrss / 1024, 1)}))
"""


def write_set(root: Path, count: int) -> Path:
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    for index in range(IMAGES):
        pixels = rng.integers(0, 256, (336, 336, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "images" / f"{index}.jpg", quality=90)
    rows = [
        {
            "id": f"r{index}",
            "image": f"{index % IMAGES}.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is in the picture, and what colour is it?"},
                {"from": "gpt", "value": f"A {['red', 'blue', 'green'][index % 3]} shape on a plain background."},
            ],
        }
        for index in range(count)
    ]
    path = root / "data.json"
    path.write_text(json.dumps(rows))
    return path  # the rows go with this frame: the measuring processes start from a small parent


def measure(mode: str, path: Path, index_dir: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, mode, str(path), str(index_dir)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, nargs="+", default=[10_000, 50_000, 200_000])
    args = parser.parse_args()
    rows = []
    for count in args.records:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_set(Path(tmp), count)
            for mode in MODES:  # "build" before "open": the index exists by then
                row = {"records": count, "mode": mode, "file_mib": round(path.stat().st_size / 2**20, 1)}
                row.update(measure(mode, path, Path(tmp) / "index"))
                if mode == "open":
                    row["index_mib"] = round(sum(p.stat().st_size for p in (Path(tmp) / "index").iterdir()) / 2**20, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    base = {row["records"]: row["peak_rss_mib"] for row in rows if row["mode"] == "imports"}
    private = {row["records"]: row["private_mib"] for row in rows if row["mode"] == "imports"}
    print(f"\n{'records':>8} {'mode':>7} {'CPU s':>7} {'peak RSS MiB':>13} {'over imports':>13} {'private over':>13}")
    for row in rows:
        over = row["peak_rss_mib"] - base[row["records"]]
        own = row["private_mib"] - private[row["records"]]
        figures = f"{row['cpu_s']:>7} {row['peak_rss_mib']:>13} {over:>13.1f} {own:>13.1f}"
        print(f"{row['records']:>8} {row['mode']:>7} {figures}")


if __name__ == "__main__":
    main()
