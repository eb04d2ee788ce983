"""Launcher overhead: CPU time and wall time per step of `python train.py` against a hand-written DeepSpeed loop.

    .venv/bin/python bench/overhead.py --repeats 3 --pairs 30                     # ZeRO 0, fp32, 1 rank
    .venv/bin/python bench/overhead.py --repeats 3 --pairs 30 --wandb             # + W&B offline
    .venv/bin/python bench/overhead.py --skip 10 --repeats 2 --pairs 25 --block-s 2.5 deepspeed=z3 dist.nproc_per_node=2

Both contenders train the built-in job (tiny_llava on `shapes`, micro batch 32; extra arguments are
train.py overrides). The hand loop is what a competent user writes, on what the train.py run wrote:
the same `ds_config.json` (the dict given to `deepspeed.initialize`), cached model and processor,
ZeRO-3 weights partitioned at load (HfDeepSpeedConfig), the same data cache, collator and DataLoader
settings (DistributedSampler with the same seed, persistent workers, drop_last), the same ranks
(torchrun) and threads per rank; it reads the loss once per step and writes one line per step (as
train.py writes its metrics line). With `--wandb` train.py logs to W&B (offline); the hand loop does not.

Alternating blocks (the default). This VM's speed drifts by 10-25% over tens of seconds, in CPU time
as well as wall time, so whole runs one after the other cannot resolve a few %. Each launch starts one
process tree of each contender, lets both pass --skip steps, then resumes one tree (SIGCONT) for
--block-s seconds while the other is paused (SIGSTOP), and the other way round, --pairs times: the two
never run at once and neighbouring blocks share the machine's state. Per block: rank 0's process CPU
time per step (`perf/step_cpu_s`, every thread of the rank; measured the same way in the hand loop),
its main thread's, the whole process tree's (launcher, ranks, DataLoader workers, W&B's service)
per step, and the wall per step; the first step of a block straddles the pause and is left out.
The ratio train.py / hand loop is the geometric mean over block pairs with a 95% Student-t interval
over their log ratios; each launch's own ratio is printed too (launches differ by more than blocks).
Both run "forever" and are killed after the last block. --repeats is the number of launches.

`--sequential`: whole runs of --steps steps, A B B A ..., each in a fresh process tree (ratios of
neighbouring runs; CPU per step over steps skip+1..steps-1; the period as seen from outside).
Each run or launch starts only once other processes use under --max-foreign-cpu (default 10%) of
the CPU over 2 s. `--work-dir` keeps the timings; `--report WORK_DIR...` prints the table again, pooled.

`--hand-loop REF_RUN_DIR --out FILE` runs one hand loop (what the benchmark starts, under torchrun
when the reference run has several ranks).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _common as common

# Student t 0.975 quantiles by degrees of freedom (1-30); beyond, the normal 1.96 is close enough.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131]
T975 += [2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
KEYS = {
    "cpu_s": "CPU/step ms",
    "thread_cpu_s": "thread CPU ms",
    "tree_cpu_s": "tree CPU ms",
    "step_s": "step ms",
    "period_s": "period ms",
}


# ----------------------------------------------------------------------------- statistics
def steady(run: dict[str, Any], skip: int) -> dict[str, float]:
    """Steady-state figures of one run over steps skip+1..end-1 (step numbers start at 1)."""
    window = slice(skip, len(run["step_times"]) - 1)
    ends = run.get("line_ends") or run["step_ends"]
    return {
        "cpu_s": statistics.fmean(run["step_cpu"][window]),
        "thread_cpu_s": statistics.fmean(run["step_thread_cpu"][window]),
        "tree_cpu_s": run.get("tree_cpu_per_step", math.nan),
        "step_s": statistics.fmean(run["step_times"][window]),
        "period_s": common.period(ends, skip),
        "peak_mib": run["peak_bytes"] / 2**20,
        "foreign_cpu": run.get("foreign_cpu", math.nan),
    }


def ratio_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Geometric mean of a[i] / b[i] and its 95% confidence interval (t over the log ratios)."""
    logs = [math.log(x / y) for x, y in zip(a, b, strict=False) if x > 0 and y > 0]
    if len(logs) < 2:
        return (math.exp(logs[0]) if logs else math.nan), math.nan, math.nan
    mean, spread = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    t = T975[len(logs) - 2] if len(logs) - 1 <= len(T975) else 1.96
    return math.exp(mean), math.exp(mean - t * spread), math.exp(mean + t * spread)


