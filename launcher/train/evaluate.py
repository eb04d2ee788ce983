"""Held-out evaluation of one rank's share: the loss, and exact match of greedy answers (data.eval_accuracy)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from launcher.core.signals import pause_for_test
from launcher.data.accuracy import exact_match_accuracy
from launcher.job.spec import Job
from launcher.train.distributed import Rank, all_reduce_sum
from launcher.train.engine import Engine
from launcher.train.loaders import Data
from launcher.train.losses import Loss
from launcher.train.step import to_device

log = logging.getLogger("launcher")


def evaluation_due(job: Job, step: int) -> bool:
    """Every train.eval_every steps (0: never), and at the last step."""
    every = int(job.config.train.eval_every)
    return bool(every and step % every == 0) or step == job.max_steps


def eval_line(metrics: dict[str, float]) -> str:
    """The terminal's evaluation line, as the step lines read: "eval | loss 3.8997 | accuracy 0.0150"."""
    return " | ".join(["eval", *(f"{name.removeprefix('eval/')} {value:.4f}" for name, value in metrics.items())])


@torch.no_grad()
def evaluate(
    job: Job,
    engine: Engine,
    data: Data,
    rank: Rank,
    loss: Loss,
    stop: Callable[[], bool] = lambda: False,
) -> tuple[dict[str, float], bool]:
    """Held-out loss, the mean over every answer token (or pair) of the held-out set as training averages a step
    (and exact-match accuracy when data.eval_accuracy), over all ranks; and whether some rank was asked to
    stop meanwhile (`stop`), agreed in the evaluation's one all-reduce, so that a stop signal that lands
    during an evaluation ends the run after this step instead of after the next one."""
    if data.eval_loader is None:  # no held-out data given
        return {}, False
    ds, device = engine.engine, rank.device
    ds.eval()
    pause_for_test("eval", until=stop)  # the tests' stop signals land here (a no-op otherwise)
    sums = loss.new_sums()
    for batch in data.eval_loader:
        loss.forward(ds, batch, "eval", lambda inputs: to_device(inputs, device, engine.dtype), sums)
    correct, total = 0.0, 0.0
    if data.accuracy_set is not None:
        correct, total = exact_match_accuracy(
            ds.module,
            engine.processor,
            data.accuracy_set,
            max_new_tokens=int(job.config.data.max_new_tokens),
            synced_gpus=engine.zero_stage == 3 and rank.world_size > 1,
            video_every_batch=data.video_guard,
        )
    correct, total, stop_votes, *reduced = all_reduce_sum([correct, total, float(stop()), *sums.as_list()], device)
    metrics = type(sums)(*reduced).metrics("eval")
    if data.accuracy_set is not None:
        metrics["eval/accuracy"] = correct / max(total, 1.0)
    ds.train()
    if rank.is_main and metrics:
        log.info("%s", eval_line(metrics))
    return metrics, stop_votes > 0
