"""What a process's end costs: Python's own exit against `launcher.core.children.exit_without_teardown`, which
train.py, each rank, torch's launcher and the `python -m launcher.*` commands end through.

    python bench/process_end.py --repeats 6

Three kinds of process, each run `--repeats` times both ways, alternating (A B B A ...), one process at a time:

- rank: a rank of the built-in job that trains 2 steps (`python -m launcher.launch.worker RUN_DIR` on a copy of
  one planned run; Python's exit: the same `main` called from `python -c`, whose end is Python's);
- launcher: what train.py imports before its ranks start (launcher.launch.run, DeepSpeed), then its end;
- torchrun: torch's launcher's imports (torch.distributed.run), then its end.

Prints a Markdown table: each way's median CPU seconds (this process's children: user + system) and wall
seconds, and the CPU ratio exit_without_teardown / Python's exit as the geometric mean of the pairs with its
95% confidence interval (t over the log ratios).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
from _common import QUIET_JOB, ROOT, bench_env, interleaved_order, print_markdown_table, work_dir
from overhead import ratio_interval

from launcher.launch.ranks import free_port

WITHOUT_TEARDOWN = "from launcher.core.children import exit_without_teardown\nwith exit_without_teardown():\n    pass\n"
IMPORTS = {
    "launcher": "import deepspeed, launcher.launch.run, launcher.job.spec\n",
    "torchrun": "import torch.distributed.run\n",
}
RANK_PYTHON_EXIT = "import sys\nfrom launcher.launch.worker import main\nsys.exit(main([sys.argv[1]]))\n"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(CPU s, wall s) of one process run to its end."""
    env = {**env, "MASTER_PORT": str(free_port())}  # a rank's: a port of its own
    cpu, wall = children_cpu(), time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True)
    return children_cpu() - cpu, time.perf_counter() - wall


def planned_run(work: Path, env: dict[str, str]) -> Path:
    """A run of the built-in job trained once by train.py (its model, data cache and ops built): its plan."""
    run_dir = work / "planned"
    env = {**env, "MASTER_PORT": str(free_port())}
    subprocess.run(
        [sys.executable, "train.py", "train.max_steps=2", *QUIET_JOB, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )  # fmt: skip
    return run_dir


def rank_commands(planned: Path, work: Path, index: int, way: str) -> list[str]:
    """A fresh run directory holding the planned job; the rank's command that trains it."""
    run_dir = work / f"rank-{way}-{index}"
    run_dir.mkdir()
    for name in ("job.json", "ds_config.json"):
        shutil.copy(planned / name, run_dir / name)
    if way == "without teardown":
        return [sys.executable, "-m", "launcher.launch.worker", str(run_dir)]
    return [sys.executable, "-c", RANK_PYTHON_EXIT, str(run_dir)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--kinds", nargs="+", default=["rank", "launcher", "torchrun"])
    args = parser.parse_args()
    env = {**bench_env(), "OMP_NUM_THREADS": "1"}  # as each of the tests' two processes runs
    env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    env["MASTER_ADDR"] = "127.0.0.1"
    rows = []
    with work_dir(None, "process_end-") as work:
        planned = planned_run(work, env) if "rank" in args.kinds else None
        for kind in args.kinds:
            measured: dict[str, list[tuple[float, float]]] = {"python's exit": [], "without teardown": []}
            for contender in interleaved_order(args.repeats):
                way = "python's exit" if contender == "A" else "without teardown"
                index = len(measured[way])
                if kind == "rank":
                    command = rank_commands(planned, work, index, way)
                else:
                    code = IMPORTS[kind] + (WITHOUT_TEARDOWN if way == "without teardown" else "")
                    command = [sys.executable, "-c", code]
                measured[way].append(timed(command, env))
                print(f"  {kind} {way} {index}: {measured[way][-1][0]:.2f} CPU s", file=sys.stderr)
            python, fast = measured["python's exit"], measured["without teardown"]
            ratio, low, high = ratio_interval([cpu for cpu, _ in fast], [cpu for cpu, _ in python])
            rows.append(
                {
                    "process": kind,
                    "CPU s, Python's exit": f"{statistics.median(cpu for cpu, _ in python):.2f}",
                    "CPU s, without teardown": f"{statistics.median(cpu for cpu, _ in fast):.2f}",
                    "wall s, Python's exit": f"{statistics.median(wall for _, wall in python):.2f}",
                    "wall s, without teardown": f"{statistics.median(wall for _, wall in fast):.2f}",
                    "CPU ratio (95% CI)": f"{ratio:.2f} ({low:.2f}-{high:.2f})",
                    "pairs": len(fast),
                }
            )
    print_markdown_table(rows)


if __name__ == "__main__":
    main()
