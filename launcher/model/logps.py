"""Each row's log-probability of its answer, without the logits of the whole batch.

A causal language model's loss needs, per labelled token, log softmax(lm_head(h))[target]. Computed
the plain way (transformers' own forward) it first builds the logits of every position: at 8,192 tokens
x a 151,936-word vocabulary that is 2.5 GB in bf16 and 5 GB once upcast for the loss, and as much
again for their gradient. Here:

  - only the positions whose next token is labelled go through the output layer (prompt, image and
    padding positions predict nothing the loss reads);
  - those go through it `chunk` tokens at a time, each chunk under activation checkpointing, so that
    the backward pass recomputes a chunk's logits instead of keeping them: at most one chunk's logits
    (and their gradient) exist at any moment.

The output layer is called as a module, once per chunk and again per chunk in the backward pass, so
DeepSpeed's hooks (ZeRO-3 gathers its weight) and peft's adapters see ordinary calls.

`install_answer_logps(model)` gives a loaded model's forward a second mode, used by the losses
(launcher.train.losses): called with `answer_labels=LABELS, answer_chunk=N` it returns each row's summed
log-probability of its labelled tokens ([rows], fp32) instead of an output with logits (with
`answer_total=True`, their sum over the rows, [1]). Without those
keywords (generation, evaluation by exact match, export) it is the model's own forward.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from launcher.core.scopes import scope
from launcher.data.length import IGNORE_INDEX
from launcher.model.kernels import fused_answer_logps, fused_loss_installed

ANSWER_LABELS = "answer_labels"  # the keyword that switches a model's forward to row log-probs
ANSWER_CHUNK = "answer_chunk"  # tokens per chunk through the output layer
ANSWER_TOTAL = "answer_total"  # True: the sum over all rows [1] (what SFT needs), not each row's


def answer_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its labelled tokens (the causal shift applied), in fp32: [rows].
    From the whole logits: the plain path (loss.chunk_tokens=0), and what the chunked one must equal."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    labelled = labels != IGNORE_INDEX
    tokens = labels.masked_fill(~labelled, 0).unsqueeze(-1)
    # gather - logsumexp: the labelled tokens' log-softmax without a second vocabulary-wide tensor.
    token_logps = torch.gather(logits, -1, tokens).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (token_logps * labelled).sum(-1)


def _token_logps(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(head(hidden))[targets] of one chunk of positions, in fp32: [chunk]."""
    logits = head(hidden).float()
    return torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_answer_logps(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    *,
    total: bool = False,
    fused: bool = False,
) -> torch.Tensor:
    """`answer_logps` of `head(hidden)` without the whole logits: [rows], fp32; `total`: their sum, [1].

    `hidden`: the last hidden states [rows, length, width]; `labels`: [rows, length], IGNORE_INDEX where
    nothing is predicted. Only positions whose next token is labelled reach `head`, `chunk` at a time, or
    (`fused`, model.kernels=liger) through liger's fused linear cross-entropy, in chunks of its own
    (launcher.model.kernels)."""
    with scope("loss"):  # a profile's part (launcher.train.profile)
        return _chunked(head, hidden, labels, chunk, total=total, fused=fused)


def _chunked(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk: int, *, total: bool, fused: bool
) -> torch.Tensor:
    targets = labels[:, 1:]
    labelled = targets != IGNORE_INDEX
    rows = labelled.nonzero()[:, 0]  # the row of each labelled position, in order
    picked, wanted = hidden[:, :-1][labelled], targets[labelled]
    if fused:
        return fused_answer_logps(head, picked, wanted, rows, labels.shape[0], total=total)
    keep_graph_small = torch.is_grad_enabled()
    pieces = []
    # At least one call, even with no labelled token: the result then still hangs off the model's graph
    # (a micro-batch without answers backpropagates zeros instead of failing).
    for start in range(0, max(len(wanted), 1), chunk):
        part = slice(start, start + chunk)
        if keep_graph_small:  # the backward pass recomputes the chunk's logits rather than keeping them
            pieces.append(checkpoint(_token_logps, head, picked[part], wanted[part], use_reentrant=False))
        else:
            pieces.append(_token_logps(head, picked[part], wanted[part]))
    token_logps = torch.cat(pieces)
    if total:
        return token_logps.sum().reshape(1)
    return torch.zeros(labels.shape[0], dtype=token_logps.dtype, device=token_logps.device).index_add(
        0, rows.to(token_logps.device), token_logps
    )


def has_output_layer(model: nn.Module) -> bool:
    """Whether the model is a body (`.model`, giving last_hidden_state) under an output layer (`.lm_head`):
    transformers' LLaVA and Qwen2-VL families (and most causal LMs) are."""
    return all(isinstance(getattr(model, name, None), nn.Module) for name in ("model", "lm_head"))


def install_answer_logps(model: nn.Module) -> bool:
    """Give `model` (a transformers model, before peft or DeepSpeed wrap it) the row log-probs mode;
    False when its layout is not a body under an output layer (the losses then use the whole logits)."""
    if not has_output_layer(model):
        return False
    if getattr(model, "_answer_logps_installed", False):
        return True

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        labels = kwargs.pop(ANSWER_LABELS, None)
        chunk = kwargs.pop(ANSWER_CHUNK, None)
        total = bool(kwargs.pop(ANSWER_TOTAL, False))
        if labels is None:
            return type(self).forward(self, *args, **kwargs)
        for unused in ("labels", "logits_to_keep"):
            kwargs.pop(unused, None)
        hidden = self.model(*args, **kwargs).last_hidden_state
        labels, fused = labels.to(hidden.device), fused_loss_installed(self)
        return chunked_answer_logps(self.lm_head, hidden, labels, int(chunk), total=total, fused=fused)

    # generate() checks its inputs against the forward's signature: the class's own.
    forward.__signature__ = inspect.signature(type(model).forward)
    model.forward = types.MethodType(forward, model)  # bound: a deep copy of the model binds its copy
    model._answer_logps_installed = True
    return True