# ----------------------------------------------------------------------------- the hand-written loop
def hand_loop(ref_run: Path, steps: int, out: Path) -> None:
    """forward / backward / step with plain DeepSpeed; per-step times written to `out` as JSON."""
    import logging
    import random

    import numpy as np
    import torch

    if "WORLD_SIZE" not in os.environ:  # torchrun sets them for several ranks
        common.single_rank_env()
    import deepspeed
    from deepspeed.utils import logger as deepspeed_logger
    from torch.utils.data import DataLoader, DistributedSampler

    from launcher.data.cache import CachedCollator, CachedDataset, cache_key
    from launcher.data.length import LengthLimit
    from launcher.model.loading import load_model_and_processor
    from launcher.train.ops import prepare_ops

    deepspeed_logger.setLevel(logging.WARNING)  # the recipe quiets it too (it logs every config key)
    cfg, ds_config, records, model_dir = common.reference_inputs(ref_run)
    prepare_ops()  # no 50 s build of the shared-memory comm op that neither side's training uses
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    seed = int(cfg.train.seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    stage3 = ds_config["zero_optimization"]["stage"] == 3
    if stage3:  # weights partitioned as they load, as any ZeRO-3 user of transformers does
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 (transformers reads it while loading)
    model, processor = load_model_and_processor(model_dir)
    model.config.use_cache = False  # no KV cache while training, as the recipe sets
    # The data cache train.py built (named by what it holds: records, processor, model). Found by its
    # key, not from summary.json: in alternating blocks the reference run is still training.
    base_model = str(Path(model_dir).resolve()) if Path(model_dir).is_dir() else str(model_dir)
    cache_root = Path(cfg.cache_dir).expanduser().absolute() / "data_cache"
    key = cache_key(records, processor, base_model, LengthLimit.of(cfg.data), str(cfg.data.cache_images))
    dataset = CachedDataset(cache_root / key, processor)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    workers = int(cfg.data.num_workers)
    loader = DataLoader(
        dataset,
        batch_size=ds_config["train_micro_batch_size_per_gpu"],
        sampler=sampler,
        drop_last=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        # at ZeRO-3 on several ranks every batch needs the vision tower (train.py's modality guard)
        collate_fn=CachedCollator(processor, image_every_batch=stage3 and world > 1),
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
    step_times, step_ends, losses, cpu, thread_cpu = [], [], [], [], []
    lines = open(out.with_suffix(".steps"), "w") if rank == 0 else None  # noqa: SIM115 (open for the loop)
    engine.train()
    cpu_mark, thread_mark = time.process_time(), time.thread_time()
    for step in range(1, steps + 1):
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
        now_cpu, now_thread = time.process_time(), time.thread_time()
        cpu.append(now_cpu - cpu_mark)
        thread_cpu.append(now_thread - thread_mark)
        cpu_mark, thread_mark = now_cpu, now_thread
        step_times.append(end - start)
        step_ends.append(end)
        if lines is not None:  # what train.py's metrics line holds of it (--alternate reads these)
            lines.write(
                json.dumps(
                    {
                        "step": step,
                        "loss": losses[-1],
                        "cpu": cpu[-1],
                        "thread_cpu": thread_cpu[-1],
                        "step_time": step_times[-1],
                    }
                )
                + "\n"
            )
            lines.flush()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # After the timed loop: the ranks' mean loss per step, which is what train.py records.
    mean_losses = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(mean_losses)
    if rank == 0:
        lines.close()
        result = {
            "step_times": step_times,
            "step_ends": step_ends,
            "step_cpu": cpu,
            "step_thread_cpu": thread_cpu,
            "peak_bytes": peak,
            "loss": (mean_losses / world).tolist(),
        }
        out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- alternating blocks
class Contender:
    """One contender's process tree, paused (SIGSTOP) and resumed (SIGCONT) as a whole, and the step
    lines it has written (train.py's metrics.jsonl, or the hand loop's `.steps` file)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], lines: Path, log: Path) -> None:
        self.name, self.command, self.env, self.lines, self.log = name, command, env, lines, log
        self.process: Any = None
        self._offset = 0
        self.done: list[dict[str, Any]] = []

    def start(self) -> None:
        self.lines.unlink(missing_ok=True)
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                self.command, cwd=common.ROOT, env=self.env, stdout=log, stderr=log, start_new_session=True
            )

    def tree(self) -> list[Any]:
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal(self, signum: int) -> None:
        import psutil

        for process in self.tree():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signum)

    def read(self) -> list[dict[str, Any]]:
        """Step lines written since the last read (whole lines only)."""
        try:
            with open(self.lines, "rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        whole = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(whole)
        new = [json.loads(line) for line in whole.decode().splitlines() if line.strip()]
        self.done += new
        return new

    def wait_for(self, steps: int, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while len(self.done) < steps:
            if self.process.poll() is not None:
                tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: no step {steps} within {timeout:.0f} s")
            self.read()
            time.sleep(0.01)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()


def step_figures(line: dict[str, Any]) -> dict[str, float]:
    """CPU, main-thread CPU and wall of one step, from either contender's step line."""
    if "perf/step_cpu_s" in line:  # train.py's metrics.jsonl
        return {
            "cpu_s": line["perf/step_cpu_s"],
            "thread_cpu_s": line["perf/step_main_thread_cpu_s"],
            "step_s": line["perf/step_time_s"],
        }
    return {"cpu_s": line["cpu"], "thread_cpu_s": line["thread_cpu"], "step_s": line["step_time"]}


def run_block(contender: Contender, seconds: float) -> dict[str, float]:
    """Resume the contender for `seconds`, pause it; its figures over the steps it finished meanwhile.

    The first step finished in a block began before the pause that ended the previous block: its wall
    holds the pause and its caches were cold, so it is left out of the per-step figures (CPU clocks
    stop while paused). Tree CPU is the tree's CPU seconds over the block per step finished."""
    tree_before = common.tree_cpu_seconds(contender.process.pid)
    contender.signal(signal.SIGCONT)
    time.sleep(seconds)
    contender.signal(signal.SIGSTOP)
    time.sleep(0.05)  # the signal is delivered at once; let a line being written land
    lines = contender.read()
    tree_after = common.tree_cpu_seconds(contender.process.pid)
    if len(lines) < 3:
        raise RuntimeError(
            f"{contender.name} finished {len(lines)} steps in a {seconds} s block: use a longer --block-s"
        )
    steps = [step_figures(line) for line in lines[1:]]
    figures = {key: statistics.fmean(step[key] for step in steps) for key in ("cpu_s", "thread_cpu_s", "step_s")}
    figures["tree_cpu_s"] = (tree_after - tree_before) / len(lines)
    figures["steps"] = len(lines)
    return figures


def alternate(work: Path, index: int, args: Any, train_env: dict, hand_env: dict, launcher: list[str] | None) -> Path:
    """One launch of each contender, run in alternating blocks; the blocks go to work/alternate_INDEX.json."""
    endless = 10**6  # both train "forever" (the same schedule) and are killed after the last block
    run_dir = work / f"train_py_{index}"
    shutil.rmtree(run_dir, ignore_errors=True)
    train_command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"train.max_steps={endless}"]
    train_command += [*common.QUIET_JOB, *args.overrides]
    a = Contender("train.py", train_command, train_env, run_dir / "metrics.jsonl", work / f"train_py_{index}.log")
    out = work / f"hand_{index}.json"
    hand_command = [*(launcher or [sys.executable]), str(Path(__file__).resolve()), "--hand-loop", str(run_dir)]
    hand_command += ["--out", str(out), "--steps", str(endless)]
    b = Contender("hand loop", hand_command, hand_env, out.with_suffix(".steps"), work / f"hand_{index}.log")
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    try:
        if args.max_foreign_cpu > 0:
            common.wait_for_quiet(args.max_foreign_cpu)
        a.start()
        a.wait_for(args.skip)  # past start-up and warm-up, then paused while the other starts
        a.signal(signal.SIGSTOP)
        b.start()
        b.wait_for(args.skip)
        b.signal(signal.SIGSTOP)
        a.read(), b.read()
        pairs = []
        busy, own, wall = common.machine_busy_seconds(), common.own_cpu_seconds(), time.perf_counter()
        for pair in range(args.pairs):
            order = (a, b) if pair % 2 == 0 else (b, a)  # each goes first equally often
            blocks = {contender.name: run_block(contender, args.block_s) for contender in order}
            pairs.append({"train_py": blocks["train.py"], "hand": blocks["hand loop"]})
            print(
                f"  launch {index} pair {pair}: train.py {blocks['train.py']['cpu_s'] * 1e3:.1f}, "
                f"hand loop {blocks['hand loop']['cpu_s'] * 1e3:.1f} ms CPU/step",
                file=sys.stderr,
            )
        # What the machine did beyond this script and the contenders (which run only in their blocks).
        contenders = sum(p[who]["tree_cpu_s"] * p[who]["steps"] for p in pairs for who in ("train_py", "hand"))
        others = common.machine_busy_seconds() - busy - (common.own_cpu_seconds() - own) - contenders
        foreign = max(0.0, others) / ((time.perf_counter() - wall) * (os.cpu_count() or 1))
    finally:
        a.kill()
        b.kill()
        for segment in set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) - shm_before:
            segment.unlink(missing_ok=True)  # left by the killed ranks (66 MB each)
    same = {line["step"]: line["train/loss"] for line in a.done}
    differences = [abs(same[line["step"]] - line["loss"]) for line in b.done if line["step"] in same]
    result = {
        "argv": sys.argv[1:],
        "pairs": pairs,
        "foreign_cpu": foreign,
        "loss_difference": max(differences) if differences else None,
        "world_size": json.loads((run_dir / "job.json").read_text())["world_size"],
    }
    path = work / f"alternate_{index}.json"
    path.write_text(json.dumps(result))
    return path


