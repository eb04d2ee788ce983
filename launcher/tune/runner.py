"""Running one candidate: the job as train.py runs it, in this process (launcher.launch.run.run_job, which
starts the ranks as child processes), watched by a thread that polls the ranks' memory and metrics and
ends them once the candidate is measured, over the budget, dominated or too slow."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from launcher.config.compose import compose
from launcher.config.schema import TuneConfig
from launcher.core.errors import Interrupted, error_line
from launcher.core.json_files import write_text_atomic
from launcher.core.overrides import override_key
from launcher.core.rundir import RunDir
from launcher.core.summary import Summary
from launcher.job.spec import HydraJob
from launcher.launch.ranks import WORKER
from launcher.launch.run import Outcome, run_job
from launcher.train.distributed import CUDA_MEMORY_CAP_ENV
from launcher.tune.decide import BUSY, GiB, MiB, Result, dominating, step_spread
from launcher.tune.report import Tuning

# Test hook: "NAME:KEY=VALUE" adds KEY=VALUE to the environment of candidate NAME only (tests force a
# crash or a memory overrun on one candidate with launcher.recipe's fault hook).
CANDIDATE_ENV = "LAUNCHER_TEST_TUNE_ENV"
OTHERS_SAMPLE_S = 0.5  # how long the machine is sampled, idle of the tuner's own work, before each candidate


# ================================================================================ running a candidate
@dataclass
class Watch:
    """What the tuner has seen of a running candidate."""

    rank_peaks: dict[int, int] = field(default_factory=dict)  # pid -> peak RSS
    rank_cpu: dict[int, float] = field(default_factory=dict)  # pid -> CPU seconds (user + system) so far
    # pid -> CPU seconds of every process under the tuner (ranks, their DataLoader workers, helpers): what is
    # left of the machine's busy time is other processes'
    tree_cpu: dict[int, float] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl rows

    @property
    def peak(self) -> int:
        reported = max((int(r.get("mem/peak_bytes") or 0) for r in self.records), default=0)
        return max([reported, *self.rank_peaks.values()])


def rank_processes(root_pid: int) -> list[Any]:
    """The ranks under a train.py process: `launcher.worker` processes whose parent is no rank
    (a rank's DataLoader workers are its forks, sharing its pages)."""
    import psutil

    try:
        tree = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:
        return []
    workers = {}
    for proc in tree:
        try:
            if _runs_module(proc.cmdline(), WORKER):
                workers[proc.pid] = proc
        except psutil.Error:
            continue
    ranks = []
    for proc in workers.values():
        try:
            if proc.ppid() not in workers:
                ranks.append(proc)
        except psutil.Error:
            continue
    return ranks


def _runs_module(cmdline: Sequence[str], module: str) -> bool:
    """Whether a command line runs `python ... -m MODULE` (torchrun's own `-m launcher.torchrun ...
    -m launcher.worker` runs launcher.torchrun: its first -m decides)."""
    for index, arg in enumerate(cmdline[:-1]):
        if arg == "-m":
            return cmdline[index + 1] == module
    return False


def kill_ranks(root_pid: int) -> None:
    """SIGKILL the ranks and whatever they started: train.py survives them, cleans up and exits."""
    import psutil

    for rank in rank_processes(root_pid):
        try:
            family = [rank, *rank.children(recursive=True)]
        except psutil.Error:
            family = [rank]
        for proc in family:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)


class Measured(NamedTuple):
    """A candidate's figures over its measured steps."""

    samples_per_s: float
    tokens_per_s: float  # real (non-padding) tokens
    steps: int
    padding_frac: float | None  # padding's share of the tokens computed
    mfu: float | None  # time-weighted model FLOPs utilisation (None where the run reports none)
    step_spread: float | None = None  # how much the measured steps' real tokens/s disagree (decide.step_spread)


