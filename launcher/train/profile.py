"""`train.profile_steps=[FIRST,LAST]`: where those training steps' time goes, on rank 0, as a table.

torch.profiler records the steps FIRST to LAST (inclusive) of rank 0. Each operator's own time (its self
time: on a GPU the time of the kernels it launched, counted there once; else its CPU time) goes to one part:

    data wait        waiting for the next batch: the wall time of the loop's `launcher/data` scope (on a GPU,
                     kernels queued before it may still run meanwhile)
    communication    collectives (all-reduce, reduce-scatter, all-gather, broadcast; NCCL or gloo kernels)
    optimizer        the optimizer step and what DeepSpeed does around it (`launcher/optimizer`)
    loss             the output layer and the log-probs of the answer tokens (launcher.model.logps's chunks)
    attention        scaled-dot-product, flash and varlen attention: forward split between the vision tower
                     (`launcher/vision`, set by hooks on the tower) and the language model; backward together
    matmuls          matrix products (mm, addmm, bmm, linear, gemm kernels)
    copies           copies and dtype casts (copy_, to, Memcpy)
    other ops        the rest: element-wise, normalisation, softmax, embeddings, ...
    idle             the steps' wall time no operator accounts for (a GPU waiting for the host, Python)

The scopes are torch.profiler.record_function ranges, entered only while a profile runs. The table goes to
RUN/profile.md with each part's milliseconds per step and share of the steps' wall time, the trace to
RUN/profile_trace.json.gz (chrome://tracing or ui.perfetto.dev), the shares to summary.json (`profile`).
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType

from launcher.core.scopes import PREFIX, record_scopes

log = logging.getLogger("launcher")

PARTS = (
    "data wait",
    "communication",
    "optimizer",
    "loss",
    "attention (language, forward)",
    "attention (vision, forward)",
    "attention (backward)",
    "matmuls",
    "copies",
    "other ops",
    "idle",
)
_COMMUNICATION = re.compile(r"nccl|gloo|all_?reduce|reduce_?scatter|all_?gather|broadcast|c10d", re.IGNORECASE)
_ATTENTION = re.compile(r"scaled_dot_product|flash|efficient_attention|varlen|cudnn_attention|fmha", re.IGNORECASE)
_MATMUL = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|_scaled_mm)$|gemm|cutlass|sm\d+_xmma", re.IGNORECASE
)
_COPY = re.compile(r"^aten::(copy_|to|_to_copy|contiguous|clone)$|memcpy|memset", re.IGNORECASE)


def part_of(name: str, scopes: Sequence[str]) -> str:
    """The part an operator's own time belongs to: `name` is the operator's, `scopes` the launcher scopes it
    ran in (innermost first, without the prefix)."""
    if "data" in scopes:
        return "data wait"
    if _COMMUNICATION.search(name):
        return "communication"
    if "optimizer" in scopes:
        return "optimizer"
    if "loss" in scopes:
        return "loss"
    if _ATTENTION.search(name):
        if "backward" in name.lower() or "backward" in scopes:
            return "attention (backward)"
        return "attention (vision, forward)" if "vision" in scopes else "attention (language, forward)"
    if _MATMUL.search(name):
        return "matmuls"
    if _COPY.search(name):
        return "copies"
    return "other ops"


@dataclass(frozen=True)
class Breakdown:
    """Seconds per part over the profiled steps, and their wall time."""

    seconds: dict[str, float]
    wall_s: float
    steps: int
    clock: str  # what the seconds are: "device (CUDA kernels)" or "CPU (operators' own time)"

    def shares(self) -> dict[str, float]:
        return {part: round(value / self.wall_s, 4) for part, value in self.seconds.items()} if self.wall_s else {}

    def table(self, first: int, last: int) -> str:
        per_step = 1e3 * self.wall_s / self.steps
        lines = [
            f"# Where steps {first}-{last} went (rank 0)",
            "",
            f"{self.steps} step{'s' if self.steps > 1 else ''} in {self.wall_s:.3f} s of wall time "
            f"({per_step:.1f} ms per step); "
            f"each part's {self.clock} time, per step and as a share of the wall time. Parts: "
            "launcher/train/profile.py; the trace: profile_trace.json.gz (ui.perfetto.dev).",
            "",
            "| part | ms per step | share |",
            "|---|---:|---:|",
        ]
        for part in PARTS:
            seconds = self.seconds.get(part, 0.0)
            share = seconds / self.wall_s if self.wall_s else 0.0
            lines.append(f"| {part} | {1e3 * seconds / self.steps:.1f} | {share:.1%} |")
        return "\n".join(lines) + "\n"


def breakdown(events: Any, wall_s: float, steps: int, device: str) -> Breakdown:
    """Each profiled operator's own time by part (`events`: torch.profiler's FunctionEvents), the data wait
    as the wall time of the loop's `data` scope; idle is the wall time left over (none below zero: a CPU's
    threads can together exceed it, and a GPU's kernels may run while the host waits for data)."""
    on_device = device == "cuda"
    seconds = dict.fromkeys(PARTS, 0.0)
    for event in events:
        if event.device_type != DeviceType.CPU:
            # A kernel, or the GPU's copy of a named range: torch lists each once more on its own, and its
            # time is already its launching operator's (self_device_time_total), in that operator's scopes.
            continue
        if event.name.startswith(PREFIX):
            if event.name == PREFIX + "data":
                # Waiting for a batch is mostly no operator (a queue's get): the range's wall time is the wait.
                seconds["data wait"] += event.cpu_time_total / 1e6
            continue  # a scope: its operators count, not the range itself
        scopes = _scopes(event)
        if "data" in scopes:
            continue  # inside the data wait, counted whole above
        own = (event.self_device_time_total if on_device else event.self_cpu_time_total) / 1e6
        if own <= 0:
            continue
        seconds[part_of(event.name, scopes)] += own
    seconds["idle"] = max(0.0, wall_s - sum(seconds.values()))
    clock = "device (CUDA kernels)" if on_device else "CPU (operators' own time)"
    return Breakdown(seconds, wall_s, steps, clock)


