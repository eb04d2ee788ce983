"""The GPU check: one command on a bare, lent GPU machine that brings every number back.

    python3 bench/device_check.py                         # on the GPU machine (the device tool): ~7-8 min
    python3 bench/device_check.py --only ops presets --presets z2 z3 z2_offload z3_offload   # a second call
    python bench/device_check.py --cpu                    # here: the same steps on a CPU, tiny sizes (~3 min)

The GPU machine has torch with CUDA, nvcc and ninja but reaches no package registry, so the packages it
lacks travel as wheels in `.whl/` (made here by `bench/device_wheels.sh`; the device tool's `carry`
names `.whl`). Steps, the cheapest evidence first, each under its own time limit and all under one
deadline (`--deadline-s`):

  install   `bench/device_install.sh` installs the carried wheels into a folder of their own (--target,
            no index) and the children get it first on PYTHONPATH; in CPU mode, or without `.whl/`,
            this interpreter's packages are used (`bench/device_dry_run.sh` checks the install here)
  env       Python, torch, CUDA (torch's and nvcc's), the GPU, package versions, DeepSpeed's ds_report
  train     `python train.py` on the tiny built-in model at z0/z2/z3 in bf16 and once in fp16, and two DPO
            runs with their held-out reward accuracy (CPU mode: z0 in bf16, and DPO at z3 in fp32, as fp16 is
            refused): a row per run as it finishes
  ops       JIT-builds the DeepSpeed ops the offload presets use (cpu_adam), each under its own timeout,
            with DS_SKIP_CUDA_CHECK=1 (DeepSpeed otherwise refuses an nvcc whose CUDA version differs
            from torch's), into a folder of its own (TORCH_EXTENSIONS_DIR, default
            /tmp/device_check_torch_extensions) with any lock a killed build left removed first; in CPU
            mode into torch's usual folder, where this machine's runs built them already, locks left alone
  pytest    `pytest -m gpu` (tests/gpu/test_cuda.py, trained in-process: ZeRO 0-3 in bf16 and fp16, loss
            scale, memory metrics, pinned loader, offload, QLoRA, the attention kernel) with each test's
            verdict written to pytest.txt the moment it ends (tests/verdicts.py) and a time limit per test;
            CPU mode rehearses what a CPU can run of the suite (LAUNCHER_GPU_SUITE_ON_CPU=1)
  presets   `bench/gpu_presets.py` (a ~2B-parameter LLaVA per DeepSpeed preset) with the time left

Results are written into $OUT (the device tool's folder; else outputs/bench/device_check/<stamp>) as
each step, row and test finishes, so a call stopped at its limit still brings back what it measured; a
SIGTERM (or SIGINT, SIGHUP) stops the running command, names what it stopped and writes the summary.
The device tool returns at most 8 files from $OUT; these 7 are they:
  summary.md (steps, status, seconds, the train, test and preset tables), env.txt, ops.txt, pytest.txt
  (one JSON line per test start and verdict), presets.jsonl, log.txt (every command's output, in order),
  runs.tar.gz (every run's summary.json, metrics.jsonl, train.log and errors/, the tables as Markdown;
  no weights or checkpoints), rewritten after each step and each run.
Uses the standard library only: it runs before the carried packages are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("install", "env", "train", "ops", "pytest", "presets")
GPU_PRESETS = ["z0", "z1", "z2", "z3", "z2_offload", "z3_offload"]
CPU_PRESETS = ["z0"]
# What builds each op (DeepSpeed's builder classes), for `--ops`.
OP_BUILDERS = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder"}
# What CPU mode sets for the GPU suite (tests/gpu/test_cuda.py) to rehearse what a CPU can run of it.
GPU_SUITE_ON_CPU_ENV = "LAUNCHER_GPU_SUITE_ON_CPU"
# runs.tar.gz leaves out these folders (weights, checkpoints, caches) and any file larger than this.
BULKY = {"model", "checkpoints", "cache", "wandb", "stages"}
BUNDLED_FILE_BYTES = 2 * 2**20
# A GPU test's time limit: an in-process tiny job takes seconds; a hang becomes a named failure.
TEST_TIMEOUT_S = 120

ENV_REPORT = r"""
import importlib.metadata as md, platform, sys
import torch
print("python", sys.version.split()[0], sys.executable, platform.platform())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"capability {p.major}.{p.minor}",
          f"{p.multi_processor_count} SMs", "bf16", torch.cuda.is_bf16_supported())
