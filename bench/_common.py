"""What overhead.py, vs_hf_trainer.py and presets.py share: running contenders on a quiet machine.

Every benchmarked process gets the same environment (`bench_env`: a private DeepSpeed op cache, no
W&B). A run starts once other processes leave the CPU alone (`wait_for_quiet`) and is run again when
they loaded it meanwhile (`measured`, `ForeignLoad`). Two contenders alternate A B B A A B ...
(`run_interleaved`), so run i of each ran next to the other and shares the machine's state of the
moment; reports pair them again (`load_paired_runs`, `paired_ratios`).
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The built-in job, short and without what is not training: no W&B, no periodic eval, no generation.
QUIET_JOB = ["logger=none", "train.eval_every=0", "data.eval_accuracy=false"]


# ----------------------------------------------------------------------------- a quiet machine
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


# ----------------------------------------------------------------------------- running contenders
def process_cpu_seconds(process: Any) -> float:
    """User + system CPU seconds of one psutil.Process (0 once it is gone)."""
    import psutil

    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) a process and its living descendants have used: a contender's whole
    cost (launcher, ranks, DataLoader workers, W&B's service process)."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return math.nan
    return sum(process_cpu_seconds(process) for process in processes)


def run_watched(
    command: list[str],
    watch: Path,
    log: Path,
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    cpu_window: tuple[int, int] | None = None,
) -> tuple[list[float], float, float]:
    """Run `command`; the perf_counter time at which each new line of `watch` was seen, the share of
    the CPU other processes used meanwhile (ForeignLoad), and the process tree's CPU seconds between
    the moments `watch` reached cpu_window's two line counts (NaN without a window).

    Polls the file's size every millisecond. Raises RuntimeError (with the log's tail) on failure.
    """
    seen: list[float] = []
    size = 0
    marks: dict[int, float] = {}
    started = time.perf_counter()
    load = ForeignLoad()
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, cwd=ROOT, env=env or bench_env(), stdout=log_file, stderr=subprocess.STDOUT)
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
                    for mark in cpu_window or ():
                        if mark not in marks and len(seen) >= mark:
                            marks[mark] = tree_cpu_seconds(process.pid)
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
    tree_cpu = math.nan
    if cpu_window and len(marks) == 2:
        first, last = cpu_window
        tree_cpu = (marks[last] - marks[first]) / (last - first)
    return seen, load.share(), tree_cpu


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_train_py(
    run_dir: Path,
    steps: int,
    extra: list[str],
    timeout: float = 900,
    *,
    env: dict[str, str] | None = None,
    cpu_window: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One fresh `python train.py` run; its per-step times, metrics-line times and summary."""
    command = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", f"train.max_steps={steps}", *QUIET_JOB, *extra]
    shutil.rmtree(run_dir, ignore_errors=True)  # a run again must not append to an earlier metrics.jsonl
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    line_times, foreign, tree_cpu = run_watched(
        command, run_dir / "metrics.jsonl", log, timeout, env=env, cpu_window=cpu_window
    )
    metrics = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "step_times": [m["perf/step_time_s"] for m in metrics],
        "step_cpu": [m.get("perf/step_cpu_s", math.nan) for m in metrics],
        "step_thread_cpu": [m.get("perf/step_main_thread_cpu_s", math.nan) for m in metrics],
        "tree_cpu_per_step": tree_cpu,
        "step_ends": line_times,
        "loss": [m["train/loss"] for m in metrics],
        "peak_bytes": summary["peak_memory_bytes"],
        "summary": summary,
        "foreign_cpu": foreign,
    }


def run_worker(
    flag: str,
    ref_run: Path,
    out: Path,
    steps: int,
    extra: list[str],
    timeout: float = 900,
    *,
    launcher: list[str] | None = None,
    env: dict[str, str] | None = None,
    cpu_window: tuple[int, int] | None = None,
) -> dict:
    """Run the running script's worker mode `flag` in a fresh process (under `launcher`, e.g. torchrun,
    when given), under the same poller as train.py; the worker may write a line per step to
    `out`.steps for the poller to see."""
    script = Path(sys.argv[0]).resolve()
    command = [*(launcher or [sys.executable]), str(script), flag, str(ref_run), "--out", str(out)]
    command += ["--steps", str(steps), *extra]
    out.with_suffix(".steps").unlink(missing_ok=True)
    line_times, foreign, tree_cpu = run_watched(
        command, out.with_suffix(".steps"), out.with_suffix(".log"), timeout, env=env, cpu_window=cpu_window
    )
    timings = json.loads(out.read_text())
    return {**timings, "foreign_cpu": foreign, "tree_cpu_per_step": tree_cpu, "line_ends": line_times}


# ----------------------------------------------------------------------------- a worker process
def single_rank_env() -> None:
    """One rank on this machine, as launcher/launch/ranks.py sets it for a rank it starts."""
    from launcher.launch.ranks import free_port

    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(free_port())


def reference_inputs(ref_run: Path) -> tuple[Any, dict[str, Any], list[dict], str]:
    """The typed config, DeepSpeed dict, train records and model directory of a train.py run (its job.json)."""
    from launcher.data.records import read_data
    from launcher.job.planning import cache_dir
    from launcher.job.spec import read_job

    job = read_job(ref_run)
    loaded = read_data(job.config.data, cache_dir(job.config))
    # The same directory train.py loaded (a tiny model's name hashes its settings and vocabulary).
    return job.config, job.ds_config, loaded.train, str(job.model_path)


