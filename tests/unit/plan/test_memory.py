"""launcher.plan.memory: its arithmetic by hand, the presets table against conf/deepspeed, and (slow) its
model-state estimates against what DeepSpeed engines hold and its activations against what autograd saves.

What an engine "holds" (`held_bytes`), each tensor storage counted once, in this order:
  params     the module's parameters (their flat 16-bit/fp32 buffers at ZeRO 1-2, the ZeRO-3 partition
             `ds_tensor` plus any whole persistent parameter), and at ZeRO 1-2 with optimizer offload
             the 16-bit partition copy on the CPU (param_buffer_of_bit16_for_cpu_offload_groups);
  master     the fp32 master weights: single_partition_of_fp32_groups (ZeRO 1-2),
             fp32_partitioned_groups_flat (ZeRO 3), fp32_groups_flat (stage 0 in bf16);
  optimizer  every tensor in the basic optimizer's `state` (Adam's exp_avg, exp_avg_sq, step);
  grads      p.grad of every parameter, the .grad of the master tensors, and the ZeRO optimizer's
             gradient holders: averaged_gradients, all_grad_tensors, accumulated_grads_in_cpu,
             grad_partitions_flat_buffer and the ZeRO-3 per-parameter grad partitions;
  other      anything else the optimizer wrapper references (communication buckets and the like):
             reported, not compared, and checked to be small.
It is measured after one full optimizer step (gradient accumulation 2), at the end of the backward
pass of the next, non-boundary micro step: optimizer states exist and gradients are accumulating.

The world-size-1 probe trains in this process (the `process_group` fixture's gloo group); the
world-size-2 one runs this module under torchrun. By hand:
    python -m torch.distributed.run --nproc_per_node=2 -m tests.unit.plan.test_memory probe MODEL_DIR CASES.json
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.config.ds_config import build_ds_config
from launcher.config.precision import Device
from launcher.model import stats as model_stats
from launcher.model.stats import ModelStats, TransformerDims
from launcher.plan import memory
from launcher.plan.memory import (
    BYTES,
    PRESETS,
    Layout,
    Row,
    Target,
    activation_bytes,
    estimate,
    fits,
    layout_from_ds_config,
    model_state_bytes,
    recommend,
)
from tests.helpers import ROOT, compose_plain, compose_typed, free_port, saved_for_backward

G = 10**9


# ----------------------------------------------------------------------------- arithmetic by hand
# 1e9 parameters, all trainable, 8 ranks: t = 1.25e8 elements per partition.
BY_HAND = [
    # preset, dtype, (params, grads, master, optimizer, on_cpu)
    ("z0", "bf16", (2 * G, 2 * G, 4 * G, 8 * G, 0)),
    ("z0", "fp32", (4 * G, 4 * G, 0, 8 * G, 0)),
    ("z1", "bf16", (2 * G, 2 * G, G // 2, G, 0)),
    ("z1", "fp32", (4 * G, 4 * G, G // 2, G, 0)),
    ("z2", "bf16", (2 * G, G // 4, G // 2, G, 0)),
    ("z2", "fp32", (4 * G, G // 2, G // 2, G, 0)),
    ("z3", "bf16", (G // 4, G // 4, G // 2, G, 0)),
    ("z3", "fp32", (G // 2, G // 2, G // 2, G, 0)),
    # CPU: master 0.5 + Adam 1 + fp32 gradient partition 0.5 + 16-bit partition copy 0.25
    ("z2_offload", "bf16", (2 * G + G // 4, G // 2, G // 2, G, 9 * G // 4)),
    # CPU: partitions 0.25 + gradients (fp32 0.5 + 16-bit 0.25) + master 0.5 + Adam 1
    ("z3_offload", "bf16", (G // 4, 3 * G // 4, G // 2, G, 5 * G // 2)),
]


@pytest.mark.parametrize(("preset", "dtype", "expected"), BY_HAND, ids=[f"{p}-{d}" for p, d, _ in BY_HAND])
def test_model_states_by_hand(preset, dtype, expected):
    stage, optimizer, param = PRESETS[preset]
    layout = Layout(stage=stage, dtype=dtype, offload_optimizer=optimizer, offload_param=param, world_size=8)
    states = model_state_bytes(G, G, layout)
    assert (states.params, states.grads, states.master, states.optimizer, states.on_cpu) == expected
    assert states.on_device == sum(expected[:4]) - expected[4]


def test_frozen_parameters_cost_only_their_weights():
    # 1e9 parameters of which 2.5e8 train, 4 ranks, ZeRO-2 bf16: t = 6.25e7.
    states = model_state_bytes(G, G // 4, Layout(stage=2, dtype="bf16", world_size=4))
    assert (states.params, states.grads, states.master, states.optimizer) == (2 * G, G // 8, G // 4, G // 2)
    # ZeRO-3 partitions frozen parameters too, and keeps the persistent ones whole on top.
    states = model_state_bytes(G, G // 4, Layout(stage=3, dtype="bf16", world_size=4), persistent=1000)
    assert states.params == 2 * (G // 4) + 2 * 1000


def test_gradient_accumulation_with_offload_keeps_gradients_on_the_cpu():
    layout = Layout(stage=2, dtype="bf16", offload_optimizer="cpu", world_size=8, grad_accum=4)
    states = model_state_bytes(G, G, layout)
    assert states.grads == G // 2 + G // 4  # fp32 partition + accumulated 16-bit partition
    assert states.on_device == 2 * G  # only the 16-bit parameters stay on the device


def test_nvme_offload_moves_master_and_adam_to_disk():
    layout = Layout(stage=3, dtype="bf16", offload_optimizer="nvme", offload_param="nvme", world_size=8)
    states = model_state_bytes(G, G, layout)
    assert states.on_nvme == G // 2 + G + G // 2 + G // 4  # master, Adam, fp32 grads, parameter partitions
    assert states.on_cpu == G // 4  # the 16-bit gradient partition
    assert states.on_device == 0


def tiny_stats(frozen: tuple[str, ...] = ()) -> ModelStats:
    return ModelStats(
        name="hand",
        total=100,
        trainable=100,
        components={"vision": 10, "projector": 10, "language": 80},
        frozen=frozen,
        largest_layer=40,
        param_sizes=(40, 30, 20, 5, 5),
        text=TransformerDims(hidden=4, layers=2, intermediate=8, kv_width=4, gated=True),
        vocab_size=10,
        vision=TransformerDims(hidden=2, layers=1, intermediate=4),
        vision_tokens=5,
        image_tokens=4,
        projector_width=6,
    )


def test_activation_formula_by_hand():
    layout = Layout(stage=0, dtype="bf16", micro_batch=3)
    # language: 7 tokens x (2 layers x (10*4 + 2*4 + 4*8) + final norm 3*4) = 1204 elements
    # vision: 5 tokens x 1 layer x (12*2 + 2*4) = 160; projector: 4 tokens x 6 = 24
    # logits: 7 x 10 x (2*2 + 8) = 840 bytes
    per_sample = 2 * (1204 + 160 + 24) + 840
    assert activation_bytes(tiny_stats(), layout, seq_len=7, images=1) == 3 * per_sample
    # A frozen vision tower keeps nothing for backward; frozen vision and projector: neither does the projector.
    assert activation_bytes(tiny_stats(("vision",)), layout, seq_len=7, images=1) == 3 * (per_sample - 2 * 160)
    frozen = tiny_stats(("vision", "projector"))
    assert activation_bytes(frozen, layout, seq_len=7, images=1) == 3 * (per_sample - 2 * 184)
    # fp32: RMSNorm's upcast is free (8 h instead of 10 h per layer, 2 h for the final norm)
    fp32 = Layout(stage=0, dtype="fp32", micro_batch=1)
    assert activation_bytes(tiny_stats(), fp32, seq_len=7, images=1) == 4 * (7 * (2 * 72 + 8) + 184) + 7 * 10 * 16


def test_gradient_checkpointing_keeps_each_layers_input_and_one_layer():
    stats = ModelStats(**{**tiny_stats().__dict__, "checkpointed": ("language", "vision")})
    layout = Layout(stage=0, dtype="bf16", micro_batch=1)
    # language: 2 layers x h + one layer's 80 = 88 per token (was 160); vision: 1 x 2 + 32 = 34 (was 32)
    elements = 7 * (2 * 4 + 80 + 12) + 5 * (1 * 2 + 32) + 24
    assert activation_bytes(stats, layout, seq_len=7, images=1) == 2 * elements + 840


def test_liger_fused_loss_by_hand():
    """model.kernels=liger: liger's fused linear cross-entropy (launcher.plan.memory.fused_loss_bytes) in place
    of the torch chunk's logits, at every ZeRO stage (ZeRO-3 gathers the whole output layer for it)."""
    chunked = ModelStats(**{**tiny_stats().__dict__, "loss_chunk": 4})
    liger = ModelStats(**{**chunked.__dict__, "kernels": "liger"})
    bf16 = Layout(stage=2, dtype="bf16", micro_batch=3)
    body = 3 * 2 * (1204 + 160 + 24)
    assert activation_bytes(chunked, bf16, seq_len=7, images=1) == body + 4 * 10 * (2 * 2 + 8)
    # 21 tokens over ceil(10 / 4) = 3: chunks of 8 (7 rounded up to a power of two); the input's gradient 21 x 4;
    # the output layer's gradient in fp32 and in bf16, 10 x 4 x (4 + 2)
    assert activation_bytes(liger, bf16, seq_len=7, images=1) == body + 8 * 10 * 2 + 21 * 4 * 2 + 10 * 4 * 6
    zero3 = Layout(stage=3, dtype="bf16", micro_batch=3)
    assert activation_bytes(liger, zero3, seq_len=7, images=1) == activation_bytes(liger, bf16, seq_len=7, images=1)
    # Qwen2-VL-2B's output layer (151,936 x 1,536) at 2 x 8,192 tokens: chunks of 256 tokens, 1.5 GB in all
    qwen = memory.fused_loss_bytes(ModelStats(**{**liger.__dict__, "vocab_size": 151_936, "text": TransformerDims(
        hidden=1536, layers=28, intermediate=8960)}), 16_384, 2)  # fmt: skip
    assert qwen == 256 * 151_936 * 2 + 16_384 * 1536 * 2 + 151_936 * 1536 * 6