for name in ("deepspeed", "transformers", "tokenizers", "accelerate", "peft", "datasets", "hydra-core",
             "omegaconf", "pydantic", "huggingface-hub", "numpy", "triton", "bitsandbytes", "flash-attn", "wandb"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
import deepspeed, transformers
print("deepspeed from", deepspeed.__file__)
print("transformers from", transformers.__file__)
"""


@dataclass
class Check:
    """The run's folders, deadline and what each step did (summary.md is rewritten after each)."""

    out: Path
    work: Path
    deadline: float
    cpu: bool
    env: dict[str, str]
    results: list[tuple[str, str, float]] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, text: str) -> None:
        with open(self.out / "log.txt", "a") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
        print(text.rstrip("\n"), flush=True)

    def run(self, command: list[str], limit: float, *, into: str | None = None) -> tuple[int | None, str]:
        """Run a command in a process group of its own, stopped at min(limit, the deadline).

        Its output goes to log.txt, and to $OUT/<into> too when named. Returns (exit code or None when
        stopped, output)."""
        limit = min(limit, self.left())
        if limit < 5:
            return None, "not started: the deadline has passed"
        self.log(f"$ {' '.join(command)}   (limit {limit:.0f} s)")
        with open(self.work / "command.out", "w") as sink:
            process = subprocess.Popen(
                command, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                code: int | None = process.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _stop_group(process)
                code = None
            except Stopped:  # the check itself was told to stop: so is its command, then the check
                _stop_group(process)
                self.log((self.work / "command.out").read_text(errors="replace") + "[stopped: the check was stopped]")
                raise
        output = (self.work / "command.out").read_text(errors="replace")
        self.log(output + (f"[stopped after {limit:.0f} s]" if code is None else f"[exit {code}]"))
        if into:
            with open(self.out / into, "a") as handle:
                handle.write(output)
        return code, output

    def record(self, step: str, status: str, seconds: float) -> None:
        self.results.append((step, status, seconds))
        self.write_summary()
        self.bundle()

    def bundle(self) -> None:
        """runs.tar.gz: what the work folder holds of the runs (their small files, not weights or
        checkpoints) and the tables, written beside and renamed over the last one."""
        partial = self.out / ".runs.tar.gz.partial"
        with tarfile.open(partial, "w:gz") as archive:
            for path in sorted(self.work.rglob("*")):
                parts = set(path.relative_to(self.work).parts)
                if path.is_file() and not parts & BULKY and path.stat().st_size <= BUNDLED_FILE_BYTES:
                    archive.add(path, arcname=str(path.relative_to(self.work)))
        os.replace(partial, self.out / "runs.tar.gz")

    def write_summary(self) -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        lines = [
            f"# Device check ({'CPU mode' if self.cpu else 'GPU'}), {when}",
            "",
            f"{time.time() - self.started:.0f} s since the start; deadline {self.deadline - self.started:.0f} s.",
            "",
            "| step | status | seconds |",
            "|---|---|---:|",
            *(f"| {step} | {status} | {seconds:.0f} |" for step, status, seconds in self.results),
        ]
        if (self.out / "pytest.txt").is_file():
            lines += ["", verdicts_table(read_verdicts(self.out / "pytest.txt"))]
        for name in ("train.md", "presets.md"):
            if (self.work / name).is_file():
                lines += ["", (self.work / name).read_text().rstrip()]
        (self.out / "summary.md").write_text("\n".join(lines) + "\n")


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the command's process group (train.py then saves nothing and exits), SIGKILL if it lingers."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------- the steps
def install(check: Check, site: Path) -> str:
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if check.cpu:  # the wheels are built for the GPU machine's Python (bench/device_dry_run.sh installs them)
        return "skipped in CPU mode: this interpreter's packages are used"
    if not wheels:
        return "skipped: no carried wheels in .whl/, this interpreter's packages are used"
    code, _ = check.run(["bash", "bench/device_install.sh", str(site)], 180, into="env.txt")
    if code != 0:
        raise StepFailed(f"the install of {len(wheels)} carried wheels failed (log.txt)")
    check.env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), check.env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return f"ok: {len(wheels)} wheels into {site}"


def environment(check: Check) -> str:
    code, _ = check.run([sys.executable, "-c", ENV_REPORT], 90, into="env.txt")
    if code != 0:
        raise StepFailed("the environment report failed: a package does not import (env.txt)")
    for command in (["nvidia-smi"], ["nvcc", "--version"]):
        if shutil.which(command[0]):
            check.run(command, 30, into="env.txt")
    check.run([sys.executable, "-m", "deepspeed.env_report"], 90, into="env.txt")  # DeepSpeed's own view
    return "ok"