def report_alternating(works: list[Path]) -> None:
    """The table of kept --alternate launches (pooled over `works`)."""
    launches = [json.loads(path.read_text()) for work in works for path in sorted(work.glob("alternate_*.json"))]
    pairs = [pair for launch in launches for pair in launch["pairs"]]
    keys = {key: label for key, label in KEYS.items() if key != "period_s"}
    print(f"; {len(launches)} launches, {len(pairs)} block pairs; {launches[0]['argv']}\n")
    print(f"| contender (median of blocks) | {' | '.join(keys.values())} |")
    print("|---|" + "---|" * len(keys))
    for name, who in (("`python train.py`", "train_py"), ("hand-written DeepSpeed loop", "hand")):
        cells = " | ".join(f"{statistics.median(p[who][key] for p in pairs) * 1e3:.2f}" for key in keys)
        print(f"| {name} | {cells} |")
    intervals = {
        key: ratio_interval([p["train_py"][key] for p in pairs], [p["hand"][key] for p in pairs]) for key in keys
    }
    cells = " | ".join(f"**{mid:.4f}** [{low:.4f}, {high:.4f}]" for mid, low, high in intervals.values())
    print(f"| **train.py / hand loop** (geometric mean of block-pair ratios, 95% CI) | {cells} |")
    for number, launch in enumerate(launches):
        mids = []
        for key in keys:
            mid, _, _ = ratio_interval(
                [p["train_py"][key] for p in launch["pairs"]], [p["hand"][key] for p in launch["pairs"]]
            )
            mids.append(f"{keys[key]} {mid:.4f}")
        print(f"\nlaunch {number}: " + ", ".join(mids), end="")
        steps = statistics.median(p["hand"]["steps"] for p in launch["pairs"])
        print(f"; others used {launch['foreign_cpu']:.0%} of the CPU; ~{steps:.0f} steps per block", end="")
        if launch["world_size"] == 1 and launch["loss_difference"] is not None:
            print(f"; largest loss difference at the same step {launch['loss_difference']:.2g}", end="")
    print()


