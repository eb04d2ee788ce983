"""Faults on purpose, for the tests of how a failing rank is reported: `LAUNCHER_TEST_FAULT=RANK:STEP[:HOW]`.

    RANK:STEP             that rank raises at that step (a crashed rank)
    RANK:STEP:hang        it stops answering the others there (the step watchdog's case)
    RANK:STEP:abort       it dies by SIGABRT there, recording nothing (as gloo and NCCL end a process)
    RANK:STEP:alloc=MIB   it holds MIB MiB more from there on (a memory budget's case)

Read once, when training starts; `Fault.at(step)` costs a comparison per step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

FAULT_ENV = "LAUNCHER_TEST_FAULT"

_BALLAST: list[torch.Tensor] = []  # memory held by the "alloc" fault, for the rest of the run


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int | None = None  # None: no fault for this rank
    how: str = "raise"

    @classmethod
    def for_rank(cls, rank: int) -> Fault:
        rank_text, step_text, *how = os.environ.get(FAULT_ENV, "-1:-1").split(":")
        if int(rank_text) != rank:
            return cls(rank)
        return cls(rank, int(step_text), how[0] if how else "raise")

    def at(self, step: int) -> None:
        """Inject the fault when `step` is its step."""
        if step != self.step:
            return
        if self.how == "hang":
            time.sleep(10**6)  # the other ranks wait in this step's all-reduce
        if self.how == "abort":
            os.abort()
        if self.how.startswith("alloc="):  # hold that many MiB, touched (resident), and go on
            _BALLAST.append(torch.ones(int(self.how.split("=", 1)[1]) * 2**20, dtype=torch.uint8))
            return
        raise RuntimeError(f"fault injected by {FAULT_ENV} on rank {self.rank} at step {step}")