def build_ops(check: Check, names: list[str]) -> str:
    # On the lent machine nothing else builds now: the previous call's processes ended with it. A lock left
    # by a build that was killed (a call stopped at its limit) would make this build wait forever. In CPU
    # mode (the test suite) another process may be building into the same folder: its lock stays.
    extensions = None if check.cpu else Path(check.env["TORCH_EXTENSIONS_DIR"])
    for lock in extensions.glob("*/lock") if extensions is not None else ():
        lock.unlink()
        check.log(f"removed a stale build lock: {lock}")
    done = []
    for name in names:
        start = time.time()
        program = f"from deepspeed.ops.op_builder import {OP_BUILDERS[name]} as B; B().load(verbose=False)"
        code, output = check.run([sys.executable, "-c", program], 300)
        seconds = time.time() - start
        outcome = "built" if code == 0 else ("stopped" if code is None else f"failed (exit {code})")
        line = f"{name}: {outcome} in {seconds:.0f} s"
        if code not in (0, None):
            line += ": " + _last_error(output)
        with open(check.out / "ops.txt", "a") as handle:
            handle.write(line + "\n")
        done.append(line)
    failed = [line for line in done if ": built" not in line]
    if failed:
        raise StepFailed("; ".join(failed))
    return "ok: " + "; ".join(done)


