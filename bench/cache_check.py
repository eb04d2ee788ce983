"""What checking the data cache costs each start (issue 42: nothing trains on damaged bytes), as it grows.

    python bench/cache_check.py                     # 2,000 and 8,000 records of 336 x 336 JPEGs
    python bench/cache_check.py --records 2000 --repeats 5

For each size: one build (the launcher's own ensure_cache, data.cache_images=encoded, bench/data_scale.py's
records and tiny LLaVA processor), the share of it spent fingerprinting the files it wrote (XXH3-128, timed
again on the built files), then `--repeats` checks of each kind: data.cache_check=checksums and =sizes, each
from the page cache (warm) and after `echo 1 > /proc/sys/vm/drop_caches` (cold; needs root, else left out).
A check is launcher.data.cache.cache_damage, what rank 0 runs before training on a built cache. Prints one
JSON line per size and a table with medians and min-max.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from data_scale import build, tiny_processor, write_set

from launcher.core.manifest import fingerprint
from launcher.data.cache import CHECKSUM, cache_damage
from launcher.data.formats import ReadOptions, read_records


def drop_page_cache() -> bool:
    """Empty the kernel's page cache (root only); False where it cannot."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def timed_checks(path: Path, *, sizes_only: bool, cold: bool, repeats: int) -> list[float] | None:
    times = []
    for _ in range(repeats):
        if cold and not drop_page_cache():
            return None
        started = time.perf_counter()
        found = cache_damage(path, sizes_only=sizes_only)
        times.append(time.perf_counter() - started)
        assert found == {}, found
    return times


def measure(root: Path, count: int, repeats: int) -> dict:
    data = write_set(root / f"set{count}", count)
    processor = tiny_processor(root / f"set{count}")
    records, _, _ = read_records(data, ReadOptions())
    wall, cpu, path = build(root / f"cache{count}", records, processor, "encoded", 1)
    files = [file for file in path.rglob("*") if file.is_file()]
    size = sum(file.stat().st_size for file in files)
    started = time.perf_counter()
    for file in path.rglob("*.bin"):
        fingerprint(file, CHECKSUM)
    fingerprint_s = time.perf_counter() - started
    row = {"records": count, "files": len(files), "cache_mib": size / 2**20, "build_s": wall, "build_cpu_s": cpu,
           "fingerprint_s": fingerprint_s}  # fmt: skip
    for name, sizes_only, cold in [("checksums_warm", False, False), ("checksums_cold", False, True),
                                   ("sizes_warm", True, False), ("sizes_cold", True, True)]:  # fmt: skip
        row[name] = timed_checks(path, sizes_only=sizes_only, cold=cold, repeats=repeats)
    return row


def spread(times: list[float] | None) -> str:
    if not times:
        return "-"
    return f"{statistics.median(times) * 1000:,.1f} ({min(times) * 1000:,.1f}-{max(times) * 1000:,.1f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count in args.records:
            row = measure(Path(tmp), count, args.repeats)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| records | cache MiB | files | build s | fingerprinting in it, s | checksums, warm ms | cold ms "
          "| sizes, warm ms | cold ms | checksums cold, GB/s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        cold = row["checksums_cold"]
        rate = "-" if not cold else f"{row['cache_mib'] * 2**20 / statistics.median(cold) / 1e9:.2f}"
        print(f"| {row['records']:,} | {row['cache_mib']:,.1f} | {row['files']} | {row['build_s']:.1f} | "
              f"{row['fingerprint_s']:.3f} | {spread(row['checksums_warm'])} | {spread(row['checksums_cold'])} | "
              f"{spread(row['sizes_warm'])} | {spread(row['sizes_cold'])} | {rate} |")  # fmt: skip


if __name__ == "__main__":
    main()