def measure(records: Sequence[Mapping[str, Any]], warmup: int, global_batch: int) -> Measured | None:
    """The figures over the steps after the warm-up ones (the rank's metrics.jsonl rows); None before any.

    Samples/s counts records as each step reports them (perf/samples_per_sec: a packed row holds several),
    else the global batch per step."""
    measured = [r for r in records if int(r["step"]) > warmup and r.get("perf/step_time_s")]
    if not measured:
        return None
    times = [float(r["perf/step_time_s"]) for r in measured]
    seconds = sum(times)
    samples = sum(float(r.get("perf/samples_per_sec") or 0) * t for r, t in zip(measured, times, strict=True))
    samples = samples or global_batch * len(measured)
    tokens = [float(r.get("perf/tokens_per_sec") or 0) * t for r, t in zip(measured, times, strict=True)]
    padding = None
    if all("perf/padding_frac" in r for r in measured):
        computed = sum(
            n / max(1.0 - float(r["perf/padding_frac"]), 1e-9) for n, r in zip(tokens, measured, strict=True)
        )
        padding = 1.0 - sum(tokens) / computed if computed else 0.0
    mfu = None
    if all(r.get("perf/mfu") is not None for r in measured):
        mfu = sum(float(r["perf/mfu"]) * t for r, t in zip(measured, times, strict=True)) / seconds
    spread = step_spread([float(r.get("perf/tokens_per_sec") or 0) for r in measured])
    return Measured(samples / seconds, sum(tokens) / seconds, len(measured), padding, mfu, spread)


def _read_new_records(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except OSError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]
    records = [json.loads(line) for line in complete.splitlines() if line.strip() and b'"step"' in line]
    return records, offset + len(complete)


def _candidate_env(name: str) -> dict[str, str]:
    """The test hook's variables for candidate NAME (`CANDIDATE_ENV`="NAME:KEY=VALUE;..."), for its ranks."""
    env = {}
    for item in filter(None, os.environ.get(CANDIDATE_ENV, "").split(";")):
        who, _, assignment = item.partition(":")
        if who == name:
            key, _, value = assignment.partition("=")
            env[key] = value
    return env


def _cache_checked(t: Tuning, result: Result) -> bool:
    """Whether a candidate before `result` ran (and so checked the data cache), the job leaving
    data.cache_check to the tuner."""
    if any(override_key(o) == "data.cache_check" for o in t.base):
        return False
    # A confirmation run is in no list: every candidate ran before it.
    earlier = t.results[: next((i for i, other in enumerate(t.results) if other is result), len(t.results))]
    return any(other.run_dir for other in earlier)


