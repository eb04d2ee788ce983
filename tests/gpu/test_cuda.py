"""The paths only a CUDA device runs: bf16 and fp16 at ZeRO 0-3, fp16's loss scale, the memory metrics, the
pinned loader, the optimizer offload, QLoRA (bitsandbytes), the attention kernel `auto` picks, and the
tuner's memory cap.

Each job trains in this process (`train_in_process`: one rank, NCCL for the GPU's tensors and gloo for the
CPU's), so a test costs its steps, not an interpreter's start-up (45-85 s a test as `python train.py` on
the H200); only the memory cap runs `train.py`, its exit code and CUDA's own error line being the point.

Skipped without CUDA, unless LAUNCHER_GPU_SUITE_ON_CPU=1: then `bench/device_check.py --cpu` rehearses
here what a CPU can run of it (bf16 at ZeRO 0-3, the offload, QLoRA), so that the lent GPU's minutes meet
no surprise of the plumbing. On a GPU machine:

    python -m pytest -m gpu -q -n 4 -p tests.verdicts --verdicts verdicts.txt --test-timeout 120
"""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch

from launcher.core.rundir import RunDir
from launcher.train.distributed import CUDA_MEMORY_CAP_ENV
from tests.helpers import losses, read_metrics, read_summary

CUDA = torch.cuda.is_available()
ON_CPU_ENV = "LAUNCHER_GPU_SUITE_ON_CPU"  # the device check's CPU mode rehearses the suite here
REHEARSAL = not CUDA and os.environ.get(ON_CPU_ENV) == "1"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not CUDA and not REHEARSAL, reason=f"needs a CUDA device (or {ON_CPU_ENV}=1 to rehearse)"),
]
cuda_only = pytest.mark.skipif(not CUDA, reason="asserts what only CUDA has")

# Long enough for the loss to fall on every preset.
SHORT = (
    "logger=none",
    "train.micro_batch_size=8",
    "train.max_steps=20",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
)


def trained(ran) -> dict:
    """The summary of a job that completed, its loss fallen."""
    assert ran.outcome.status == "completed", ran.outcome.error
    curve = losses(ran.run_dir)
    assert curve[-1] < curve[0], curve
    return read_summary(ran.run_dir)


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=cuda_only)])
@pytest.mark.parametrize("preset", ["z0", "z1", "z2", "z3"])
def test_every_zero_stage_trains_with_its_memory_metrics(train_in_process, preset, precision):
    ran = train_in_process(f"deepspeed={preset}", f"precision={precision}", *SHORT)
    done = trained(ran)
    assert done["precision"] == precision and done["zero_stage"] == int(preset[1])
    assert done["memory"]["host_peak_bytes"] > 0
    if not CUDA:
        return
    metrics = read_metrics(ran.run_dir)
    last = metrics[-1]
    # The allocator's peak reserve holds its peak of live tensors; the device-wide use adds the context.
    assert last["mem/peak_bytes"] >= last["mem/peak_allocated_bytes"] > 0
    assert last["mem/device_used_bytes"] >= last["mem/peak_allocated_bytes"]
    assert done["peak_memory_bytes"] >= last["mem/peak_bytes"]  # the summary's is read after the last save
    assert done["memory"].get("pinned_host_bytes", 0) > 0  # the DataLoader pins its batches
    if precision == "fp16":  # every DeepSpeed fp16 optimizer reports its dynamic loss scale
        scales = [m["train/loss_scale"] for m in metrics]
        assert all(math.isfinite(scale) and scale > 0 for scale in scales), scales


def test_an_offloaded_optimizer_uses_deepspeeds_cpu_adam(train_in_process):
    done = trained(train_in_process("deepspeed=z2_offload", "precision=bf16", *SHORT))
    assert done["optimizer"] == "DeepSpeedCPUAdam"
    if CUDA:
        assert done["memory"]["pinned_host_bytes"] > 0  # DeepSpeed's offload buffers are page-locked


@cuda_only
def test_auto_attention_picks_flash_attention_2_where_installed_else_sdpa(train_in_process):
    """With flash-attn (it must be built against the machine's torch and CUDA; PyPI has its source only)
    `auto` trains with flash_attention_2; without it, with SDPA, which torch runs on its own flash kernel."""
    done = trained(train_in_process("precision=bf16", "model.attn_implementation=auto", *SHORT))
    installed = importlib.util.find_spec("flash_attn") is not None
    assert done["attn_implementation"] == ("flash_attention_2" if installed else "sdpa")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
