"""Preference pairs as a preference loss trains on them: one item per pair, one batch of 2 x B rows.

The reader (launcher.data.formats.pair_records) makes each preference record two adjacent records, its
chosen conversation at an even position and its rejected one after it, so the record index and the data
cache hold and tokenize them as any records. A pair trains only when both its records survived (decoded,
within data.max_length); one whose other half was skipped is left out as a whole.

A batch of B pairs is the rows of their chosen conversations, then those of their rejected ones (2 x B
rows, one forward pass), with `pair_index` (each pair's position in its set: where its reference
log-probs are kept) beside them. Only the last answer of each row is labelled: the turns before it are
the same in both rows, and a pair is scored by its answers alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from launcher.data.length import IGNORE_INDEX

PAIR_INDEX = "pair_index"  # a batch's tensor of its pairs' positions in their set (not a model input)


def whole_pairs(positions: Sequence[int]) -> np.ndarray:
    """The rows (indices into `positions`, the record positions of a set's rows) of each pair both of
    whose records are there: an int64 array of [chosen row, rejected row]."""
    positions = np.asarray(positions, dtype=np.int64)
    row_of = {int(position): row for row, position in enumerate(positions)}
    pairs = [
        (row, row_of[int(position) + 1])
        for row, position in enumerate(positions)
        if position % 2 == 0 and int(position) + 1 in row_of
    ]
    return np.asarray(pairs, dtype=np.int64).reshape(-1, 2)


class PairedRows(Dataset):
    """A set's rows (the data cache's records, or records read) -> one item per whole pair:
    {"chosen": row, "rejected": row, "pair": its position}."""

    def __init__(self, rows: Any, positions: Sequence[int]):
        self.rows = rows
        self.pairs = whole_pairs(positions)
        self.dropped = len(positions) - 2 * len(self.pairs)  # rows whose pair's other half was skipped

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        chosen, rejected = self.pairs[index]
        return {"chosen": self.rows[int(chosen)], "rejected": self.rows[int(rejected)], "pair": int(index)}

    def lengths(self) -> np.ndarray:
        """A pair's length: its longer row's (what length-grouped batches sort by)."""
        lengths = self.rows.lengths()
        return np.maximum(lengths[self.pairs[:, 0]], lengths[self.pairs[:, 1]])

    @property
    def sources(self) -> np.ndarray:
        return np.asarray(self.rows.sources)[self.pairs[:, 0]]


class PairCollator:
    """Items of `PairedRows` -> one batch of the rows' collator: the chosen rows, then the rejected ones,
    each labelled on its last answer only, and `pair_index`."""

    def __init__(self, collate: Callable[[list[Any]], dict[str, torch.Tensor]]):
        self.collate = collate

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collate([item["chosen"] for item in items] + [item["rejected"] for item in items])
        batch["labels"] = last_answer_only(batch["labels"])
        batch[PAIR_INDEX] = torch.tensor([item["pair"] for item in items], dtype=torch.int64)
        return batch


def last_answer_only(labels: torch.Tensor) -> torch.Tensor:
    """Labels with every answer but each row's last (its last run of labelled tokens) ignored."""
    labelled = labels != IGNORE_INDEX
    positions = torch.arange(labels.shape[1]).expand_as(labels)
    last = torch.where(labelled, positions, -1).amax(dim=1, keepdim=True)  # the last labelled token
    # The last ignored position before it: everything up to there goes.
    gap = torch.where(~labelled & (positions < last), positions, -1).amax(dim=1, keepdim=True)
    return labels.masked_fill(positions <= gap, IGNORE_INDEX)
