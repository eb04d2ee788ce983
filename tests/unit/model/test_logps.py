"""launcher.model.logps with launcher.train.losses: the answers' log-probabilities through the output layer
in chunks give transformers' own loss and its gradients, to 1e-5 relative (fp32, CPU), on both tiny
families, padded and packed; the whole logits are never kept for the backward pass; a micro-batch without
an answer backpropagates zeros."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from launcher.data.cache import RecordEncoder
from launcher.data.length import IGNORE_INDEX, pad_rows
from launcher.data.packing import PackedCollator
from launcher.model.loading import load_model_and_processor
from launcher.model.logps import answer_logps
from launcher.model.packing import packed_inputs, use_packed_attention
from launcher.train.losses import AnswerCrossEntropy, TokenSums, answer_tokens, row_logps
from tests.unit.model.test_flops import sample

RED, BLUE = (Image.new("RGB", size, colour) for size, colour in [((32, 32), "red"), ((48, 32), "blue")])
RECORDS = [sample([RED], "red circle"), sample([RED, BLUE], "blue square green triangle"), sample([], "hi")]
ARCHES = ["tiny_llava", "tiny_qwen2_vl"]


def loaded(model_dirs, arch: str):
    model, processor = load_model_and_processor(str(model_dirs[arch]), attn_implementation="sdpa")
    model.train()
    tensors = [RecordEncoder(processor, None, "pixels")(record)[0] for record in RECORDS]
    return model, processor, tensors


def loss_and_grads(model, batch: dict, chunk: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = AnswerCrossEntropy(chunk=chunk).forward(model, dict(batch), "train", lambda inputs: inputs, TokenSums())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


def assert_same(plain: tuple[float, dict], chunked: tuple[float, dict]) -> None:
    assert chunked[0] == pytest.approx(plain[0], rel=1e-5)
    assert chunked[1].keys() == plain[1].keys() and plain[1]
    for name, grad in plain[1].items():
        # 1e-5 of the largest element, or fp32 noise for a gradient that is zero in exact arithmetic (the
        # key projections' biases: softmax does not see them).
        assert float((chunked[1][name] - grad).abs().max()) <= 1e-5 * float(grad.abs().max()) + 1e-9, name


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_loss_and_gradients_equal_transformers_own(model_dirs, arch, chunk):
    model, processor, tensors = loaded(model_dirs, arch)
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    assert answer_tokens(batch) > 3  # several chunks at chunk 1 and 3
    assert_same(loss_and_grads(model, batch, 0), loss_and_grads(model, batch, chunk))


@pytest.mark.parametrize("arch", ARCHES)
def test_chunked_loss_of_packed_rows_equals_transformers_own(model_dirs, arch):
    model, processor, tensors = loaded(model_dirs, arch)
    use_packed_attention(model)
    batch = packed_inputs(model, PackedCollator(processor)([[{"tensors": t} for t in tensors]]))
    assert_same(loss_and_grads(model, batch, 0), loss_and_grads(model, batch, 2))


@pytest.mark.parametrize("arch", ARCHES)
def test_each_rows_log_probability_equals_the_one_from_the_whole_logits(model_dirs, arch):
    """What DPO compares: one sum per row, whatever the chunk size."""
    model, processor, tensors = loaded(model_dirs, arch)
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        whole = answer_logps(model(**inputs).logits, batch["labels"])
        for chunk in (1, 5, 1024):
            assert row_logps(model, inputs, batch["labels"], chunk).tolist() == pytest.approx(whole.tolist(), rel=1e-5)
        assert torch.equal(row_logps(model, inputs, batch["labels"], 0), whole)  # 0: the whole logits


def largest_saved_with_last_dim(model, batch: dict, chunk: int, size: int) -> int:
    """Elements of the largest tensor autograd keeps for the backward pass whose last dimension is `size`."""
    largest = 0

    def pack(tensor):
        nonlocal largest
        if tensor.dim() and tensor.shape[-1] == size:
            largest = max(largest, tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        AnswerCrossEntropy(chunk=chunk).forward(model, dict(batch), "train", lambda inputs: inputs, TokenSums())
    return largest


@pytest.mark.parametrize("arch", ARCHES)
def test_no_logits_are_kept_for_the_backward_pass(model_dirs, arch):
    """transformers' loss keeps every position's logits (rows x length x vocabulary) for its backward pass;
    the chunked one keeps none: each chunk's logits are recomputed in the backward pass."""
    model, processor, tensors = loaded(model_dirs, arch)
    batch = pad_rows(tensors, processor.tokenizer.pad_token_id)
    vocabulary = model.get_output_embeddings().weight.shape[0]
    assert vocabulary != model.get_output_embeddings().weight.shape[1]  # the check below tells them apart
    rows, length = batch["input_ids"].shape
    assert largest_saved_with_last_dim(model, batch, 0, vocabulary) >= rows * (length - 1) * vocabulary
    assert largest_saved_with_last_dim(model, batch, 4, vocabulary) == 0


@pytest.mark.parametrize("arch", ARCHES)
def test_a_micro_batch_without_answers_backpropagates_zeros(model_dirs, arch):
    model, processor, tensors = loaded(model_dirs, arch)
    batch = pad_rows(tensors[:1], processor.tokenizer.pad_token_id)
    batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    loss, grads = loss_and_grads(model, batch, 4)
    assert loss == 0.0
    assert grads and all(float(grad.abs().max()) == 0.0 for grad in grads.values())
