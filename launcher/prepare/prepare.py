"""`python -m launcher.prepare [OVERRIDES]`: a job's data prepared before the job.

Builds what `python train.py OVERRIDES` would build before its first step, and nothing else: each data
file's record index (cache_dir/record_index) and the data cache of the train and eval splits
(cache_dir/data_cache), keyed as the job keys them, so the job and every later one with the same data,
model and data settings (a sweep's every point, a resume) start on prepared data. On a cluster, run it on
a CPU node with the cache_dir the job will use. With several processes each builds its share of the
cache's shards at once:

    python -m launcher.prepare data=llava_json data.path=/data/llava_665k.json model=llava_1_5_7b
    torchrun --nproc_per_node 16 -m launcher.prepare data=llava_json data.path=... model=llava_1_5_7b

Prints the records read (and the bad ones skipped), then one line per split: the cache's directory,
records, skipped, size and build time (or "reused").
Exit codes as train.py's: 1 for a config that does not compose, 2 for bad input (one `error:` line), 143
for a stop signal (SIGTERM, Ctrl-C, ...): the shard being written is finished and kept, with every one before
it, and the same command later builds only the rest.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence

from launcher.config.compose import compose_typed
from launcher.config.ranges import check_config
from launcher.core.errors import LauncherError, one_line
from launcher.core.signals import STOP_SIGNALS, handling, name
from launcher.data.cache import Part
from launcher.job.data import prepare


def main(argv: Sequence[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    started, group = time.perf_counter(), False
    stops: list[str] = []  # stop signals received: the build ends after the shard it is writing (kept)
    try:
        with handling(STOP_SIGNALS, lambda signum, _frame: stops.append(name(signum))):
            cfg = compose_typed(overrides)
            check_config(cfg)
            part, group = _part(lambda: bool(stops))
            loaded, caches = prepare(cfg, part)
    except LauncherError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    finally:
        if group:
            import torch.distributed

            torch.distributed.destroy_process_group()
    if part.rank == 0:
        print(
            f"records: {len(loaded.train)} train, {len(loaded.eval)} eval ({loaded.skipped} bad records skipped while "
            "reading; a job lists them in its skipped_records.jsonl)"
        )
        for split, info in caches.items():
            how = f"built in {info.build_seconds:.1f} s" if info.built else "reused"
            print(
                f"{split}: {info.path} ({info.records} records, {info.skipped} skipped, {info.bytes / 2**20:.1f} MiB; "
                f"{how})"
            )
        print(f"prepared in {time.perf_counter() - started:.1f} s; jobs with the same data settings start on it")
    return 0


def _part(stop_wanted: Callable[[], bool]) -> tuple[Part, bool]:
    """This process's share: all of it, or under torchrun (WORLD_SIZE > 1) its rank's, with a gloo group
    for the barriers and for agreeing to stop."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Part(stop_wanted=stop_wanted), False
    import torch.distributed

    from launcher.train.distributed import any_rank

    torch.distributed.init_process_group("gloo")
    return Part(torch.distributed.get_rank(), world, torch.distributed.barrier, stop_wanted, any_rank), True
