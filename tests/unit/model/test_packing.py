"""launcher.model.packing with launcher.data.packing: records packed into rows give each record the loss it
has alone, to 1e-5 relative (fp32, CPU), on both tiny families, eager, sdpa and packed_sdpa attention, with
one, two (of two sizes) and three images and a text-only record, packed into one row and into two padded
rows; no record sees another."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from launcher.data.cache import RecordEncoder
from launcher.data.length import IGNORE_INDEX, pad_rows
from launcher.data.packing import RECORD_LENGTHS, PackedCollator
from launcher.model.loading import load_model_and_processor
from launcher.model.packing import PACKED_ATTENTION, packed_inputs, use_packed_attention
from tests.unit.model.test_flops import sample

RED, BLUE, GREEN = (
    Image.new("RGB", size, colour) for size, colour in [((32, 32), "red"), ((48, 32), "blue"), ((32, 40), "green")]
)
RECORDS = [
    sample([RED], "red circle"),
    sample([RED, BLUE], "blue square"),
    sample([], "hi"),
    sample([GREEN, RED, BLUE], "green triangle"),
    sample([BLUE], "blue square red circle"),
]


def record_losses(logits: torch.Tensor, labels: torch.Tensor, lengths: list[int]) -> list[float]:
    """Each record's mean loss over its own targets, from a packed row's logits (the model's shift)."""
    losses, start = [], 0
    for length in lengths:
        span_logits, span_labels = logits[start : start + length - 1], labels[start + 1 : start + length]
        kept = span_labels != IGNORE_INDEX
        losses.append(float(torch.nn.functional.cross_entropy(span_logits[kept], span_labels[kept])))
        start += length
    return losses


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", PACKED_ATTENTION])
def test_packed_records_have_the_losses_they_have_alone(model_dirs, arch, attention):
    """Eager and sdpa keep records apart with the block-diagonal mask transformers builds from the
    restarting positions; packed_sdpa (use_packed_attention) runs sdpa record by record."""
    implementation = "sdpa" if attention == PACKED_ATTENTION else attention
    model, processor = load_model_and_processor(str(model_dirs[arch]), attn_implementation=implementation)
    if attention == PACKED_ATTENTION:
        assert use_packed_attention(model) == PACKED_ATTENTION
    model.eval()
    encode = RecordEncoder(processor, None, "pixels")
    tensors = [encode(record)[0] for record in RECORDS]
    pad = processor.tokenizer.pad_token_id
    with torch.no_grad():
        alone = [float(model(**pad_rows([t], pad)).loss) for t in tensors]
        for rows in ([[0, 1, 2, 3, 4]], [[3, 0], [2, 4, 1]]):  # one row; two rows, the second padded
            batch = PackedCollator(processor)([[{"tensors": tensors[i]} for i in row] for row in rows])
            inputs = packed_inputs(model, batch)
            assert RECORD_LENGTHS not in inputs
            # No 2-D mask: transformers builds the block-diagonal one from the positions; for packed_sdpa,
            # which needs none, an all-true 4-D view stops it building any.
            assert inputs.get("attention_mask", torch.ones(1, 1, 1, 1)).dim() == 4
            logits = model(**inputs).logits
            for number, row in enumerate(rows):
                packed = record_losses(logits[number], inputs["labels"][number], batch[RECORD_LENGTHS][number])
                for index, loss in zip(row, packed, strict=True):
                    assert loss == pytest.approx(alone[index], rel=1e-5), (arch, rows, index)


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_without_restarting_positions_a_record_would_see_the_one_before(model_dirs, arch):
    """The check above can fail: the same row with plain positions (one sequence) changes the second
    record's loss."""
    model, processor = load_model_and_processor(str(model_dirs[arch]))
    model.eval()
    encode = RecordEncoder(processor, None, "pixels")
    tensors = [encode(record)[0] for record in RECORDS[:2]]
    batch = PackedCollator(processor)([[{"tensors": t} for t in tensors]])
    inputs = packed_inputs(model, batch)
    with torch.no_grad():
        separate = record_losses(model(**inputs).logits[0], inputs["labels"][0], batch[RECORD_LENGTHS][0])
        del inputs["position_ids"]  # one sequence: the second record attends to the first
        joined = record_losses(model(**inputs).logits[0], inputs["labels"][0], batch[RECORD_LENGTHS][0])
    assert separate[0] == pytest.approx(joined[0], rel=1e-5)  # the first record sees nothing before it either way
    assert abs(separate[1] - joined[1]) > 1e-4 * abs(separate[1])


@pytest.mark.parametrize(("arch", "videos"), [("tiny_llava", False), ("tiny_qwen2_vl", False), ("tiny_qwen2_vl", True)])
def test_the_zero3_guards_blank_image_in_a_text_only_packed_batch_changes_no_loss(model_dirs, arch, videos):
    """Under the modality guard a packed batch without images gets a blank image's record (and, for a model
    that takes videos as videos, a blank video's), with no target: the vision tower runs, and the text
    records' losses (and the batch loss) are what they were."""
    model, processor = load_model_and_processor(str(model_dirs[arch]))
    model.eval()
    encode = RecordEncoder(processor, None, "pixels")
    text_only = [encode(sample([], answer))[0] for answer in ("hi", "red circle")]
    rows = [[{"tensors": t} for t in text_only]]
    plain = PackedCollator(processor)(rows)
    guarded = PackedCollator(processor, image_every_batch=True, video_every_batch=videos)(rows)
    assert "pixel_values" not in plain and "pixel_values" in guarded
    assert ("video_grid_thw" in guarded) == videos
    assert guarded[RECORD_LENGTHS][0][:2] == plain[RECORD_LENGTHS][0] and len(guarded[RECORD_LENGTHS][0]) == 3 + videos
    with torch.no_grad():
        before, after = model(**packed_inputs(model, plain)), model(**packed_inputs(model, guarded))
    assert float(after.loss) == pytest.approx(float(before.loss), rel=1e-6)
    width = plain["input_ids"].shape[1]
    assert torch.allclose(after.logits[0, :width], before.logits[0], atol=1e-5)


def test_packed_sdpa_leaves_an_unpacked_padded_batch_as_sdpa_computes_it(model_dirs):
    """The held-out loss reads padded batches through the same model: with no spans packed_sdpa is sdpa,
    and transformers still builds sdpa's padding mask for it."""
    model, processor = load_model_and_processor(str(model_dirs["tiny_qwen2_vl"]))
    model.eval()
    encode = RecordEncoder(processor, None, "pixels")
    batch = pad_rows([encode(RECORDS[2])[0], encode(RECORDS[3])[0]], processor.tokenizer.pad_token_id)
    assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()  # padded
    with torch.no_grad():
        before = model(**batch).logits
        use_packed_attention(model)
        after = model(**batch).logits
    assert torch.allclose(before, after, atol=1e-6)


VARLEN_CALLS = []


def reference_varlen(
    query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
):
    """What torch's varlen flash kernel computes (it runs on CUDA only), written plainly: each sequence of
    cu_q's bounds causal on its own, [tokens, heads, dim] in and out."""
    assert window_size == (-1, 0) and cu_q is cu_k and max_q == max_k == int((cu_q[1:] - cu_q[:-1]).max())
    VARLEN_CALLS.append(cu_q.tolist())
    pieces = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        pieces.append(out.transpose(0, 1))
    return torch.cat(pieces)


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_the_varlen_path_lays_records_out_as_the_kernel_reads_them(model_dirs, arch, monkeypatch):
    """packed_varlen's flattening, sequence bounds (each record and each row's padding) and reshaping, with a
    plain stand-in for the CUDA-only kernel: the same logits as the per-record sdpa path. The kernel itself
    runs in the GPU suite (tests/gpu/test_cuda.py)."""
    from launcher.model import packing

    model, processor = load_model_and_processor(str(model_dirs[arch]), attn_implementation="sdpa")
    model.eval()
    encode = RecordEncoder(processor, None, "pixels")
    tensors = [encode(record)[0] for record in RECORDS]
    batch = PackedCollator(processor)([[{"tensors": tensors[i]} for i in row] for row in ([3, 0], [2, 4, 1])])
    assert use_packed_attention(model) == PACKED_ATTENTION  # a CPU: the per-record path
    inputs = packed_inputs(model, batch)
    with torch.no_grad():
        per_record = model(**inputs).logits
        monkeypatch.setattr(packing, "_varlen_kernel", lambda: reference_varlen)
        monkeypatch.setattr(packing, "_varlen_runs", lambda query, kwargs: True)
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(packing.PACKED_VARLEN, packing.packed_varlen_attention)
        AttentionMaskInterface.register(packing.PACKED_VARLEN, sdpa_mask)
        model.set_attn_implementation({"text_config": packing.PACKED_VARLEN})
        VARLEN_CALLS.clear()
        varlen_inputs = packed_inputs(model, batch)
        varlen = model(**varlen_inputs).logits
    torch.testing.assert_close(varlen, per_record, rtol=1e-5, atol=1e-5)
    width = batch["input_ids"].shape[1]
    bounds = [0]
    for row in batch[RECORD_LENGTHS]:  # each record, then the row's padding, as sequences of their own
        for n in [*row, width - sum(row)]:
            if n:
                bounds.append(bounds[-1] + n)
    assert VARLEN_CALLS and all(call == bounds for call in VARLEN_CALLS)  # one call per layer
    # The bounds are made once a batch, beside it, and moved to the device with it, not in every layer.
    assert varlen_inputs[packing.PACKED_BOUNDS].tolist() == bounds
