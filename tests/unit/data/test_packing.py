"""launcher.data.packing: the plan packs every record exactly once, within the budget, tightly, as a pure
function of its inputs; the collator puts a row's records end to end, images in order, padding apart.
(That packed records keep their losses: tests/unit/model/test_packing.py.)"""

from __future__ import annotations

import numpy as np
import torch

from launcher.data.length import IGNORE_INDEX
from launcher.data.packing import PACK_BLOCK, REAL_TOKENS, RECORD_IMAGES, RECORD_LENGTHS, PackedCollator, pack_rows


def test_every_record_is_packed_once_within_the_budget_and_tightly():
    lengths = np.random.default_rng(0).integers(20, 401, 2500)  # the variable-length bench set's spread
    rows = pack_rows(lengths, 2048, seed=3, epoch=0)
    packed = sorted(i for row in rows for i in row)
    assert packed == list(range(2500))
    assert all(sum(lengths[row]) <= 2048 for row in rows)
    fill = lengths.sum() / (len(rows) * 2048)
    assert fill > 0.97  # padding share under 3% at this budget (the last row of each block is partial)
    assert rows == pack_rows(lengths, 2048, seed=3, epoch=0)  # a pure function: a resume recomputes it
    assert rows != pack_rows(lengths, 2048, seed=3, epoch=1)  # another epoch, another order
    assert len(rows) >= -(-lengths.sum() // 2048)


def test_a_record_over_the_budget_is_a_row_of_its_own_and_blocks_are_packed_apart():
    lengths = [300, 5000, 10, 10] + [100] * (PACK_BLOCK + 5)
    rows = pack_rows(lengths, 512, seed=0, epoch=0)
    assert [1] in rows
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))


def test_a_row_holds_at_most_max_images_and_records_without_images_still_fill_it():
    """data.pack_max_images: the variable bench set's records with 0-3 images each, rows of 2,048 tokens of
    at most 4 images; a record of more is a row of its own. Without a limit the plan is the plan of old (a
    resume of an earlier run recomputes the same rows)."""
    rng = np.random.default_rng(1)
    lengths, images = rng.integers(20, 401, 2500), rng.integers(0, 4, 2500)
    images[7] = 6  # more than the limit: alone
    rows = pack_rows(lengths, 2048, seed=3, epoch=0, images=images, max_images=4)
    assert sorted(i for row in rows for i in row) == list(range(2500))
    assert all(sum(lengths[row]) <= 2048 for row in rows) and [7] in rows
    assert max(images[row].sum() for row in rows if row != [7]) == 4
    uncapped = pack_rows(lengths, 2048, seed=3, epoch=0)
    assert max(images[row].sum() for row in uncapped) > 4
    assert pack_rows(lengths, 2048, seed=3, epoch=0, images=images) == uncapped  # no limit: as before
    assert any(images[row].sum() == 4 and 0 in images[row] for row in rows)  # text joins a row at its limit
    # The limit binds here (~10 records of ~210 tokens fit 2,048, with ~15 images): rows are filled to it.
    assert np.mean([images[row].sum() for row in rows]) > 3.9


def test_the_collator_joins_each_rows_records_and_pads_the_rows_apart(model_and_processor):
    _, processor = model_and_processor
    pad = processor.tokenizer.pad_token_id

    def record(n: int, images: int) -> dict:
        tensors = {"input_ids": torch.arange(1, n + 1), "labels": torch.full((n,), 7)}
        if images:
            tensors["pixel_values"] = torch.full((images, 3, 2, 2), float(n))
        return {"tensors": tensors}

    batch = PackedCollator(processor)([[record(3, 1), record(2, 0)], [record(4, 2)]])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 1, 2], [1, 2, 3, 4, pad]]
    assert batch["labels"][1, 4] == IGNORE_INDEX and batch[REAL_TOKENS].tolist() == [[1] * 5, [1, 1, 1, 1, 0]]
    assert batch[RECORD_LENGTHS] == [[3, 2], [4]] and batch[RECORD_IMAGES] == [[1, 0], [2]]
    assert batch["pixel_values"][:, 0, 0, 0].tolist() == [3.0, 4.0, 4.0]  # in the rows' order
