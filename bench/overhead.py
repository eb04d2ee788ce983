"""Launcher overhead: steady-state step time of `python train.py` against a hand-written DeepSpeed loop.

    .venv/bin/python bench/overhead.py --steps 150 --skip 20 --repeats 5

Both contenders train the built-in job (tiny_llava on `shapes`, ZeRO stage 0, fp32, micro batch 32)
for the same number of steps, each in a fresh process, interleaved A B B A A B ... so that load from
other processes on the machine hits both alike. The hand loop uses what a `train.py` run wrote: the
same `ds_config.json` (the exact dict given to `deepspeed.initialize`), the same cached model and
processor (`load_model_and_processor`), the same records, `ConversationDataset`, `Collator` and
DataLoader settings (DistributedSampler with the same seed, one worker, persistent, drop_last). It
times each step the way `launcher/train_loop.py` does: wall time from before the batch is fetched to
after `engine.step()` and reading the loss.

Figures per run, over steps skip+1..steps:
  step time   per-step wall as train_loop measures it (`perf/step_time_s` for train.py): the mean, the
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

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The built-in job, short and without what is not training: no W&B, no periodic eval, no generation.
QUIET_JOB = ["logger=none", "train.eval_every=0", "data.eval_accuracy=false"]


# ----------------------------------------------------------------------------- running contenders
def bench_env() -> dict[str, str]:
    """The environment of every benchmarked process.

    DeepSpeed JIT-builds its ops (shm comm, fused_adam, cpu_adam) into TORCH_EXTENSIONS_DIR, by default
    ~/.cache/torch_extensions/py311_cpu. Where several virtualenvs share that directory, each rebuilds
    what another built (ninja sees other include paths) and the rest wait on its lock: runs stalled
    for 1-2 minutes here. The benchmarks use a directory of their own (built once by the first run)."""
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLM_LAUNCHER_CACHE", str(ROOT / "outputs" / "cache"))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "outputs" / "bench" / "torch_extensions"))
    return env


def machine_busy_seconds() -> float:
    """CPU seconds all processes on the machine have used since boot (the first line of /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (and theirs: DataLoader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class ForeignLoad:
    """Share of the machine's CPU (all cores) that processes other than ours used since creation."""

    def __init__(self) -> None:
        self.busy, self.own, self.wall = machine_busy_seconds(), own_cpu_seconds(), time.perf_counter()

    def share(self) -> float:
        foreign = (machine_busy_seconds() - self.busy) - (own_cpu_seconds() - self.own)
        return max(0.0, foreign) / ((time.perf_counter() - self.wall) * (os.cpu_count() or 1))


def wait_for_quiet(limit: float, max_wait_s: float = 900) -> None:
    """Wait (at most max_wait_s) until other processes use less than `limit` of the CPU over 2 s."""
    deadline = time.monotonic() + max_wait_s
    said = False
    while time.monotonic() < deadline:
        probe = ForeignLoad()
        time.sleep(2.0)
        share = probe.share()
        if share < limit:
            return
        if not said:
            print(f"  waiting for other processes to quieten (they use {share:.0%} of the CPU)", file=sys.stderr)
            said = True
        time.sleep(3.0)


def measured(run_once: Any, limit: float, attempts: int = 3) -> dict[str, Any]:
    """`run_once()` on a quiet machine; again (up to `attempts` times) when others loaded it meanwhile.

    `limit` <= 0 turns the check off. The last attempt's result is kept whatever its load."""
    for attempt in range(1, attempts + 1):
        if limit > 0:
            wait_for_quiet(limit)
        run = run_once()
        if limit <= 0 or run["foreign_cpu"] < limit or attempt == attempts:
            return run
        print(f"  other processes used {run['foreign_cpu']:.0%} of the CPU during that run: again", file=sys.stderr)
    raise AssertionError("unreachable")


def run_watched(command: list[str], watch: Path, log: Path, timeout: float) -> tuple[list[float], float]:
    """Run `command`; the perf_counter time at which each new line of `watch` was seen, and the share
    of the CPU other processes used meanwhile (ForeignLoad).

    Polls the file's size every millisecond. Raises RuntimeError (with the log's tail) on failure.
    """
    seen: list[float] = []
    size = 0
    started = time.perf_counter()
    load = ForeignLoad()
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, cwd=ROOT, env=bench_env(), stdout=log_file, stderr=subprocess.STDOUT)
        try:
            while process.poll() is None:
                try:
                    now_size = os.stat(watch).st_size
                except FileNotFoundError:
                    now_size = 0
                if now_size > size:
                    now = time.perf_counter()
                    with open(watch, "rb") as handle:
                        handle.seek(size)
                        chunk = handle.read(now_size - size)
                    seen.extend([now] * chunk.count(b"\n"))
                    size += len(chunk)
                if time.perf_counter() - started > timeout:
                    raise RuntimeError(f"{' '.join(command)} ran past {timeout:.0f} s")
                time.sleep(0.001)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if process.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command)} exited with {process.returncode}:\n{tail}")
    return seen, load.share()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_train_py(run_dir: Path, steps: int, extra: list[str], timeout: float = 900) -> dict[str, Any]:
    """One fresh `python train.py` run; its per-step times, metrics-line times and summary."""
    command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"train.max_steps={steps}", *QUIET_JOB, *extra]
    shutil.rmtree(run_dir, ignore_errors=True)  # a run again must not append to an earlier metrics.jsonl
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    line_times, foreign = run_watched(command, run_dir / "metrics.jsonl", log, timeout)
    metrics = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_times": [m["perf/step_time_s"] for m in metrics],
        "step_ends": line_times,
        "loss": [m["train/loss"] for m in metrics],
        "peak_bytes": summary["peak_memory_bytes"],
        "summary": summary,
        "foreign_cpu": foreign,
    }


