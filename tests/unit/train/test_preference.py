"""Preference losses and their pieces: each answer's log-probability, DPO/IPO against their formulas,
the pairs a batch holds (launcher.train.preference, launcher.data.pairs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from launcher.config.schema import LossConfig, LossName
from launcher.data.length import IGNORE_INDEX
from launcher.data.pairs import PAIR_INDEX, PairCollator, PairedRows, last_answer_only, whole_pairs
from launcher.model.logps import answer_logps
from launcher.train.preference import PairSums, pair_losses

I = IGNORE_INDEX  # noqa: E741 (a label grid reads best with one letter for "ignored")


def _loss(name: str = "dpo", beta: float = 0.1, smoothing: float = 0.0) -> LossConfig:
    return LossConfig(name=LossName[name], beta=beta, label_smoothing=smoothing)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_is_log_2_while_the_policy_is_the_reference(smoothing):
    logps = torch.tensor([[-3.5, -1.25, -7.0], [-2.0, -9.5, -0.5]])
    losses, chosen, rejected = pair_losses(_loss(smoothing=smoothing), logps, logps.clone())
    assert torch.equal(losses, torch.full((3,), math.log(2.0)))
    assert torch.equal(chosen, torch.zeros(3)) and torch.equal(rejected, torch.zeros(3))


def test_dpo_and_ipo_follow_their_papers_formulas():
    rng = np.random.default_rng(0)
    policy = rng.normal(-5, 2, size=(2, 16))
    reference = rng.normal(-5, 2, size=(2, 16))
    beta, eps = 0.3, 0.15
    for name in ("dpo", "ipo"):
        losses, chosen, rejected = pair_losses(
            _loss(name, beta, eps if name == "dpo" else 0.0), torch.tensor(policy), torch.tensor(reference)
        )
        for k in range(16):
            h = (policy[0, k] - reference[0, k]) - (policy[1, k] - reference[1, k])
            if name == "dpo":  # -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
                expected = (1 - eps) * math.log1p(math.exp(-beta * h)) + eps * math.log1p(math.exp(beta * h))
            else:  # (h - 1 / (2 beta))^2
                expected = (h - 1 / (2 * beta)) ** 2
            assert float(losses[k]) == pytest.approx(expected, rel=1e-12)
            assert float(chosen[k]) == pytest.approx(beta * (policy[0, k] - reference[0, k]), rel=1e-12)
            assert float(rejected[k]) == pytest.approx(beta * (policy[1, k] - reference[1, k]), rel=1e-12)


def test_raising_the_chosen_answers_probability_lowers_the_dpo_loss():
    policy = torch.tensor([[-4.0], [-4.0]], requires_grad=True)
    losses, _, _ = pair_losses(_loss(), policy, torch.tensor([[-4.0], [-4.0]]))
    losses.sum().backward()
    assert policy.grad[0, 0] < 0 < policy.grad[1, 0]  # descent raises chosen, lowers rejected


def test_an_answers_log_probability_sums_its_labelled_tokens_after_the_shift():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[I, I, 3, 1, I], [I, 4, 4, 2, 6]])
    expected = []
    for row in range(2):
        total = 0.0
        for position in range(1, 5):  # token t is predicted by the logits at t - 1
            if labels[row, position] != I:
                total += float(torch.log_softmax(logits[row, position - 1], -1)[labels[row, position]])
        expected.append(total)
    assert answer_logps(logits, labels).tolist() == pytest.approx(expected, abs=1e-5)


def test_only_each_rows_last_answer_is_labelled():
    labels = torch.tensor([[I, 5, 6, I, I, 7, 8, I], [I, I, I, 1, 2, 3, I, I], [9, I, 4, 4, 4, 4, 4, 4]])
    assert last_answer_only(labels).tolist() == [
        [I, I, I, I, I, 7, 8, I],
        [I, I, I, 1, 2, 3, I, I],
        [I, I, 4, 4, 4, 4, 4, 4],
    ]


def test_a_pair_whose_other_half_was_skipped_is_left_out():
    # Record positions of the surviving rows: pair 1's rejected (3) and pair 2's chosen (4) were skipped.
    positions = [0, 1, 2, 5, 6, 7]
    assert whole_pairs(positions).tolist() == [[0, 1], [4, 5]]
    paired = PairedRows(list("abcdef"), positions)
    assert len(paired) == 2 and paired.dropped == 2
    assert paired[1] == {"chosen": "e", "rejected": "f", "pair": 1}


def test_a_batch_of_pairs_is_their_chosen_rows_then_their_rejected_rows():
    def rows(samples):
        return {
            "input_ids": torch.tensor([s["ids"] for s in samples]),
            "labels": torch.tensor([s["labels"] for s in samples]),
        }

    items = [
        {"chosen": {"ids": [1, 2], "labels": [I, 2]}, "rejected": {"ids": [1, 3], "labels": [I, 3]}, "pair": 4},
        {"chosen": {"ids": [5, 6], "labels": [I, 6]}, "rejected": {"ids": [5, 7], "labels": [I, 7]}, "pair": 0},
    ]
    batch = PairCollator(rows)(items)
    assert batch["input_ids"].tolist() == [[1, 2], [5, 6], [1, 3], [5, 7]]
    assert batch[PAIR_INDEX].tolist() == [4, 0]


def test_pair_sums_give_the_rewards_people_read():
    sums = PairSums()
    sums.add(torch.tensor([0.5, 0.7]), torch.tensor([0.3, -0.1]), torch.tensor([0.1, 0.2]))
    sums.add(torch.tensor([0.3]), torch.tensor([0.4]), torch.tensor([-0.4]))
    metrics = sums.metrics("eval")
    assert metrics["eval/loss"] == pytest.approx(0.5)
    assert metrics["eval/rewards_chosen"] == pytest.approx(0.2)
    assert metrics["eval/rewards_rejected"] == pytest.approx(-0.1 / 3)
    assert metrics["eval/rewards_margin"] == pytest.approx(0.2 + 0.1 / 3)
    assert metrics["eval/rewards_accuracy"] == pytest.approx(2 / 3)
    assert PairSums(*sums.as_list()) == sums  # what the ranks' all-reduce carries