# ----------------------------------------------------------------------------- the benchmark
def main() -> None:
    def options(parser: Any) -> None:
        parser.add_argument("--wandb", action="store_true", help="train.py logs to W&B (offline mode)")
        parser.add_argument(
            "--sequential",
            action="store_true",
            help="whole runs one after the other (A B B A ...) instead of alternating blocks of one launch each",
        )
        parser.add_argument("--pairs", type=int, default=40, help="alternating mode: block pairs per launch")
        parser.add_argument("--block-s", type=float, default=1.5, help="alternating mode: seconds per block")

    parser = common.benchmark_parser(__doc__.splitlines()[0], repeats=2, worker_flag="--hand-loop", options=options)
    args = common.parse_args(parser)
    if args.worker:
        hand_loop(args.worker, args.steps, args.out)
        return
    if args.report:
        report(args.report, args.skip)
        return
    nproc = next((int(o.split("=", 1)[1]) for o in args.overrides if o.startswith("dist.nproc_per_node=")), 1)
    train_env = common.bench_env()
    if args.wandb:
        args.overrides = [*args.overrides, "logger=wandb"]
        train_env["WANDB_MODE"] = "offline"
    hand_env = common.bench_env()
    # What launcher/processes.py gives each rank: this machine's cores shared between the ranks.
    hand_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    launcher = None
    if nproc > 1:
        from launcher.launch.ranks import free_port

        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        launcher += ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]

    with common.work_dir(args.work_dir, "bench-overhead-") as work:
        (work / "command.json").write_text(json.dumps({"argv": sys.argv[1:], "wandb": args.wandb}))
        started = time.perf_counter()
        if not args.sequential:
            for index in range(args.repeats):
                alternate(work, index, args, train_env, hand_env, launcher)
            print(f"\n{time.perf_counter() - started:.0f} s in all", end="")
            report([work], args.skip)
            return
        window = (args.skip, args.steps - 1)

        def progress(run: dict[str, Any], _seconds: float) -> str:
            row = steady(run, args.skip)
            return f"{row['cpu_s'] * 1e3:.1f} ms CPU/step, {row['step_s'] * 1e3:.1f} ms/step"

        seconds = common.run_interleaved(
            work,
            args,
            worker_flag="--hand-loop",
            worker_name="hand",
            worker_extra=[],
            progress=progress,
            train_kwargs={"env": train_env, "cpu_window": window},
            worker_kwargs={"env": hand_env, "launcher": launcher, "cpu_window": window},
        )
        print(f"\n{seconds:.0f} s in all", end="")
        report([work], args.skip)