def test_step_and_buffers_by_hand():
    stats = tiny_stats()
    step, buffers = memory.step_and_buffer_bytes(stats, Layout(stage=0, dtype="bf16", world_size=2))
    assert (step, buffers) == (400, 200)  # fp32 gradients of the FP16 optimizer; the all-reduce flattening
    layout = Layout(stage=3, dtype="bf16", world_size=4, reduce_bucket=8, prefetch_bucket=6)
    assert memory.step_and_buffer_bytes(stats, layout) == (4 * 25, 2 * (8 + 6 + 2 * 40))
    offloaded = Layout(stage=2, dtype="bf16", offload_optimizer="cpu", reduce_bucket=8, allgather_bucket=1000)
    assert memory.step_and_buffer_bytes(stats, offloaded) == (0, 2 * (8 + 100))  # a bucket is at most the model


def test_a_preference_loss_doubles_the_activations_and_only_a_live_reference_costs_weights():
    stats = ModelStats(**{**tiny_stats().__dict__, "total": G, "trainable": G, "largest_layer": G // 100})
    layout = Layout(stage=3, dtype="bf16", world_size=8, ranks_per_node=8, persistence_threshold=0)
    sft = estimate(stats, layout, seq_len=7)
    pairs = estimate(stats, layout, seq_len=7, pairs=True)  # precomputed or adapter: no second model
    live = estimate(stats, layout, seq_len=7, pairs=True, live_reference=True)
    assert pairs.activations == 2 * sft.activations and pairs.reference == 0
    assert live.reference == 2 * G // 8  # bf16 weights, partitioned like the policy at ZeRO-3
    assert live.device_total == pairs.device_total + live.reference
    whole = estimate(stats, Layout(stage=2, dtype="bf16", world_size=8), seq_len=7, pairs=True, live_reference=True)
    assert whole.reference == 2 * G  # below ZeRO-3 every rank holds the whole copy
    offloaded = Layout(
        stage=3, dtype="bf16", world_size=8, ranks_per_node=8, offload_param="cpu", persistence_threshold=0
    )
    on_cpu = estimate(stats, offloaded, seq_len=7, pairs=True, live_reference=True)
    without = estimate(stats, offloaded, seq_len=7, pairs=True)
    assert on_cpu.reference == 0 and on_cpu.cpu_per_node == without.cpu_per_node + 8 * 2 * G // 8


def test_cpu_memory_per_node_is_loading_or_offloaded_states():
    stats = ModelStats(**{**tiny_stats().__dict__, "total": G, "trainable": G, "largest_layer": G // 100})
    est = estimate(stats, Layout(stage=2, dtype="bf16", world_size=8, ranks_per_node=8), seq_len=1)
    assert est.cpu_per_node == 8 * 4 * G  # each rank loads the fp32 checkpoint
    est = estimate(
        stats,
        Layout(stage=3, dtype="bf16", offload_optimizer="cpu", offload_param="cpu", world_size=8, ranks_per_node=8),
        seq_len=1,
    )
    assert est.cpu_per_node == 8 * est.states.on_cpu == 8 * (5 * G // 2)


def test_fits_and_recommend_take_the_fastest_that_fits():
    stats = tiny_stats()
    target = Target("cuda", device_bytes=1000, cpu_bytes=None, precisions=("bf16", "fp32"), headroom=0.1, source="")

    def row(preset: str, dtype: str, need: int) -> Row:
        est = estimate(stats, Layout(stage=PRESETS[preset][0], dtype=dtype), seq_len=1)
        est = memory.Estimate(**{**est.__dict__, "activations": need - est.device_total + est.activations})
        ok, _ = fits(est, target)
        return Row(preset, dtype, est, ok, "")

    rows = [row("z0", "bf16", 950), row("z0", "fp32", 800), row("z1", "fp32", 700), row("z2", "bf16", 600)]
    assert [r.fits for r in rows] == [False, True, True, True]  # 90% of 1000 usable
    best = recommend(rows)
    assert (best.preset, best.dtype) == ("z0", "fp32")
    assert recommend([row("z3_offload", "bf16", 10), row("z3", "fp32", 10)]).preset == "z3"
    assert recommend([row("z0", "bf16", 2000)]) is None


def test_recommend_orders_precisions_as_precision_auto_does_fp32_first_on_a_cpu():
    rows = [Row("z0", "bf16", None, True, ""), Row("z0", "fp32", None, True, ""), Row("z1", "bf16", None, True, "")]
    assert recommend(rows, "cpu").dtype == "fp32"  # bf16 runs on a CPU, slower than fp32
    assert recommend(rows, "cuda").dtype == "bf16" and recommend(rows).dtype == "bf16"


def test_on_a_cpu_the_ranks_and_the_offload_share_the_memory():
    stats = ModelStats(**{**tiny_stats().__dict__, "total": 10**6, "trainable": 10**6})
    est = estimate(stats, Layout(stage=2, dtype="fp32", world_size=2, ranks_per_node=2), seq_len=1)
    need = 2 * est.device_total + est.cpu_per_node
    ok, _ = fits(est, Target("cpu", need + 1, need + 1, ("fp32",), 0.0, ""))
    assert ok
    ok, why = fits(est, Target("cpu", need - 1, need - 1, ("fp32",), 0.0, ""))
    assert not ok and "this machine's memory" in why


def test_a_gpu_target_checks_the_cpu_memory_only_when_it_is_known():
    stats = ModelStats(**{**tiny_stats().__dict__, "total": G, "trainable": G, "largest_layer": G // 100})
    est = estimate(stats, Layout(stage=2, dtype="bf16", world_size=1, ranks_per_node=1), seq_len=1)
    roomy = est.device_total * 2
    assert fits(est, Target("cuda", roomy, None, ("bf16",), 0.0, "")) == (True, "")
    ok, why = fits(est, Target("cuda", roomy, est.cpu_per_node - 1, ("bf16",), 0.0, ""))
    assert not ok and "of CPU memory per node" in why
    ok, why = fits(est, Target("cuda", est.device_total - 1, None, ("bf16",), 0.0, ""))
    assert not ok and "per device" in why


def test_an_unknown_zero_stage_is_one_line():
    from launcher.core.errors import LauncherError

    with pytest.raises(LauncherError, match="zero stage 4 is unknown"):
        model_state_bytes(G, G, Layout(stage=4, dtype="fp32"))


# ----------------------------------------------------------------------------- the DeepSpeed dict
@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_table_matches_conf_deepspeed(preset):
    cfg = compose_plain([f"deepspeed={preset}"])
    assert (cfg["zero"]["stage"], cfg["offload"]["optimizer"], cfg["offload"]["param"]) == PRESETS[preset]


def test_layout_reads_the_composed_deepspeed_dict():
    cfg = compose_plain(["deepspeed=z3_offload", "precision=bf16", "train.micro_batch_size=4", "train.grad_accum=2"])
    ds = build_ds_config(cfg, world_size=8, hidden_size=64, device=Device("cuda", bf16=True, fp16=True))
    layout = layout_from_ds_config(ds, world_size=8, ranks_per_node=4)
    assert layout == Layout(
        stage=3,
        dtype="bf16",
        offload_optimizer="cpu",
        offload_param="cpu",
        world_size=8,
        ranks_per_node=4,
        micro_batch=4,
        grad_accum=2,
        reduce_bucket=64 * 64,
        allgather_bucket=Layout.allgather_bucket,  # stage 3 has none: DeepSpeed's default
        prefetch_bucket=round(0.9 * 64 * 64),
        persistence_threshold=640,
        sub_group_size=cfg["zero"]["sub_group_size"],
    )
    assert layout.preset == "z3_offload"
    assert layout.describe() == "deepspeed=z3_offload bf16 on 8 ranks"
    odd = Layout(stage=1, dtype="fp32", offload_param="cpu")  # no preset has it
    assert odd.preset is None and odd.describe() == "zero stage 1 with offload optimizer=none param=cpu fp32 on 1 rank"


# ----------------------------------------------------------------------------- estimates vs DeepSpeed engines
VALIDATION_MODEL = ["model.hidden_size=256", "model.num_layers=4", "model.vision_hidden_size=128"]
# (preset, precision, freeze the vision tower): fp32 with everything training, bf16 with the vision
# tower frozen as the real presets do, and the two offload presets.
VALIDATION_CONFIGS = [
    *[(p, "fp32", False) for p in ("z0", "z1", "z2", "z3")],
    *[(p, "bf16", True) for p in ("z0", "z1", "z2", "z3", "z2_offload", "z3_offload")],
]
VALIDATION_IDS = [f"{preset}-{dtype}" for preset, dtype, _ in VALIDATION_CONFIGS]
# On two ranks, the cases whose states a second rank partitions, each way once: ZeRO-1/2/3 in fp32, bf16's
# partitioned fp32 master copy (ZeRO-2, ZeRO-3) and an offloaded optimizer. ZeRO-0 holds on each rank what it
# holds on one (the world-size-1 test checks it), and the other bf16 and offload cases repeat these layouts.
VALIDATION_CONFIGS_TWO_RANKS = [
    case
    for case in VALIDATION_CONFIGS
    if f"{case[0]}-{case[1]}" in {"z1-fp32", "z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16", "z3_offload-bf16"}
]
TOLERANCE = 0.10


def _validation_overrides(preset: str, dtype: str, freeze: bool) -> list[str]:
    return [
        *VALIDATION_MODEL,
        f"deepspeed={preset}",
        f"precision={dtype}",
        f"model.freeze_vision={str(freeze).lower()}",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
    ]


def _validation_case(preset: str, dtype: str, freeze: bool, world_size: int) -> dict[str, Any]:
    overrides = _validation_overrides(preset, dtype, freeze)
    ds = build_ds_config(
        compose_plain(overrides), world_size=world_size, hidden_size=256, device=Device("cpu", bf16=True, fp16=False)
    )
    return {"name": f"{preset}-{dtype}", "ds": ds, "freeze_vision": freeze, "overrides": overrides}


@pytest.fixture(scope="module")
def validation_model() -> tuple[str, Any]:
    """The tiny model built the way training builds it (its directory), and the composed config."""
    cfg = compose_typed(VALIDATION_MODEL)
    return model_stats.model_dir(cfg), cfg


def _estimated_states(path: str, case: dict[str, Any], world_size: int) -> memory.ModelStates:
    stats = model_stats.model_stats(compose_typed(case["overrides"]), path=path)
    layout = layout_from_ds_config(case["ds"], world_size=world_size, ranks_per_node=world_size)
    return estimate(stats, layout, seq_len=1).states


def _compare(path: str, case: dict[str, Any], world_size: int, held: dict[str, int]) -> dict[str, Any]:
    states = _estimated_states(path, case, world_size)
    measured = held["params"] + held["grads"] + held["master"] + held["optimizer"]
    return {
        "case": case["name"],
        "world_size": world_size,
        "estimated": states.total,
        "measured": measured,
        "ratio": states.total / measured,
        "by_category": {key: (getattr(states, key), held[key]) for key in ("params", "grads", "master", "optimizer")},
        "other": held["other"],
    }


def _report(result: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {e / 2**20:.2f}/{m / 2**20:.2f}" for k, (e, m) in result["by_category"].items())
    return (
        f"{result['case']} ws{result['world_size']}: estimated {result['estimated'] / 2**20:.2f} MiB, engine holds "
        f"{result['measured'] / 2**20:.2f} MiB (ratio {result['ratio']:.3f}; estimate/held {parts}; "
        f"other {result['other'] / 2**20:.2f})"
    )


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*torch.distributed.*:FutureWarning")  # DeepSpeed's own calls
@pytest.mark.parametrize(("preset", "dtype", "freeze"), VALIDATION_CONFIGS, ids=VALIDATION_IDS)
def test_estimate_matches_engine_world_size_1(validation_model, process_group, preset, dtype, freeze):
    path, _ = validation_model
    case = _validation_case(preset, dtype, freeze, world_size=1)
    result = _compare(path, case, 1, probe(path, case))
    print(_report(result))
    assert abs(result["ratio"] - 1) <= TOLERANCE, _report(result)
    assert result["other"] <= 0.05 * result["measured"], _report(result)


@pytest.mark.slow
def test_estimate_matches_engine_world_size_2(validation_model, tmp_path, isolated_env):
    path, _ = validation_model
    cases = [_validation_case(p, d, f, world_size=2) for p, d, f in VALIDATION_CONFIGS_TWO_RANKS]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "-m",
        "tests.unit.plan.test_memory",
        "probe",
        path,
        str(tmp_path / "cases.json"),
    ]
    env = {**isolated_env, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for out in sorted(tmp_path.glob("probe_rank*.txt")) for line in out.read_text().splitlines()]
    held = [json.loads(line[len("PROBE ") :]) for line in lines if line.startswith("PROBE ")]
    assert len(held) == 2 * len(cases)
    failures = []
    for line in held:
        case = next(c for c in cases if c["name"] == line["name"])
        compared = _compare(path, case, 2, line["held"])
        print(f"rank {line['rank']}: {_report(compared)}")
        if abs(compared["ratio"] - 1) > TOLERANCE or compared["other"] > 0.05 * compared["measured"]:
            failures.append(_report(compared))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_estimate_matches_what_autograd_saves(validation_model, dtype):
    """The formula against the bytes autograd keeps for backward in one forward pass (no DeepSpeed)."""
    import torch
    from transformers import AutoModelForImageTextToText

    path, cfg = validation_model
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch_dtype)
    batch = _batch(model, torch_dtype, batch_size=2, seq_len=64)
    measured = saved_for_backward(model, batch)
    stats = model_stats.model_stats(cfg, path=path)
    estimated = activation_bytes(stats, Layout(stage=0, dtype=dtype, micro_batch=2), seq_len=64, images=1)
    # The formula also counts the logits' gradients in backward (s V (e + 4) bytes): not saved tensors.
    estimated_saved = estimated - 2 * 64 * stats.vocab_size * (BYTES[dtype] + 4)
    print(f"activations {dtype}: estimated {estimated_saved} saved {measured} ratio {estimated_saved / measured:.3f}")
    assert abs(estimated_saved / measured - 1) <= 0.15


# ----------------------------------------------------------------------------- the probe (also a torchrun script)
def _batch(model, dtype, *, batch_size: int, seq_len: int) -> dict[str, Any]:
    import torch

    config = model.config
    image_size = config.vision_config.image_size
    image_tokens = (image_size // config.vision_config.patch_size) ** 2
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, config.text_config.vocab_size, (batch_size, seq_len), generator=generator)
    ids[:, 1 : 1 + image_tokens] = config.image_token_index
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": ids.clone(),
        "pixel_values": torch.randn(batch_size, 3, image_size, image_size, generator=generator).to(dtype),
    }


def _tensors(obj: Any, depth: int = 0):
    """Every tensor inside nested lists, tuples and dicts (dict values only)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, list | tuple):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def held_bytes(engine) -> dict[str, int]:
    """Bytes of model states the engine holds, by category (see the module docstring)."""
    import torch

    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for tensor in tensors:
            if tensor is None or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    basic = engine.basic_optimizer
    wrapper = engine.optimizer if engine.optimizer is not basic else None

    def attributes(*names: str) -> list:
        return [t for name in names for t in _tensors(getattr(wrapper, name, None))]

    parameters = list(engine.module.parameters())
    # ZeRO 1-2, ZeRO-3, FP16_Optimizer (fused Adam at stage 0), FP16_UnfusedOptimizer (torch's AdamW at stage 0).
    masters = attributes(
        "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat", "fp32_groups"
    )
    held = {
        "params": size(
            [getattr(p, "ds_tensor", None) for p in parameters]
            + [p.data for p in parameters]
            + attributes("param_buffer_of_bit16_for_cpu_offload_groups")
        ),
        "master": size(masters),
        "optimizer": size(t for state in basic.state.values() for t in _tensors(state)),
        "grads": size(
            [p.grad for p in parameters]
            + [m.grad for m in masters]
            + attributes(
                "averaged_gradients",
                "all_grad_tensors",
                "accumulated_grads_in_cpu",
                "grad_partitions_flat_buffer",
                "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
            )
        ),
    }
    # Everything else the wrapper references, one level into DeepSpeed's own helper objects.
    others = []
    for value in vars(wrapper).values() if wrapper is not None else ():
        others.extend(_tensors(value))
        if type(value).__module__.startswith("deepspeed") and hasattr(value, "__dict__"):
            for inner in vars(value).values():
                if not isinstance(inner, torch.nn.Module):
                    others.extend(_tensors(inner))
    held["other"] = size(others)
    return held


def probe(model_dir: str, case: dict[str, Any]) -> dict[str, int]:
    """Build the engine for one case, train one step and a half, and return what it holds."""
    import deepspeed
    import torch
    from transformers import AutoModelForImageTextToText

    from launcher.model.components import apply_freeze

    ds = case["ds"]
    hf_ds_config = None
    if ds["zero_optimization"]["stage"] == 3:  # as the training path does: partition while loading
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    del hf_ds_config
    apply_freeze(model, vision=case["freeze_vision"], projector=False, language=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds)
    dtype = torch.bfloat16 if ds["bf16"]["enabled"] else torch.float32
    batch = _batch(engine.module, dtype, batch_size=ds["train_micro_batch_size_per_gpu"], seq_len=40)
    for micro_step in range(ds["gradient_accumulation_steps"] + 1):
        engine.backward(engine(**batch).loss)
        if micro_step < ds["gradient_accumulation_steps"]:
            engine.step()  # the last step is the accumulation boundary: the optimizer steps once
    held = held_bytes(engine)
    engine.destroy()
    del engine, model, trainable
    gc.collect()
    return held


def _probe_main(argv: list[str]) -> int:
    """torchrun entry: `-m tests.unit.plan.test_memory probe MODEL_DIR CASES.json`; one PROBE line per case,
    each rank's into probe_rank<R>.txt beside CASES.json (two ranks printing to one pipe interleave their lines)."""
    import logging

    import deepspeed
    import torch
    from deepspeed.utils import logger

    from launcher.train.ops import prepare_ops

    logger.setLevel(logging.WARNING)
    _, model_dir, cases_file = argv
    prepare_ops()  # as a rank does: no 50 s build of the shared-memory comm op training never uses
    deepspeed.init_distributed(dist_backend="gloo")
    out = Path(cases_file).parent / f"probe_rank{torch.distributed.get_rank()}.txt"
    try:
        for case in json.loads(Path(cases_file).read_text()):
            started = time.time()
            held = probe(model_dir, case)
            record = {"rank": torch.distributed.get_rank(), "name": case["name"], "held": held}
            with open(out, "a") as handle:
                handle.write("PROBE " + json.dumps({**record, "seconds": round(time.time() - started, 2)}) + "\n")
    finally:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "probe":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(_probe_main(sys.argv[1:]))