def run_pytest(check: Check, selection: list[str], test_timeout: float) -> str:
    """`pytest SELECTION` (default `-m gpu`), each verdict into pytest.txt as it happens (tests/verdicts.py).
    Whatever ends the suite (its end, its limit, the deadline, a stop signal), a test that started and has
    no verdict is named "stopped" there."""
    verdicts = check.out / "pytest.txt"
    command = [sys.executable, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider", "-rs"]
    command += ["-p", "tests.verdicts", "--verdicts", str(verdicts), "--test-timeout", f"{test_timeout:g}"]
    if not check.cpu:
        command += ["-n", "4"]  # tiny models: four at a time share the GPU
    code: int | None = None
    try:
        code, output = check.run(command, 300)
    finally:
        tests = read_verdicts(verdicts)
        with open(verdicts, "a") as handle:
            for test, record in tests.items():
                if record["outcome"] == "stopped":
                    handle.write(json.dumps({"test": test, "outcome": "stopped"}) + "\n")
    counts = verdict_counts(tests)
    failed = [f"{test.split('::')[-1]}: {record.get('error', '')}" for test, record in tests.items()
              if record["outcome"] in ("failed", "error", "stopped")]  # fmt: skip
    said = counts + (f"; {'; '.join(failed)}" if failed else "")
    if code is None:
        raise StepFailed(f"stopped at its limit ({said})")
    if code not in (0, 5):  # 5: every test deselected or skipped
        raise StepFailed(said if tests else _last_line(output))
    return "ok: " + said


def read_verdicts(path: Path) -> dict[str, dict[str, Any]]:
    """Each test's last record in pytest.txt, in the order the tests started; a test that started and has
    no verdict (the suite was stopped while it ran) is "stopped"."""
    tests: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return tests
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a stop mid-write
        if isinstance(record, dict) and "test" in record and "outcome" in record:
            tests[record["test"]] = record
    return {
        test: {**record, "outcome": "stopped"} if record["outcome"] == "started" else record
        for test, record in tests.items()
    }


def verdict_counts(tests: dict[str, dict[str, Any]]) -> str:
    order = ("passed", "failed", "error", "skipped", "stopped")
    counted = {outcome: sum(r["outcome"] == outcome for r in tests.values()) for outcome in order}
    return ", ".join(f"{n} {outcome}" for outcome, n in counted.items() if n) or "no test ran"


def verdicts_table(tests: dict[str, dict[str, Any]]) -> str:
    """summary.md's table of the GPU tests: each test, its outcome, seconds and error line."""
    lines = [
        f"## GPU tests ({verdict_counts(tests)})",
        "",
        "| test | outcome | seconds | error |",
        "|---|---|---:|---|",
    ]
    for test, record in tests.items():
        seconds = f"{record['seconds']:.1f}" if isinstance(record.get("seconds"), (int, float)) else ""
        error = record.get("run_error") or record.get("error") or ""
        lines.append(f"| {_cell(test.split('/')[-1])} | {record['outcome']} | {seconds} | {_cell(error)} |")
    return "\n".join(lines)


DPO = ("loss=dpo", "data.task=colour")


def train_runs(check: Check, steps: int) -> str:
    # A CPU refuses fp16; CPU mode (the test suite's run of this script) checks the plumbing with ZeRO's two
    # ends and both precisions, the second a DPO run (its reward accuracy column), not every row (each run is
    # a `python train.py` of ~20 s there). On a GPU, each stage in bf16, fp16 once, and DPO
    # (docs/preference.md) twice: a live reference partitioned at ZeRO-3, and QLoRA's base as the reference.
    runs: list[tuple[str, str, tuple[str, ...]]] = (
        [("z0", "bf16", ()), ("z3", "fp32", (*DPO, "loss.reference=live"))]
        if check.cpu
        else [
            ("z0", "bf16", ()), ("z2", "bf16", ()), ("z3", "bf16", ()), ("z2", "fp16", ()),
            ("z3", "bf16", (*DPO, "loss.reference=live")),
            ("z0", "bf16", (*DPO, "method=qlora", "loss.reference=adapter")),
        ]
    )  # fmt: skip
    table = check.work / "train.md"
    table.write_text(
        "## Tiny model, `python train.py` (one device)\n\n"
        "| run | status | loss first -> last | reward acc | samples/s | tokens/s | peak reserved | peak allocated | "
        "device used | pinned host | host RSS | optimizer | wall s |\n"
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|\n"
    )
    failed = []
    for preset, precision, extra in runs:
        parts = [part.split("=")[1] for part in extra if part.startswith(("loss=", "method=", "loss.reference="))]
        name = "-".join([preset, precision, *parts])
        run_dir = check.work / "train" / name
        # A DPO run evaluates once, at its last step: its held-out reward accuracy is the row's point.
        evaluation = f"train.eval_every={steps}" if "loss=dpo" in extra else "train.eval_every=0"
        command = [
            sys.executable,
            "train.py",
            f"deepspeed={preset}",
            f"precision={precision}",
            f"train.max_steps={steps}",
            evaluation,
            "data.eval_accuracy=false",
            "logger=none",
            f"hydra.run.dir={run_dir}",
            *extra,
        ]
        code, output = check.run(command, 150)
        row = train_row(name, run_dir, code, output)
        with open(table, "a") as handle:
            handle.write(row + "\n")
        check.write_summary()
        check.bundle()
        if code != 0:
            failed.append(name)
    if failed:
        raise StepFailed(f"{len(failed)} of {len(runs)} runs failed: {', '.join(failed)}")
    return f"ok: {len(runs)} runs"


def train_row(name: str, run_dir: Path, code: int | None, output: str) -> str:
    """One Markdown row from a run's summary.json and metrics.jsonl (or its error)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        losses = [json.loads(line)["train/loss"] for line in lines if line.strip()]
    except (OSError, ValueError, KeyError):
        summary, losses = {}, []
    if code != 0 or summary.get("status") != "completed":
        status = "stopped" if code is None else f"failed: {summary.get('error') or _last_error(output)}"
        return f"| {name} | {_cell(status)} |" + " |" * 11
    memory = summary.get("memory", {})
    # On a GPU the summary's peak is the allocator's reserve; on a CPU it is the host RSS (its own column).
    reserved = summary["peak_memory_bytes"] if "device_used_bytes" in memory else None
    accuracy = summary.get("eval_rewards_accuracy")

    def gib(value: float | None) -> str:
        return f"{value / 2**30:.2f}" if isinstance(value, (int, float)) else "n/a"

    return (
        f"| {name} | ok | {losses[0]:.3f} -> {losses[-1]:.3f} | "
        f"{f'{accuracy:.3f}' if isinstance(accuracy, (int, float)) else ''} | {summary['samples_per_sec']:.1f} | "
        f"{summary['tokens_per_sec']:.0f} | {gib(reserved)} | "
        f"{gib(memory.get('peak_allocated_bytes'))} | {gib(memory.get('device_used_bytes'))} | "
        f"{gib(memory.get('pinned_host_bytes'))} | {gib(memory.get('host_peak_bytes'))} | "
        f"{summary.get('optimizer', '?')} | {summary['wall_s']:.0f} |"
    )


def presets(check: Check, names: list[str]) -> str:
    target = check.work / "presets"
    command = [sys.executable, "bench/gpu_presets.py", "--out-dir", str(target), "--presets", *names]
    command += ["--deadline-unix", f"{check.deadline - 10:.0f}"]
    if check.cpu:
        command += ["--device", "cpu", "--tiny"]

    def copy_back() -> None:
        for name, into in (("presets.md", check.work), ("presets.jsonl", check.out)):
            if (target / name).is_file():
                shutil.copyfile(target / name, into / name)
        check.write_summary()

    stop = threading.Event()

    def copier() -> None:  # rows come back while the sweep runs, not only at its end
        while not stop.wait(5):
            copy_back()

    thread = threading.Thread(target=copier, daemon=True)
    thread.start()
    try:
        code, output = check.run(command, check.left())
    finally:
        stop.set()
        thread.join()
        copy_back()
    rows = []
    if (target / "presets.jsonl").is_file():
        rows = [json.loads(line) for line in (target / "presets.jsonl").read_text().splitlines() if line.strip()]
    ok = sum(row.get("status") == "ok" for row in rows)
    if code != 0:
        raise StepFailed(f"{ok} of {len(names)} presets measured; the sweep ended with {code}: {_last_line(output)}")
    return f"ok: {ok} of {len(names)} presets measured"


# ----------------------------------------------------------------------------- helpers and main
class StepFailed(Exception):
    """A step's one-line failure; the check goes on with the next step."""


class Stopped(Exception):
    """The check got a stop signal (the device tool's call at its limit, Ctrl-C, a closed terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signals() -> None:
    def stop(signum: int, _frame: object) -> None:
        for each in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # one stop: the cleanup is not interrupted
            signal.signal(each, signal.SIG_IGN)
        raise Stopped(signum)

    for each in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(each, stop)


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def _last_error(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "rror" in line or "error:" in line]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:200]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:200]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU mode: tiny sizes, the same steps and files")
    parser.add_argument("--out", type=Path, help="results folder (default: $OUT, else outputs/bench/device_check/...)")
    parser.add_argument("--deadline-s", type=float, help="the whole check's wall-clock limit (default 470 s; 600 CPU)")
    parser.add_argument("--only", nargs="+", choices=STEPS, help="run these steps (install and env always run)")
    parser.add_argument("--presets", nargs="+", help="presets for bench/gpu_presets.py")
    parser.add_argument("--ops", nargs="+", choices=sorted(OP_BUILDERS), default=["cpu_adam"])
    parser.add_argument("--train-steps", type=int, help="steps of each tiny run (default 30; 10 in CPU mode)")
    parser.add_argument("--pytest-args", default="-m gpu", help="what the pytest step runs, one string (-m gpu)")
    parser.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT_S, help="each test's limit (120 s)")
    args = parser.parse_args()
    _stop_on_signals()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or Path(os.environ.get("OUT") or ROOT / "outputs" / "bench" / "device_check" / stamp)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"device_check-{stamp}-"))  # its own: two checks may start in one second
    env = {
        **os.environ,
        # This interpreter's bin folder first (a venv's ninja), as launcher.ops does: another ninja on PATH
        # would make torch rebuild the ops the launcher builds.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "DS_SKIP_CUDA_CHECK": "1",
        "HF_HUB_OFFLINE": "1",  # no network there: nothing may wait on the hub
        "WANDB_MODE": "disabled",
    }
    if not args.cpu:  # CPU mode uses this machine as it is: its packages, and the ops its runs built already
        env["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR") or "/tmp/device_check_torch_extensions"
    else:
        env[GPU_SUITE_ON_CPU_ENV] = "1"
    deadline = time.time() + (args.deadline_s or (600 if args.cpu else 470))
    check = Check(out=out, work=work, deadline=deadline, cpu=args.cpu, env=env)
    wanted = set(args.only or STEPS) | {"install", "env"}
    steps = {
        "install": lambda: install(check, Path(os.environ.get("DEVICE_CHECK_SITE", "/tmp/device_check_site"))),
        "env": lambda: environment(check),
        "ops": lambda: build_ops(check, args.ops),
        "pytest": lambda: run_pytest(check, shlex.split(args.pytest_args), args.test_timeout),
        "train": lambda: train_runs(check, args.train_steps or (10 if args.cpu else 30)),
        "presets": lambda: presets(check, args.presets or (CPU_PRESETS if args.cpu else GPU_PRESETS)),
    }
    failures = 0
    for name in STEPS:
        if name not in wanted:
            continue
        start = time.time()
        if check.left() < 10:
            check.record(name, "skipped: the deadline has passed", 0)
            continue
        try:
            status = steps[name]()
        except StepFailed as error:
            status, failures = f"FAILED: {error}", failures + 1
        except Stopped as stop:
            check.record(name, f"stopped: the check got {stop}", time.time() - start)
            print(f"results in {out}")
            return 128 + stop.signum
        check.record(name, _cell(status), time.time() - start)
        if name == "install" and status.startswith("FAILED"):
            break  # nothing else can import
    print((out / "summary.md").read_text())
    print(f"results in {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
