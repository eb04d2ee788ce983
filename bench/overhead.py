"""Launcher overhead: steady-state step time of `python train.py` against a hand-written DeepSpeed loop.

    .venv/bin/python bench/overhead.py --steps 150 --skip 20 --repeats 5

Both contenders train the built-in job (tiny_llava on `shapes`, ZeRO stage 0, fp32, micro batch 32)
for the same number of steps, each in a fresh process, interleaved A B B A A B ... so that load from
other processes on the machine hits both alike. The hand loop uses what a `train.py` run wrote: the
same `ds_config.json` (the exact dict given to `deepspeed.initialize`), the same cached model and
processor (`load_model_and_processor`), the same records, `ConversationDataset`, `Collator` and
DataLoader settings (DistributedSampler with the same seed, one worker, persistent, drop_last). It
times each step the way `launcher/recipe.py` does: wall time from before the batch is fetched to
after `engine.step()` and reading the loss.

Figures per run, over steps skip+1..steps:
  step time   per-step wall as the recipe measures it (`perf/step_time_s` for train.py): the mean, the
              median, and the fastest tenth (10th percentile: steps nothing else slowed down);
  period      wall from the end of step `skip` to the end of step `steps`-1, per step: it also
              holds whatever a loop does outside its timed window (metrics, logging). For train.py it
              is observed from outside, by the time each metrics.jsonl line appears (polled every ms);
              the same poller runs during the hand loop, so both pay for it.
Prints a Markdown table: medians over runs, and the ratio train.py / hand loop as the median of the
ratios of neighbouring runs (run i of each, which share the machine's state of the moment; the ratio
of the medians is printed too). Both train bit-identically (same loss at every step; printed).

The machine may be shared. Each run starts only once other processes use under --max-foreign-cpu
(default 10%) of the CPU over 2 s, and a run during which they used more (machine-wide CPU time from
/proc/stat less this benchmark's own, children included) is run again, up to 3 times; the share is
printed per run. `--work-dir` keeps every run's timings; `--report WORK_DIR...` prints the table
again, pooling the runs of several work directories.

`--hand-loop REF_RUN_DIR --out FILE` runs one hand loop (what the benchmark starts in a subprocess).
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _common as common


# ----------------------------------------------------------------------------- statistics
def steady(run: dict[str, Any], skip: int, micro: int) -> dict[str, float]:
    """Steady-state figures of one run over steps skip+1..end (step numbers start at 1)."""
    times = run["step_times"][skip:]
    mean = statistics.fmean(times)
    return {
        "step_s": mean,
        "median_step_s": statistics.median(times),
        # The fastest tenth: steps that other processes on the machine happened not to slow down.
        "p10_step_s": statistics.quantiles(times, n=10)[0],
        "period_s": common.period(run["step_ends"], skip),
        "samples_per_sec": micro / mean,
        "peak_mib": run["peak_bytes"] / 2**20,
        "foreign_cpu": run.get("foreign_cpu", math.nan),
    }


# ----------------------------------------------------------------------------- the hand-written loop
def hand_loop(ref_run: Path, steps: int, out: Path) -> None:
    """forward / backward / step with plain DeepSpeed; per-step times written to `out` as JSON."""
    import logging
    import random

    import numpy as np
    import torch

    common.single_rank_env()
    import deepspeed
    from deepspeed.utils import logger as deepspeed_logger
    from torch.utils.data import DataLoader, DistributedSampler

    from launcher.data import Collator, ConversationDataset
    from launcher.models import load_model_and_processor

    deepspeed_logger.setLevel(logging.WARNING)  # the recipe quiets it too (it logs every config key)
    cfg, ds_config, records, model_dir = common.reference_inputs(ref_run)
    deepspeed.init_distributed(dist_backend="gloo")
    seed = int(cfg.train.seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    model, processor = load_model_and_processor(model_dir)
    model.config.use_cache = False  # no KV cache while training, as the recipe sets
    dataset = ConversationDataset(records)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    workers = int(cfg.data.num_workers)
    loader = DataLoader(
        dataset,
        batch_size=ds_config["train_micro_batch_size_per_gpu"],
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        collate_fn=Collator(processor),
    )
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()
    step_times, step_ends, losses = [], [], []
    engine.train()
    for _ in range(steps):
        start = time.perf_counter()
        batch = {
            key: value.to(engine.device, dtype) if value.is_floating_point() else value.to(engine.device)
            for key, value in next(stream).items()
        }
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        end = time.perf_counter()
        step_times.append(end - start)
        step_ends.append(end)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write_text(json.dumps({"step_times": step_times, "step_ends": step_ends, "peak_bytes": peak, "loss": losses}))
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- the benchmark
def main() -> None:
    args = common.parse_args(common.benchmark_parser(__doc__.splitlines()[0], repeats=5, worker_flag="--hand-loop"))
    if args.worker:
        hand_loop(args.worker, args.steps, args.out)
        return
    if args.report:
        report(args.report, args.skip)
        return

    def progress(run: dict[str, Any], _seconds: float) -> str:
        return f"{statistics.fmean(run['step_times'][args.skip :]) * 1e3:.1f} ms/step"

    with common.work_dir(args.work_dir, "bench-overhead-") as work:
        seconds = common.run_interleaved(
            work, args, worker_flag="--hand-loop", worker_name="hand", worker_extra=[], progress=progress
        )
        print(f"\n{seconds:.0f} s in all", end="")
        report([work], args.skip)


def report(works: list[Path], skip: int) -> None:
    """The table, from the timings runs of this benchmark kept in `works` (pooled when several)."""
    micro = json.loads((works[0] / "train_py_0" / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"]
    train_runs, hand_runs = common.load_paired_runs(works, "hand")
    a = [steady(run, skip, micro) for run in train_runs]
    b = [steady(run, skip, micro) for run in hand_runs]
    steps = len(hand_runs[0]["step_times"])
    print(f"; {len(a)} and {len(b)} runs, steps {skip + 1}-{steps}, interleaved; medians over runs\n")
    print(
        "| contender | mean step ms | median step ms | fastest-tenth step ms | period ms | samples/s | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    keys = ("step_s", "median_step_s", "p10_step_s", "period_s")
    for name, rows in (("`python train.py`", a), ("hand-written DeepSpeed loop", b)):
        times = " | ".join(f"{common.median_of(rows, key) * 1e3:.1f}" for key in keys)
        speed, peak = common.median_of(rows, "samples_per_sec"), common.median_of(rows, "peak_mib")
        print(f"| {name} | {times} | {speed:.0f} | {peak:.0f} |")
    paired = {key: common.paired_ratios(a, b, key) for key in keys}
    ratios = " | ".join(f"{statistics.median(paired[key]):.3f}" for key in keys)
    print(f"| **train.py / hand loop** (median of paired ratios) | {ratios} | | |")
    ratios = " | ".join(f"{common.median_of(a, key) / common.median_of(b, key):.3f}" for key in keys)
    print(f"| ratio of the medians | {ratios} | | |")
    for key in keys:
        print(f"\npaired ratios of {key} (run i of each): {', '.join(f'{r:.3f}' for r in paired[key])}", end="")
    print("\n\nper-run mean step ms, train.py: " + ", ".join(f"{r['step_s'] * 1e3:.0f}" for r in a))
    print("per-run mean step ms, hand loop: " + ", ".join(f"{r['step_s'] * 1e3:.0f}" for r in b))
    if all("loss" in run for run in train_runs):
        difference = max(
            abs(x - y) for run in hand_runs for x, y in zip(train_runs[0]["loss"], run["loss"], strict=True)
        )
        print(f"same job: largest difference between the loss curves of train.py and the hand loop {difference:.2g}")
    for name, rows in (("train.py", a), ("hand loop", b)):
        print(
            f"CPU share other processes used during each run, {name}: "
            + ", ".join(f"{row['foreign_cpu']:.0%}" for row in rows)
        )


if __name__ == "__main__":
    main()