def report(works: list[Path], skip: int) -> None:
    """The table, from the timings runs of this benchmark kept in `works` (pooled when several)."""
    if any(work.glob("alternate_*.json") for work in works):
        report_alternating(works)
        return
    train_runs, hand_runs = common.load_paired_runs(works, "hand")
    a = [steady(run, skip) for run in train_runs]
    b = [steady(run, skip) for run in hand_runs]
    steps = len(hand_runs[0]["step_times"])
    command = json.loads((works[0] / "command.json").read_text()) if (works[0] / "command.json").exists() else {}
    print(f"; {len(a)} and {len(b)} runs, steps {skip + 1}-{steps - 1}, interleaved; {command.get('argv', '')}\n")
    print(f"| contender | {' | '.join(KEYS.values())} | peak RSS MiB |")
    print("|---|" + "---|" * (len(KEYS) + 1))
    for name, rows in (("`python train.py`", a), ("hand-written DeepSpeed loop", b)):
        figures = " | ".join(f"{common.median_of(rows, key) * 1e3:.2f}" for key in KEYS)
        print(f"| {name} (median of runs) | {figures} | {common.median_of(rows, 'peak_mib'):.0f} |")
    intervals = {key: ratio_interval([r[key] for r in a], [r[key] for r in b]) for key in KEYS}
    cells = " | ".join(f"**{mid:.3f}** [{low:.3f}, {high:.3f}]" for mid, low, high in intervals.values())
    print(f"| **train.py / hand loop** (geometric mean of paired ratios, 95% CI) | {cells} | |")
    for key, label in KEYS.items():
        pairs = common.paired_ratios(a, b, key)
        print(f"\npaired ratios, {label}: {', '.join(f'{r:.3f}' for r in pairs)}", end="")
    print()
    difference = max(abs(x - y) for run in hand_runs for x, y in zip(train_runs[0]["loss"], run["loss"], strict=False))
    print(f"same job: largest difference between the loss curves of train.py and the hand loop {difference:.2g}")
    for name, rows in (("train.py", a), ("hand loop", b)):
        shares = ", ".join(f"{row['foreign_cpu']:.0%}" for row in rows)
        print(f"CPU share other processes used during each run, {name}: {shares}")


if __name__ == "__main__":
    main()
