"""What a new user meets: README's two set-up-and-go commands, run as written from a fresh clone.

    .venv/bin/python bench/newcomer.py                      # both commands, this checkout's HEAD
    .venv/bin/python bench/newcomer.py --only 1 --out newcomer.json

The commands are read from README.md's first code block (the lines that start with `python3 -m venv`), so
this times exactly what the README says. Each runs in its own fresh clone of HEAD, with empty caches: its
own virtualenv, pip's cache off, empty VLM_LAUNCHER_CACHE and TORCH_EXTENSIONS_DIR, W&B offline (no
account). Each `&&`-joined step is timed on its own: wall seconds and the CPU seconds of its whole
process tree (every descendant is waited for, so `getrusage(RUSAGE_CHILDREN)` counts them). Prints a
Markdown table for BENCHMARKS.md; exits 1 when a step fails, after printing what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands(readme: Path) -> list[str]:
    """README's set-up-and-go commands, in order."""
    block = readme.read_text().split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip().startswith("python3 -m venv")]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_steps(command: str, clone: Path, env: dict[str, str], log: Path) -> list[dict[str, object]]:
    """Each `&&` step of `command`, in one shell that keeps the venv each step activates."""
    steps = [step.strip() for step in command.split("&&")]
    rows: list[dict[str, object]] = []
    done = ""  # the steps before, replayed for their state (cd, an activated venv): cheap ones only
    for step in steps:
        state = f"{done} && " if done else ""
        cpu, start = children_cpu_s(), time.perf_counter()
        with log.open("a") as out:
            out.write(f"\n$ {step}\n")
            out.flush()
            code = subprocess.run(
                ["bash", "-c", f"set -e; {state}{step}"], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT
            ).returncode
        rows.append(
            {"step": step, "wall_s": time.perf_counter() - start, "cpu_s": children_cpu_s() - cpu, "exit": code}
        )
        if code:
            break
        if step.startswith(". ") or step.startswith("source "):
            done = f"{done} && {step}" if done else step
    return rows


def summary_line(log: Path) -> str:
    """The test command's last line (`N passed ...`), or the job's held-out exact match."""
    text = log.read_text()
    passed = re.findall(r"^=*\s*(\d+ passed.*?)\s*=*$", text, flags=re.M)
    if passed:
        return passed[-1]
    match = re.findall(r"(?:exact match|accuracy)\D{0,20}?([01]\.\d+)", text)
    return f"exact match {match[-1]}" if match else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", type=int, choices=(1, 2), default=None, help="run one of the two commands")
    parser.add_argument("--work", type=Path, default=None, help="keep the clones and logs here")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    commands = readme_commands(ROOT / "README.md")
    if len(commands) != 2:
        raise SystemExit(f"README.md: expected two set-up-and-go commands, found {len(commands)}")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    results = []
    with tempfile.TemporaryDirectory(prefix="newcomer_") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for number, command in enumerate(commands, start=1):
            if args.only and number != args.only:
                continue
            clone = work / f"clone{number}"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
            env = {
                key: value
                for key, value in os.environ.items()
                if key not in ("VIRTUAL_ENV", "PYTHONPATH", "WANDB_API_KEY", "HF_TOKEN")
            }
            env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
            env.update(
                {
                    "PIP_NO_CACHE_DIR": "1",
                    "VLM_LAUNCHER_CACHE": str(work / f"cache{number}"),
                    "TORCH_EXTENSIONS_DIR": str(work / f"torch_extensions{number}"),
                    "WANDB_MODE": "offline",
                }
            )
            log = work / f"command{number}.log"
            rows = run_steps(command, clone, env, log)
            results.append({"command": number, "steps": rows, "result": summary_line(log), "log": str(log)})
            print(f"  command {number}: {sum(r['wall_s'] for r in rows):.0f} s", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(f"\nREADME's commands from a fresh clone of {head.strip()} ({platform.node()}, {os.cpu_count()} cores):\n")
    print("| command | step | wall s | CPU s | exit |")
    print("|---|---|---:|---:|---:|")
    failed = False
    for result in results:
        for row in result["steps"]:
            print(
                f"| {result['command']} | `{row['step']}` | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | {row['exit']} |"
            )
            failed |= bool(row["exit"])
        total_wall = sum(r["wall_s"] for r in result["steps"])
        total_cpu = sum(r["cpu_s"] for r in result["steps"])
        print(f"| {result['command']} | **all** ({result['result']}) | {total_wall:.1f} | {total_cpu:.1f} | |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