@pytest.mark.parametrize("preset", ["z2", "z3"])
def test_qlora_trains_and_exports(train_in_process, tmp_path, preset):
    """It failed here at step 1 in DeepSpeed's gradient hooks, on the 4-bit projector that got no gradient
    (tests/unit/model/test_method.py)."""
    from launcher.export.export import export

    ran = train_in_process("method=qlora", "precision=bf16", f"deepspeed={preset}", *SHORT)
    assert trained(ran)["method"] == "qlora"
    config = json.loads((RunDir(ran.run_dir).model / "adapter_config.json").read_text())
    assert config["modules_to_save"]
    assert export(ran.run_dir, merge=True, out=tmp_path / "merged").kind == "merged model"


@cuda_only
def test_the_cuda_memory_cap_makes_an_over_budget_run_a_real_out_of_memory(run_train, tmp_path):
    """launcher.tune caps each candidate's allocator at its budget (LAUNCHER_CUDA_MEMORY_GB): a job that
    needs more fails with CUDA's own out-of-memory error, which the tuner records as "does not fit"."""
    args = ["model.hidden_size=1024", "model.num_layers=4", *SHORT, f"hydra.run.dir={tmp_path / 'capped'}"]
    result = run_train(*args, env={CUDA_MEMORY_CAP_ENV: "0.05"})  # 50 MiB: below this model's states
    assert result.returncode == 1 and "out of memory" in result.stderr.lower(), result.stderr[-3000:]


# ----------------------------------------------------------------------------- the kernels of issue 41
def _tiny_on_cuda(arch: str, where, **sizes):
    from launcher.model.loading import load_model_and_processor
    from tests.unit.model.tiny_sizes import build

    model, processor = load_model_and_processor(str(build(arch, where, **sizes)), attn_implementation="sdpa")
    return model.to("cuda", torch.bfloat16).train(), processor


def _loss_and_grads(model, batch, chunk: int):
    from launcher.train.losses import AnswerCrossEntropy, TokenSums
    from launcher.train.step import to_device

    model.zero_grad()
    device = next(model.parameters()).device
    to_model = lambda inputs: to_device(inputs, device, torch.bfloat16)  # noqa: E731
    loss = AnswerCrossEntropy(chunk=chunk).forward(model, dict(batch), "train", to_model, TokenSums())
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def test_a_live_dpo_reference_of_a_random_build_starts_as_the_policy(train_in_process, tmp_path):
    """model.source=random draws the weights on the device they train on, the live reference's too: the CPU's
    generator and a GPU's give different weights for one seed, and DPO trained against another model (its
    first loss was not log 2)."""
    from tests.unit.model.test_random_build import small_qwen2_vl_dir

    source = small_qwen2_vl_dir(tmp_path / "small")
    ran = train_in_process(
        "model=tiny_qwen2_vl", "model.source=random", f"model.path={source}", "model.arch=null", "loss=dpo",
        "data.task=colour", "loss.reference=live", "deepspeed=z0", "precision=bf16", "train.max_steps=1",
        "train.eval_every=0", "data.eval_accuracy=false", "data.n_train=32", "data.n_eval=8", "data.image_size=56",
        "train.micro_batch_size=2", "train.global_batch_size=2", "logger=none",
    )  # fmt: skip
    assert ran.outcome.status == "completed", ran.outcome.error
    assert losses(ran.run_dir)[0] == pytest.approx(math.log(2), abs=1e-3)


@cuda_only
@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_varlen_packed_attention_gives_the_per_record_sdpas_loss_and_gradients(tmp_path, arch):
    """packed_varlen (one torch varlen flash call per layer) against packed_sdpa (one sdpa call per record):
    equal to bf16's precision."""
    from launcher.data.cache import RecordEncoder
    from launcher.data.packing import PackedCollator
    from launcher.model import packing
    from tests.unit.model.test_logps import RECORDS

    if packing._varlen_kernel() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    model, processor = _tiny_on_cuda(arch, tmp_path / arch)
    assert packing.use_packed_attention(model) == packing.PACKED_VARLEN
    tensors = [RecordEncoder(processor, None, "pixels")(record)[0] for record in RECORDS]
    batch = packing.packed_inputs(model, PackedCollator(processor)([[{"tensors": t} for t in tensors]]))
    varlen = _loss_and_grads(model, batch, 1024)
    model.set_attn_implementation({"text_config": packing.PACKED_ATTENTION})
    per_record = _loss_and_grads(model, batch, 1024)
    assert varlen[0] == pytest.approx(per_record[0], rel=2e-2)
    cosine = torch.nn.functional.cosine_similarity(varlen[1], per_record[1], dim=0)
    assert float(cosine) > 0.99