# ----------------------------------------------------------------------------- two contenders
def benchmark_parser(
    description: str,
    *,
    repeats: int,
    worker_flag: str,
    foreign_cpu_help: str = "start runs when other processes use less than this share of the CPU, and run again "
    "one during which they used more (up to 3 times; 0 turns this off)",
    options: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.ArgumentParser:
    """The options of a two-contender benchmark; `options` adds the script's own after --repeats.

    The hidden `worker_flag REF_RUN_DIR --out FILE` (stored as `worker`) is the mode `run_worker` starts."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out of the figures")
    parser.add_argument("--repeats", type=int, default=repeats, help="runs of each contender")
    if options:
        options(parser)
    parser.add_argument("--work-dir", type=Path, help="keep run directories and timings here (default: temporary)")
    parser.add_argument(
        "--report", type=Path, nargs="+", metavar="WORK_DIR", help="print the table of kept --work-dirs (pooled)"
    )
    parser.add_argument("--max-foreign-cpu", type=float, default=0.10, help=foreign_cpu_help)
    parser.add_argument(worker_flag, dest="worker", type=Path, metavar="REF_RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides for both, e.g. precision=bf16")
    return parser


def parse_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The command line; outside worker mode, --skip must leave steps to measure."""
    args = parser.parse_args()
    if not args.worker and (args.skip < 1 or args.steps <= args.skip):
        parser.error("need 1 <= --skip < --steps")
    return args


@contextlib.contextmanager
def work_dir(keep: Path | None, prefix: str) -> Iterator[Path]:
    """`keep` (created) when given, else a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        yield work


def interleaved_order(repeats: int) -> list[str]:
    """A B B A A B ...: each contender goes first equally often, and A comes first (B needs its files)."""
    order: list[str] = []
    for index in range(repeats):
        order += ["A", "B"] if index % 2 == 0 else ["B", "A"]
    return order


def run_interleaved(
    work: Path,
    args: argparse.Namespace,
    *,
    worker_flag: str,
    worker_name: str,
    worker_extra: list[str],
    progress: Callable[[dict[str, Any], float], str],
    train_kwargs: dict[str, Any] | None = None,
    worker_kwargs: dict[str, Any] | None = None,
) -> float:
    """`args.repeats` runs of train.py (A) and of the worker (B) in interleaved order; seconds in all.

    Each run's timings go to `work`/train_py_I.json or `work`/`worker_name`_I.json; the worker trains
    on what train_py_0 wrote. `progress(run, seconds so far)` says on stderr how each run went.
    `train_kwargs` and `worker_kwargs` go to run_train_py and run_worker."""
    counts = {"A": 0, "B": 0}
    started = time.perf_counter()
    for contender in interleaved_order(args.repeats):
        index = counts[contender]
        counts[contender] += 1
        if contender == "A":
            out = work / f"train_py_{index}.json"
            run = measured(
                lambda i=index: run_train_py(
                    work / f"train_py_{i}", args.steps, args.overrides, **(train_kwargs or {})
                ),
                args.max_foreign_cpu,
            )
        else:
            out = work / f"{worker_name}_{index}.json"
            run = measured(
                lambda out=out: run_worker(
                    worker_flag, work / "train_py_0", out, args.steps, worker_extra, **(worker_kwargs or {})
                ),
                args.max_foreign_cpu,
            )
        out.write_text(json.dumps(run))
        print(
            f"  {contender}{index}: {progress(run, time.perf_counter() - started)}, "
            f"others used {run['foreign_cpu']:.0%} of the CPU",
            file=sys.stderr,
        )
    return time.perf_counter() - started


def load_paired_runs(works: list[Path], worker_name: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The kept runs of train.py and of the worker, in run order, pooled over `works`."""

    def runs(pattern: str) -> list[dict[str, Any]]:
        found = []
        for work in works:  # run i of each contender ran next to each other: they stay paired
            paths = sorted(work.glob(pattern), key=lambda path: int(path.stem.rsplit("_", 1)[1]))
            found += [json.loads(path.read_text()) for path in paths]
        return found

    return runs("train_py_*.json"), runs(f"{worker_name}_*.json")


# ----------------------------------------------------------------------------- statistics
def period(ends: list[float], skip: int) -> float:
    """Wall per step from the end of step `skip` to the end of the step before the last.

    The last step is left out: train.py evaluates after it and before writing its metrics line."""
    return (ends[-2] - ends[skip - 1]) / (len(ends) - 1 - skip)


def median_of(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def paired_ratios(a: list[dict[str, float]], b: list[dict[str, float]], key: str) -> list[float]:
    """a[i][key] / b[i][key] for each pair of neighbouring runs.

    Neighbouring runs share the machine's state of the moment (it drifts between levels several % apart),
    so the ratio of each pair, then their median, is steadier than the ratio of the two medians."""
    return [x[key] / y[key] for x, y in zip(a, b, strict=False)]


def print_markdown_table(rows: list[dict[str, Any]]) -> None:
    """Rows of one shape (their first row's keys) as a Markdown table, as BENCHMARKS.md records them."""
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[key]) for key in keys) + " |")