def _scopes(event: Any) -> list[str]:
    names, parent = [], event.cpu_parent
    while parent is not None:
        if parent.name.startswith(PREFIX):
            names.append(parent.name.removeprefix(PREFIX))
        parent = parent.cpu_parent
    return names


class StepProfiler:
    """Profiles steps [first, last] of rank 0 (`steps` None: does nothing); `around(step)` wraps each step."""

    def __init__(self, steps: Sequence[int] | None, run_dir: Path, *, is_main: bool, device: torch.device,
                 vision: Sequence[nn.Module] = ()) -> None:  # fmt: skip
        self.first, self.last = (int(steps[0]), int(steps[1])) if steps and is_main else (0, -1)
        self.run_dir, self.device, self.vision = Path(run_dir), device, list(vision)
        self.profiler: Any = None
        self.started = 0.0
        self.hooks: list[Any] = []
        self.result: Breakdown | None = None

    @contextlib.contextmanager
    def around(self, step: int) -> Iterator[None]:
        if step == self.first:
            self._start()
        yield
        if self.profiler is not None and step == self.last:
            self.stop(step)

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        record_scopes(True)
        self.hooks = [hook for tower in self.vision for hook in _vision_scope(tower)]
        self.started = time.perf_counter()

    def stop(self, step: int) -> None:
        """End the profile after `step` (the last profiled, or the last the run made) and write its files."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.started
        record_scopes(False)
        for hook in self.hooks:
            hook.remove()
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        steps = step - self.first + 1
        self.result = breakdown(profiler.events(), wall, steps, self.device.type)
        (self.run_dir / "profile.md").write_text(self.result.table(self.first, step))
        profiler.export_chrome_trace(str(self.run_dir / "profile_trace.json.gz"))
        top = sorted(self.result.shares().items(), key=lambda item: -item[1])[:4]
        log.info(
            "profile of steps %d-%d: %s; %s", self.first, step,
            ", ".join(f"{part} {share:.0%}" for part, share in top), self.run_dir / "profile.md",
        )  # fmt: skip

    def close(self, step: int | None) -> None:
        """A run that ends inside the profiled steps still writes what it recorded."""
        if self.profiler is not None and step is not None and step >= self.first:
            self.stop(step)


def _vision_scope(tower: nn.Module) -> list[Any]:
    """Hooks that put the tower's forward inside the `launcher/vision` scope."""
    entered: list[Any] = []

    def enter(_module: nn.Module, _inputs: Any) -> None:
        context = torch.profiler.record_function(PREFIX + "vision")
        context.__enter__()
        entered.append(context)

    def leave(_module: nn.Module, _inputs: Any, _output: Any) -> None:
        if entered:
            entered.pop().__exit__(None, None, None)

    return [tower.register_forward_pre_hook(enter), tower.register_forward_hook(leave)]
