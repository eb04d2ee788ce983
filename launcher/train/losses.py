"""The training objective as one object: what a step's loss is the mean over, one micro-batch's forward
pass, and the metrics its sums give. The step (launcher.train.step) and the evaluation
(launcher.train.evaluate) run every loss through the same three calls:

    units(batch)                          what the micro-batch's loss averages over (answer tokens, pairs)
    forward(model, batch, to_device, sums) the micro-batch's loss (the mean over its units), its sums added
    sums.metrics(prefix)                   {prefix/loss, ...} once the sums are reduced over micro-batches and ranks

Here: the answers' cross-entropy (loss=sft). The preference losses (loss=dpo|ipo) are
launcher.train.preference's `PreferenceLoss`. Every loss reads the answers' log-probabilities through
`row_logps`, which never builds the whole logits (launcher.model.logps) unless loss.chunk_tokens=0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch import nn

from launcher.data.length import IGNORE_INDEX
from launcher.model.components import base_model
from launcher.model.logps import ANSWER_CHUNK, ANSWER_LABELS, ANSWER_TOTAL, answer_logps


def answer_tokens(batch: dict[str, Any]) -> int:
    """The tokens a batch's loss averages over: labels not ignored (-100), after the shift by one that
    the causal-LM loss applies (the first position predicts nothing)."""
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())


def logps_installed(model: nn.Module) -> bool:
    """Whether `model` (a DeepSpeed engine, a peft model or a transformers model) has the row log-probs
    mode (launcher.model.logps.install_answer_logps)."""
    model = getattr(model, "module", model)  # DeepSpeed's engine holds the model as .module
    return bool(getattr(base_model(model), "_answer_logps_installed", False))


def row_logps(model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Each row's log-probability of its labelled tokens, fp32 [rows]: `chunk` tokens at a time through
    the output layer, or from the whole logits (chunk 0, or a model without the mode)."""
    if chunk and logps_installed(model):
        return model(**inputs, **{ANSWER_LABELS: labels, ANSWER_CHUNK: chunk})
    return answer_logps(model(**inputs).logits, labels)


def total_logp(model: nn.Module, inputs: dict[str, Any], labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """`row_logps` summed over the rows, fp32 [1], through the row log-probs mode (whose fused loss,
    model.kernels=liger, makes a total's gradients in its forward pass)."""
    return model(**inputs, **{ANSWER_LABELS: labels, ANSWER_CHUNK: chunk, ANSWER_TOTAL: True})


class Sums:
    """What a loss's micro-batches add up to, as plain numbers: summed over micro-batches, then over ranks
    (`as_list` is what the all-reduce carries, `type(sums)(*reduced)` what it gives back)."""

    def as_list(self) -> list[float]:
        return [float(x) for x in astuple(self)]

    def metrics(self, prefix: str) -> dict[str, float]:
        raise NotImplementedError


class Loss:
    """A training objective (see the module's docstring)."""

    name = ""
    chunk = 0  # loss.chunk_tokens: tokens per chunk through the output layer (0: the whole logits)

    def units(self, batch: dict[str, Any]) -> int:
        raise NotImplementedError

    def new_sums(self) -> Sums:
        raise NotImplementedError

    def forward(self, model: Any, batch: dict[str, Any], split: str, to_device: Callable[[dict], dict], sums: Sums):
        raise NotImplementedError


@dataclass
class TokenSums(Sums):
    loss: float = 0.0  # the summed cross-entropy of the answer tokens
    tokens: float = 0.0

    def metrics(self, prefix: str) -> dict[str, float]:
        return {f"{prefix}/loss": self.loss / max(self.tokens, 1.0)}


@dataclass
class AnswerCrossEntropy(Loss):
    """loss=sft: the mean cross-entropy over every answer token. With loss.chunk_tokens=0 it is
    transformers' own loss of the model's forward (the whole logits); otherwise the same mean from
    `row_logps`, equal to 1e-5 (tests/unit/model/test_logps.py)."""

    chunk: int = 0
    name = "sft"

    def units(self, batch: dict[str, Any]) -> int:
        return answer_tokens(batch)

    def new_sums(self) -> TokenSums:
        return TokenSums()

    def forward(
        self, model: Any, batch: dict[str, Any], split: str, to_device: Callable[[dict], dict], sums: TokenSums
    ) -> torch.Tensor:
        tokens = answer_tokens(batch)
        inputs = to_device(batch)
        if self.chunk and logps_installed(model):
            labels = inputs.pop("labels")
            loss = -total_logp(model, inputs, labels, self.chunk).sum() / max(tokens, 1)
        else:
            loss = model(**inputs).loss
        sums.loss += float(loss.detach()) * tokens
        sums.tokens += tokens
        return loss
