"""train.profile_steps (launcher.train.profile): where a step's time goes, as a table by part."""

from __future__ import annotations

import gzip
import json

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from launcher.train.profile import PARTS, breakdown, part_of


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


def _event(index, name, start_us, end_us, *, parent=None, kernel_us=0.0, on_gpu=False):
    """One event as torch.autograd.profiler's parser builds it from a CUDA profile: an operator on the host
    (its kernels appended to it, its scope its cpu_parent), or a kernel or range on the GPU."""
    event = FunctionEvent(
        index, name, thread=7 if on_gpu else 1, start_us=start_us, end_us=end_us, use_device="cuda",
        device_type=DeviceType.CUDA if on_gpu else DeviceType.CPU,
    )  # fmt: skip
    if kernel_us:
        event.append_kernel(name + "_kernel", 0, kernel_us)
    if parent is not None:
        event.cpu_parent = parent
        parent.cpu_children.append(event)
    return event


def test_on_a_gpu_each_kernel_counts_once_and_the_data_wait_is_the_time_spent_waiting():
    """torch lists a kernel twice (in its operator, and as an event of its own) and a named range once more
    on the GPU: each kernel's time counts once, at its operator, in its scopes."""
    data = _event(1, "launcher/data", 0, 3000)  # 3 ms waiting for a batch: no operator, no kernel
    loss = _event(2, "launcher/loss", 3000, 5000)
    matmul = _event(3, "aten::mm", 3010, 3020, parent=loss, kernel_us=1000)
    optimizer = _event(4, "launcher/optimizer", 5000, 6000)
    step = _event(5, "Optimizer.step#AdamW.step", 5010, 5900, parent=optimizer)  # torch's own range
    adam = _event(6, "aten::_fused_adamw_", 5020, 5030, parent=step, kernel_us=500)
    on_gpu = [
        _event(7, "sm90_xmma_gemm_bf16_kernel", 3100, 4100, on_gpu=True),
        _event(8, "fused_adamw_kernel", 5100, 5600, on_gpu=True),
        _event(9, "Optimizer.step#AdamW.step", 5100, 5600, on_gpu=True),  # the range's copy on the GPU
        _event(10, "launcher/loss", 3100, 4100, on_gpu=True),
    ]
    result = breakdown([data, loss, matmul, optimizer, step, adam, *on_gpu], wall_s=0.01, steps=1, device="cuda")
    counted = {part: round(seconds * 1e3, 6) for part, seconds in result.seconds.items() if seconds}
    assert counted == {"data wait": 3.0, "loss": 1.0, "optimizer": 0.5, "idle": 5.5}
    # On a CPU an operator's own CPU time counts; the data wait is its scope's wall time, what ran in it included.
    fetch = _event(11, "aten::stack", 100, 400, parent=data)
    result = breakdown([data, fetch, loss, matmul], wall_s=0.01, steps=1, device="cpu")
    counted = {part: round(seconds * 1e3, 6) for part, seconds in result.seconds.items() if seconds}
    assert counted == {"data wait": 3.0, "loss": 0.01, "idle": 6.99}


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