@cuda_only
@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_compiled_layers_give_the_eager_loss_and_gradients_on_cuda(tmp_path, arch):
    """model.compile (each layer's MLP and norms through torch.compile, inductor's CUDA kernels) against the
    same weights eager, in bf16: equal to bf16's precision."""
    from launcher.data.cache import RecordEncoder
    from launcher.data.length import pad_rows
    from launcher.model.components import compile_layers
    from tests.unit.model.test_logps import RECORDS

    model, processor = _tiny_on_cuda(arch, tmp_path / arch)
    tensors = [RecordEncoder(processor, None, "pixels")(record)[0] for record in RECORDS]
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    eager = _loss_and_grads(model, batch, 1024)
    model.zero_grad(set_to_none=True)
    assert compile_layers(model)
    compiled = _loss_and_grads(model, batch, 1024)
    assert compiled[0] == pytest.approx(eager[0], rel=2e-2)
    assert float(torch.nn.functional.cosine_similarity(compiled[1], eager[1], dim=0)) > 0.99


@cuda_only
@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_liger_kernels_give_the_torch_loss_and_gradients_on_cuda(tmp_path, arch, monkeypatch):
    """model.kernels=liger (its RMSNorm, SwiGLU, rotary and LayerNorm kernels and its fused linear
    cross-entropy: launcher/model/kernels.py) against the same weights in torch, in bf16: equal to bf16's
    precision. The CPU tests run the fused loss only (Triton's interpreter cannot run the layer kernels)."""
    import sys

    from launcher.data.cache import RecordEncoder
    from launcher.data.length import pad_rows
    from launcher.model.kernels import apply_liger_layers, use_fused_loss
    from tests.unit.model.test_logps import RECORDS

    pytest.importorskip("liger_kernel")
    model, processor = _tiny_on_cuda(arch, tmp_path / arch)
    family = sys.modules[type(model.model.language_model).__module__]
    monkeypatch.setattr(family, "apply_rotary_pos_emb", family.apply_rotary_pos_emb)  # restored after the test
    tensors = [RecordEncoder(processor, None, "pixels")(record)[0] for record in RECORDS]
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    plain = _loss_and_grads(model, batch, 1024)
    model.zero_grad(set_to_none=True)
    counts = apply_liger_layers(model, "cuda")
    assert counts["rms_norm"] and counts["swiglu"] and counts["layer_norm"] and counts["rope"]
    use_fused_loss(model)
    liger = _loss_and_grads(model, batch, 1024)
    assert liger[0] == pytest.approx(plain[0], rel=2e-2)
    assert float(torch.nn.functional.cosine_similarity(liger[1], plain[1], dim=0)) > 0.99


@cuda_only
def test_the_chunked_loss_needs_a_fraction_of_the_whole_logits_memory_at_a_real_vocabulary(tmp_path):
    """A Qwen2-VL of 64 wide with a tokenizer of a few hundred words, its output layer widened to Qwen2-VL's
    151,936 words, on 4 rows of ~200 tokens: the chunked loss's peak over forward + backward is below the
    whole logits' and its loss equal to bf16's precision."""
    from launcher.data.cache import RecordEncoder
    from launcher.data.length import pad_rows
    from tests.unit.model.test_logps import RECORDS

    model, processor = _tiny_on_cuda("tiny_qwen2_vl", tmp_path / "wide")
    model.resize_token_embeddings(151_936, mean_resizing=False)
    model.to("cuda", torch.bfloat16)
    tensors = [RecordEncoder(processor, None, "pixels")(record)[0] for record in RECORDS] * 2
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    peaks, results = {}, {}
    for chunk in (0, 256):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        results[chunk] = _loss_and_grads(model, batch, chunk)
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated()
    assert results[256][0] == pytest.approx(results[0][0], rel=2e-2)
    assert peaks[256] < peaks[0], peaks
