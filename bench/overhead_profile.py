"""Where a step's time goes: cProfile of one `train.py` rank against one hand-loop rank, same job.

    .venv/bin/python bench/overhead_profile.py --steps 60                 # ZeRO 0, fp32, 1 rank
    .venv/bin/python bench/overhead_profile.py --steps 60 --wandb         # train.py logging to W&B (offline)
    .venv/bin/python bench/overhead_profile.py --steps 40 deepspeed=z3 dist.nproc_per_node=2

A reference `python train.py` run (extra arguments are its overrides) builds the caches and the run
directory. Then rank 0 of each contender runs again under cProfile, started the way their launchers
start them: train.py's rank as `python -m launcher.launch.worker RUN_DIR` on a copy of the reference run, the
hand loop as `bench/overhead.py --hand-loop` (both under torchrun with several ranks). The table gives
milliseconds per step (cumulative time / steps) of the loop and of each thing the launcher does per
step beyond the hand loop, and of what both do (forward, backward, optimizer step, next batch).
cProfile's own cost per Python call inflates Python-heavy rows alike in both contenders.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _common as common

# (label, module file suffix, function name): the rows of the table, in order.
ROWS: list[tuple[str, str, str]] = [
    ("train.py's step (`recipe.train_step`)", "launcher/recipe.py", "train_step"),
    ("engine forward", "deepspeed/runtime/engine.py", "forward"),
    ("engine backward", "deepspeed/runtime/engine.py", "backward"),
    ("engine step", "deepspeed/runtime/engine.py", "step"),
    ("next batch (DataLoader)", "torch/utils/data/dataloader.py", "__next__"),
    ("batch to device", "launcher/recipe.py", "_to_device"),
    ("gradient norm (ZeRO 0 fp32; before: a second pass)", "launcher/recipe.py", "_unpartitioned_grad_norm"),
    ("DeepSpeed's clipping (ZeRO 0 fp32, both loops)", "deepspeed/runtime/utils.py", "clip_grad_norm_"),
    ("DeepSpeed's norm read", "launcher/recipe.py", "_grad_norm"),
    ("loss/token all-reduce", "launcher/recipe.py", "_all_reduce_sum"),
    ("peak memory read", "launcher/recipe.py", "_peak_memory_bytes"),
    ("stop-signal agreement (before: its own all-reduce)", "launcher/checkpoint.py", "agreed"),
    ("stop request read (after: voted in the step's all-reduce)", "launcher/checkpoint.py", "wanted"),
    ("watchdog (arm, disarm)", "launcher/watchdog.py", "step"),
    ("  step-in-flight file", "launcher/watchdog.py", "_mark"),
    ("metrics record (file + W&B + progress)", "launcher/recipe.py", "record"),
    ("  metrics.jsonl line", "launcher/rundir.py", "write"),
    ("  W&B log", "launcher/wandb_logger.py", "log"),
    ("  progress", "launcher/recipe.py", "update"),
    ("CPU clock lap", "launcher/recipe.py", "lap"),
]


def rank_main(kind: str, target: Path, out: Path, steps: int) -> None:
    """Run one rank of `kind` ("train" or "hand") under cProfile; rank 0 dumps its stats to `out`."""
    import gc
    import time

    profile = cProfile.Profile()
    rank = int(os.environ.get("RANK", "0"))
    collections: list[tuple[int, float, float]] = []  # (generation, start, seconds) of each collection
    started: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            begin = started.pop()
            collections.append((info["generation"], begin, time.perf_counter() - begin))

    gc.callbacks.append(timed)
    if kind == "train":
        from launcher.launch import worker

        profile.runcall(worker.main, [str(target)])
    else:
        import overhead

        profile.runcall(overhead.hand_loop, target, steps, out.with_suffix(".json"))
    if rank == 0:
        profile.dump_stats(out)
        out.with_suffix(".gc.json").write_text(json.dumps(collections))


def per_step_ms(stats: pstats.Stats, suffix: str, name: str, steps: int) -> float | None:
    """Cumulative ms per step of the function `name` in a file ending with `suffix` (summed over matches)."""
    total, found = 0.0, False
    for (file, _line, function), (_cc, _nc, _tt, cumulative, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        if file.endswith(suffix) and function == name:
            total, found = total + cumulative, True
    return total * 1e3 / steps if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--wandb", action="store_true", help="train.py logs to W&B (offline mode)")
    parser.add_argument("--work-dir", type=Path, default=common.ROOT / "outputs" / "bench" / "overhead_profile")
    parser.add_argument("--rank", nargs=3, metavar=("KIND", "TARGET", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="train.py overrides, e.g. deepspeed=z3 dist.nproc_per_node=2")
    args = parser.parse_args()
    if args.rank:
        kind, target, out = args.rank
        rank_main(kind, Path(target), Path(out), args.steps)
        return

    # A held-out set of one batch: train.py evaluates after its last step (one forward, not a training
    # step, counted in its forward row: 1/steps of a forward).
    overrides = ["data.n_eval=32", *args.overrides, *(["logger=wandb"] if args.wandb else [])]
    env = common.bench_env()
    if args.wandb:
        env["WANDB_MODE"] = "offline"
    nproc = next((int(o.split("=", 1)[1]) for o in overrides if o.startswith("dist.nproc_per_node=")), 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    work = args.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    reference = work / "reference"
    common.run_train_py(reference, args.steps, overrides, env=env)
    again = work / "train_rank"  # the same planned job, trained again from step 0 by its rank alone
    shutil.copytree(reference, again, ignore=shutil.ignore_patterns("checkpoints", "model", "wandb*"))
    for name in ("metrics.jsonl", "summary.json"):
        (again / name).unlink(missing_ok=True)
    from launcher.launch.ranks import free_port

    rows: dict[str, list[float | None]] = {}
    for kind, target in (("train", again), ("hand", reference)):
        out = work / f"{kind}.prof"
        if nproc > 1:
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
            launcher += ["--master_addr=127.0.0.1", f"--master_port={free_port()}"]
            rank_env = env
        else:
            launcher = [sys.executable]
            rank_env = {**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
            rank_env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        command = [*launcher, str(Path(__file__).resolve()), "--steps", str(args.steps)]
        command += ["--rank", kind, str(target), str(out)]
        result = subprocess.run(command, cwd=common.ROOT, env=rank_env, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{kind} rank failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        stats = pstats.Stats(str(out))
        for label, suffix, name in ROWS:
            if kind == "hand" and suffix.startswith("launcher/"):
                rows.setdefault(label, []).append(None)  # not something the hand loop does
                continue
            rows.setdefault(label, []).append(per_step_ms(stats, suffix, name, args.steps))
    print(f"\n{args.steps} steps under cProfile, rank 0; train.py overrides: {' '.join(overrides) or '(none)'}\n")
    print("| ms per step (cumulative) | train.py rank | hand loop |")
    print("|---|---|---|")
    for label, (mine, theirs) in rows.items():
        cells = ["-" if value is None else f"{value:.2f}" for value in (mine, theirs)]
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    (work / "table.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