def others_cpu_share(seconds: float = OTHERS_SAMPLE_S) -> float:
    """The share of the machine's CPUs busy over `seconds` while the tuner runs nothing: other processes'.
    A candidate measured while others use much of the machine measures them too (issue 44: a loaded 2-core
    machine made ZeRO-2 with CPU offload the pick for a model ZeRO-0 trains 10x faster)."""
    import psutil

    return psutil.cpu_percent(interval=seconds) / 100.0


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (not idle, not waiting on I/O) since boot."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def own_cpu_s() -> float:
    """This process's CPU seconds: the tuner's threads (the watcher's polling among them)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_candidate(t: Tuning, result: Result, tune_cfg: TuneConfig, *, run_name: str | None = None) -> None:
    """Run one candidate as train.py would, watch its memory and steps, stop it once measured; sets the
    result's status, figures and note. `run_name`: its run directory and log (a confirmation run's own).

    The job runs in this process (`launcher.launch.run.run_job`, the code behind train.py, which starts
    the ranks as child processes): the tuner pays the launcher's imports once, not per candidate. Its
    lines and its ranks' output go to the candidate's log file."""
    candidate = result.candidate
    run_name = run_name or candidate.name
    run_dir = RunDir(t.directory / "runs" / run_name)
    log_file = t.directory / "logs" / f"{run_name}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    overrides = [
        *t.base,
        *t.trial_overrides,
        *candidate.overrides(t.global_batch),
        # One step more than measured: the last step of a run evaluates before it records its metrics,
        # and the candidate is stopped as soon as the last measured step is recorded.
        f"train.max_steps={int(tune_cfg.warmup_steps) + int(tune_cfg.measure_steps) + 1}",
        "train.eval_every=0",
        "train.save_every=0",
        "data.eval_accuracy=false",
        "logger=none",
        "preflight=off",
        # The first candidate to run checks the data cache's checksums (or builds it); the others, which read
        # the same cache moments later, its files' sizes.
        *(["data.cache_check=sizes"] if _cache_checked(t, result) else []),
    ]
    choices = {"deepspeed": candidate.preset, "precision": candidate.precision}
    job = HydraJob(run_dir=run_dir.path, overrides=tuple(overrides), choices=choices, multirun=True, group="tune")
    result.run_dir = str(run_dir.path)
    rank_env = _candidate_env(candidate.name)
    if t.device_kind == "cuda":  # the allocator stops at the budget: exceeding it is a real CUDA OOM
        rank_env[CUDA_MEMORY_CAP_ENV] = f"{t.budget / GiB:.3f}"

    def to_log(line: str) -> None:
        with log_file.open("a") as log:
            log.write(line + "\n")

    result.others_cpu = others_cpu_share()
    started = time.time()
    watcher = _Watcher(t, run_dir, tune_cfg, started, busy=result.others_cpu > BUSY)
    watcher.start()
    try:
        outcome = run_job(compose(overrides), job, say=to_log, rank_env=rank_env, output=log_file)
    finally:
        watcher.stop()
    # A burst of other work that starts after the sample above shows in the share during the run.
    result.others_cpu = max(result.others_cpu, watcher.others_share())
    if watcher.decided:  # the ranks were ended on purpose: say so before the job's own last line
        status, note = watcher.decided[0]
        to_log(f"tune: {candidate.name} ended by the tuner: {status}" + (f" ({note})" if note else ""))
    for line, _ in outcome.lines():  # how the job ended (its error line), as train.py would print it
        to_log(line)
    _settle(t, result, watcher, outcome, tune_cfg, started, log_file)


class _Watcher:
    """A thread that polls a running candidate's ranks (memory, CPU time) and metrics.jsonl every 50 ms and
    ends the ranks (SIGKILL) once the candidate is measured, over the budget, dominated or too slow."""

    def __init__(self, t: Tuning, run_dir: RunDir, tune_cfg: TuneConfig, started: float, busy: bool = False) -> None:
        self.t, self.run_dir, self.tune_cfg, self.started, self.busy = t, run_dir, tune_cfg, started, busy
        self.watch = Watch()
        self._machine_before, self._own_before = _busy_cpu_s(), own_cpu_s()
        self.decided: list[tuple[str, str]] = []  # (status, note) when the tuner ended the candidate
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="tune-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def others_share(self) -> float:
        """The share of the machine's CPUs other processes have used since the run started: the machine's busy
        time less the tuner's own and its children's (ranks, DataLoader workers), over the run's capacity."""
        elapsed = time.time() - self.started
        if elapsed <= 0:
            return 0.0
        ours = (own_cpu_s() - self._own_before) + sum(self.watch.tree_cpu.values())
        others = _busy_cpu_s() - self._machine_before - ours
        return min(1.0, max(0.0, others / (elapsed * (os.cpu_count() or 1))))

    def _sample_tree(self) -> None:
        import psutil

        try:
            tree = psutil.Process(os.getpid()).children(recursive=True)
        except psutil.Error:
            return
        for proc in tree:
            try:
                cpu = proc.cpu_times()
            except psutil.Error:
                continue
            self.watch.tree_cpu[proc.pid] = max(cpu.user + cpu.system, self.watch.tree_cpu.get(proc.pid, 0.0))

    def _poll(self) -> None:
        offset = 0
        while not self._done.wait(0.05):
            self._sample_tree()
            # Load that arrives during the run: from then on its speed says little (no dominance verdict).
            self.busy = self.busy or (time.time() - self.started > 1.0 and self.others_share() > BUSY)
            # A CPU's memory is the ranks' resident set; a GPU's, what each rank reports per step.
            for proc in rank_processes(os.getpid()):
                try:
                    rss, cpu = proc.memory_info().rss, proc.cpu_times()
                except Exception:
                    continue
                self.watch.rank_cpu[proc.pid] = cpu.user + cpu.system
                if self.t.device_kind == "cpu":
                    self.watch.rank_peaks[proc.pid] = max(rss, self.watch.rank_peaks.get(proc.pid, 0))
            new, offset = _read_new_records(self.run_dir.metrics, offset)
            self.watch.records += new
            if self.decided:
                kill_ranks(os.getpid())  # again: a rank may have been starting the first time
                continue
            verdict = _verdict(self.t, self.watch, new, self.started, self.tune_cfg, busy=self.busy)
            if verdict is not None:
                self.decided.append(verdict)
                status, note = verdict
                # Read by the launcher when the ranks die: the candidate's log and summary then name the
                # tuner, not the out-of-memory killer a SIGKILL otherwise suggests.
                write_text_atomic(self.run_dir.ended_by, f"the tuner ({status}{': ' + note if note else ''})\n")
                kill_ranks(os.getpid())