def run_worker(flag: str, ref_run: Path, out: Path, steps: int, extra: list[str], timeout: float = 900) -> dict:
    """Run the running script's worker mode `flag` in a fresh process, under the same poller as train.py."""
    script = Path(sys.argv[0]).resolve()
    command = [sys.executable, str(script), flag, str(ref_run), "--out", str(out), "--steps", str(steps), *extra]
    _, foreign = run_watched(command, out.with_suffix(".never"), out.with_suffix(".log"), timeout)
    return {**json.loads(out.read_text()), "foreign_cpu": foreign}


# ----------------------------------------------------------------------------- statistics
def period(ends: list[float], skip: int) -> float:
    """Wall per step from the end of step `skip` to the end of the step before the last.

    The last step is left out: train.py evaluates after it and before writing its metrics line."""
    return (ends[-2] - ends[skip - 1]) / (len(ends) - 1 - skip)


def steady(run: dict[str, Any], skip: int, micro: int) -> dict[str, float]:
    """Steady-state figures of one run over steps skip+1..end (step numbers start at 1)."""
    times = run["step_times"][skip:]
    mean = statistics.fmean(times)
    return {
        "step_s": mean,
        "median_step_s": statistics.median(times),
        # The fastest tenth: steps that other processes on the machine happened not to slow down.
        "p10_step_s": statistics.quantiles(times, n=10)[0],
        "period_s": period(run["step_ends"], skip),
        "samples_per_sec": micro / mean,
        "peak_mib": run["peak_bytes"] / 2**20,
        "foreign_cpu": run.get("foreign_cpu", math.nan),
    }


