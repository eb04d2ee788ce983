"""train.profile_steps (launcher.train.profile): where a step's time goes, as a table by part."""

from __future__ import annotations

import gzip
import json

import pytest

from launcher.train.profile import PARTS, part_of


@pytest.mark.parametrize(
    ("name", "scopes", "part"),
    [
        ("aten::addmm", ["forward"], "matmuls"),
        ("aten::mm", ["backward"], "matmuls"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", [], "matmuls"),
        ("aten::_scaled_dot_product_flash_attention", ["vision", "forward"], "attention (vision, forward)"),
        ("aten::_scaled_dot_product_efficient_attention", ["forward"], "attention (language, forward)"),
        ("aten::_scaled_dot_product_flash_attention_backward", [], "attention (backward)"),
        ("aten::addmm", ["loss", "forward"], "loss"),  # the output layer's chunks belong to the loss
        ("aten::_foreach_add_", ["optimizer"], "optimizer"),
        ("nccl:all_reduce", ["optimizer"], "communication"),  # a collective is communication wherever it runs
        ("aten::copy_", ["forward"], "copies"),
        ("Memcpy HtoD (Pinned -> Device)", [], "copies"),
        ("aten::mul", ["data"], "data wait"),  # whatever runs while the loop waits for its batch
        ("aten::rms_norm", ["forward"], "other ops"),
    ],
)
def test_each_operator_goes_to_one_part(name, scopes, part):
    assert part_of(name, scopes) == part


def test_a_profiled_run_writes_the_table_the_trace_and_the_shares(train_in_process, tmp_path):
    ran = train_in_process(
        "train.max_steps=4", "train.profile_steps=[2,3]", "train.eval_every=0", "data.eval_accuracy=false",
        "train.micro_batch_size=8", "logger=none",
    )  # fmt: skip
    summary = ran.summary()
    assert summary["status"] == "completed", ran.error
    shares = summary["profile"]
    assert list(shares) == list(PARTS)
    # The tiny LLaVA's work shows in its parts: its vision tower's attention inside the tower's scope, the
    # output layer's chunks in the loss, the optimizer's step; idle is what no operator accounts for.
    for part in ("matmuls", "attention (vision, forward)", "attention (language, forward)", "loss", "optimizer"):
        assert shares[part] > 0, (part, shares)
    assert sum(shares.values()) == pytest.approx(1.0, abs=0.02) or shares["idle"] == 0
    table = (ran.run_dir / "profile.md").read_text()
    assert table.startswith("# Where steps 2-3 went (rank 0)\n\n2 steps in ")
    assert [line.split(" | ")[0].strip("| ") for line in table.splitlines()[6:]] == list(PARTS)
    with gzip.open(ran.run_dir / "profile_trace.json.gz", "rt") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert {"launcher/data", "launcher/forward", "launcher/backward", "launcher/optimizer", "launcher/vision"} <= names


def test_a_run_that_ends_inside_the_profiled_steps_writes_what_it_recorded(train_in_process):
    ran = train_in_process(
        "train.max_steps=3", "train.profile_steps=[3,100]", "train.eval_every=0", "data.eval_accuracy=false",
        "train.micro_batch_size=8", "logger=none",
    )  # fmt: skip
    assert ran.summary()["status"] == "completed", ran.error
    assert (ran.run_dir / "profile.md").read_text().startswith("# Where steps 3-3 went (rank 0)\n\n1 step in ")