def _settle(
    t: Tuning, result: Result, watcher: _Watcher, outcome: Outcome, tune_cfg: TuneConfig, started: float, log: Path
) -> None:
    """The candidate's figures, and what it turned out to be: fits, does not fit, failed (or the tuner's own
    verdict); a candidate stopped from outside (Ctrl-C, a scheduler's SIGTERM) stops the tuning."""
    warmup, steps = int(tune_cfg.warmup_steps), int(tune_cfg.measure_steps)
    watch = watcher.watch
    watch.records = _read_new_records(watcher.run_dir.metrics, 0)[0]
    result.wall_s = round(time.time() - started, 1)
    result.cpu_s = round(sum(watch.rank_cpu.values()), 1)  # the ranks' (sampled every 50 ms)
    by_step = sorted(watch.records, key=lambda r: r["step"])
    result.losses = [float(r["train/loss"]) for r in by_step if "train/loss" in r]
    result.peak = watch.peak or None
    figures = measure(watch.records, warmup, t.global_batch)
    if figures is not None:
        result.samples_per_s, result.tokens_per_s, result.steps = (
            figures.samples_per_s,
            figures.tokens_per_s,
            figures.steps,
        )
        result.padding_frac, result.mfu = figures.padding_frac, figures.mfu
        result.runs, result.step_spread = [figures.tokens_per_s], figures.step_spread
    summary = watcher.run_dir.read_summary() or Summary(status="failed")
    error = outcome.error or summary.error
    # Preempted or interrupted: a stop signal reached the job (the tuner's own kills are SIGKILLs, which end
    # a candidate as failed), even where the watcher had decided the candidate's fate meanwhile.
    preempted = outcome.status in ("interrupted", "preempted")
    killed = any(sign in str(error) for sign in ("killed by SIGTERM", "killed by SIGINT", "KeyboardInterrupt"))
    if preempted or (killed and not watcher.decided):
        raise Interrupted(f"tune: stopped during {result.name}; the results so far are in {t.directory}")
    if watcher.decided:
        result.status, result.note = watcher.decided[0]
    elif len(watch.records) >= warmup + steps:  # measured, then ended by the tuner
        result.status = "fits"
    else:
        error = error or error_line(log.read_text(errors="replace"))
        out_of_memory = "out of memory" in error.lower() or "can't allocate memory" in error.lower()
        result.status, result.note = ("does not fit" if out_of_memory else "failed"), error[:500]
    if not watch.records and result.status == "failed":
        result.peak = None  # a process that trained no step: its start-up's few MiB are no peak of this candidate


def _verdict(
    t: Tuning, watch: Watch, new: list[dict[str, Any]], started: float, tc: Any, *, busy: bool = False
) -> tuple[str, str] | None:
    """Whether to end a running candidate now, and as what. `busy`: other processes were using the machine
    before it started or have since; its speed then says little, and it is not stopped as dominated."""
    warmup, steps = int(tc.warmup_steps), int(tc.measure_steps)
    if watch.peak > t.budget:
        return (
            "does not fit",
            f"a rank reached {watch.peak / MiB:.0f} MiB > budget {t.budget / MiB:.0f} MiB "
            f"in step {len(watch.records) + 1}",
        )
    if len(watch.records) >= warmup + steps:
        return ("fits", "")
    if time.time() - started > float(tc.candidate_timeout_s):
        return ("failed", f"did not finish within tune.candidate_timeout_s={tc.candidate_timeout_s:g} s")
    if new and tc.early_skip and not busy:
        so_far = measure(watch.records, warmup, t.global_batch)
        if so_far is not None:
            # One measured step is noisier than two: it must lose by twice the margin.
            margin = float(tc.skip_margin) * (2 if so_far.steps == 1 else 1)
            better = dominating(so_far.tokens_per_s, watch.peak, t.results, margin)
            if better is not None:
                return (
                    "dominated",
                    f"{better.name} is faster ({better.tokens_per_s:.0f} > {so_far.tokens_per_s:.0f} real tokens/s "
                    f"after {so_far.steps} steps) with no more memory",
                )
    return None