def median_of(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def interleaved_order(repeats: int) -> list[str]:
    """A B B A A B ...: each contender goes first equally often, and A comes first (B needs its files)."""
    order: list[str] = []
    for index in range(repeats):
        order += ["A", "B"] if index % 2 == 0 else ["B", "A"]
    return order


# ----------------------------------------------------------------------------- the hand-written loop
def single_rank_env() -> None:
    """One rank on this machine, as launcher/processes.py sets it for an in-process rank."""
    from launcher.processes import free_port

    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(free_port())


def reference_inputs(ref_run: Path) -> tuple[Any, dict[str, Any], list[dict], str]:
    """The composed config, DeepSpeed dict, train records and model directory of a train.py run."""
    from omegaconf import OmegaConf

    from launcher import train_loop
    from launcher.data import load_records

    cfg = OmegaConf.load(ref_run / ".hydra" / "config.yaml")
    ds_config = json.loads((ref_run / "ds_config.json").read_text())
    cache = Path(cfg.cache_dir).expanduser().absolute()
    train_file, eval_file, image_root = train_loop.prepare_data(cfg, cache)
    records, _ = load_records(train_file, image_root)
    eval_records, _ = load_records(eval_file, image_root) if eval_file else ([], 0)
    # The same cached directory train.py loaded (its name hashes the model settings and vocabulary).
    model_path = getattr(train_loop, "resolve_model_path", None) or train_loop._model_path  # its older name
    return cfg, ds_config, records, model_path(cfg, cache, records + eval_records)


def hand_loop(ref_run: Path, steps: int, out: Path) -> None:
    """forward / backward / step with plain DeepSpeed; per-step times written to `out` as JSON."""
    import logging
    import random

    import numpy as np
    import torch

    single_rank_env()
    import deepspeed
    from deepspeed.utils import logger as deepspeed_logger
    from torch.utils.data import DataLoader, DistributedSampler

    from launcher.data import Collator, ConversationDataset
    from launcher.models import load_model_and_processor

    deepspeed_logger.setLevel(logging.WARNING)  # train_loop quiets it too (it logs every config key)
    cfg, ds_config, records, model_dir = reference_inputs(ref_run)
    deepspeed.init_distributed(dist_backend="gloo")
    seed = int(cfg.train.seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    model, processor = load_model_and_processor(model_dir)
    model.config.use_cache = False  # no KV cache while training, as train_loop sets
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out of the figures")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each contender")
    parser.add_argument("--work-dir", type=Path, help="keep run directories and timings here (default: temporary)")
    parser.add_argument(
        "--report", type=Path, nargs="+", metavar="WORK_DIR", help="print the table of kept --work-dirs (pooled)"
    )
    parser.add_argument(
        "--max-foreign-cpu",
        type=float,
        default=0.10,
        help="start runs when other processes use less than this share of the CPU, and run again one during "
        "which they used more (up to 3 times; 0 turns this off)",
    )
    parser.add_argument("--hand-loop", type=Path, metavar="REF_RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for both, e.g. precision=bf16")
    args = parser.parse_args()
    if args.hand_loop:
        hand_loop(args.hand_loop, args.steps, args.out)
        return
    if args.skip < 1 or args.steps <= args.skip:
        parser.error("need 1 <= --skip < --steps")
    if args.report:
        report(args.report, args.skip)
        return

    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        counts = {"A": 0, "B": 0}
        started = time.perf_counter()
        for contender in interleaved_order(args.repeats):
            index = counts[contender]
            counts[contender] += 1
            if contender == "A":
                run = measured(
                    lambda i=index: run_train_py(work / f"train_py_{i}", args.steps, args.overrides),
                    args.max_foreign_cpu,
                )
                (work / f"train_py_{index}.json").write_text(json.dumps(run))
            else:
                out = work / f"hand_{index}.json"
                run = measured(
                    lambda out=out: run_worker("--hand-loop", work / "train_py_0", out, args.steps, []),
                    args.max_foreign_cpu,
                )
                out.write_text(json.dumps(run))
            mean = statistics.fmean(run["step_times"][args.skip :])
            print(
                f"  {contender}{index}: {mean * 1e3:.1f} ms/step, others used {run['foreign_cpu']:.0%} of the CPU",
                file=sys.stderr,
            )
        print(f"\n{time.perf_counter() - started:.0f} s in all", end="")
        report([work], args.skip)


def _index(path: Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def report(works: list[Path], skip: int) -> None:
    """The table, from the timings runs of this benchmark kept in `works` (pooled when several)."""
    micro = json.loads((works[0] / "train_py_0" / "ds_config.json").read_text())["train_micro_batch_size_per_gpu"]
    train_runs: list[dict[str, Any]] = []
    hand_runs: list[dict[str, Any]] = []
    for work in works:  # run i of each contender ran next to each other: they stay paired
        train_runs += [json.loads(path.read_text()) for path in sorted(work.glob("train_py_*.json"), key=_index)]
        hand_runs += [json.loads(path.read_text()) for path in sorted(work.glob("hand_*.json"), key=_index)]
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
        times = " | ".join(f"{median_of(rows, key) * 1e3:.1f}" for key in keys)
        print(f"| {name} | {times} | {median_of(rows, 'samples_per_sec'):.0f} | {median_of(rows, 'peak_mib'):.0f} |")
    # Neighbouring runs share the machine's state of the moment (it drifts between levels several % apart),
    # so the ratio of each pair, then their median, is steadier than the ratio of the two medians.
    paired = {key: [x[key] / y[key] for x, y in zip(a, b, strict=False)] for key in keys}
    ratios = " | ".join(f"{statistics.median(paired[key]):.3f}" for key in keys)
    print(f"| **train.py / hand loop** (median of paired ratios) | {ratios} | | |")
    ratios = " | ".join(f"{median_of(a, key) / median_of(b, key):.3f}" for key in keys)
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
