"""A packed batch (launcher.data.packing) made into what the model takes: position ids that restart at
every record, and no 2-D attention mask; and the attention that runs record by record on sdpa.

From position ids that restart, transformers' masking builds a block-diagonal causal mask (its
packed-sequence path, on sdpa and eager alike), so no record attends to another. On sdpa the language
model instead attends record by record (`use_packed_attention`: on a CUDA device every record of the batch
in one call of torch's varlen flash kernel, elsewhere each record's span through sdpa's fused causal
kernel), and no mask is built at all. The vision tower needs nothing here: transformers' Qwen2-VL tower
attends per image through its cu_seqlens (a varlen call under flash-attention, one sdpa call per image
otherwise), LLaVA's CLIP tower takes images as a batch of their own. Qwen2-VL takes 4 x B x S
position ids: the text positions (from which the mask is built) over its 3-D rotary index (temporal,
height, width), which is computed here record by record, each from its own tokens and image and video grids, as
the model computes it for a record alone: computed over the whole row, the rotary index of a record
would continue from the records before it (the failure LLaMA-Factory's packing met, LF#10782).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from launcher.data.packing import REAL_TOKENS, RECORD_IMAGES, RECORD_LENGTHS, RECORD_VIDEOS
from launcher.data.video import SECONDS_PER_PATCH
from launcher.model.components import base_model


def packed_inputs(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """The model's inputs of a packed batch: position ids added, the packing's bookkeeping removed."""
    inputs = {k: v for k, v in batch.items() if k not in (RECORD_LENGTHS, RECORD_IMAGES, RECORD_VIDEOS, REAL_TOKENS)}
    inputs["use_cache"] = False  # with a key-value cache transformers looks for no packed sequences
    lengths, images, videos = batch[RECORD_LENGTHS], batch[RECORD_IMAGES], batch[RECORD_VIDEOS]
    rows, width = inputs["input_ids"].shape
    inputs[PACKED_SPANS] = lengths  # read by packed_sdpa_attention (use_packed_attention); others ignore it
    attention = _text_attention(model)
    if attention == PACKED_VARLEN:
        # Once a batch, moved with it: built in each layer, its copy to the GPU waited for all queued work.
        inputs[PACKED_BOUNDS] = varlen_bounds(lengths, width)
    if attention in (PACKED_ATTENTION, PACKED_VARLEN):
        # It needs no mask: a 4-D one is passed as is, so transformers builds none (a row x length^2 build
        # per forward, ~5% of a tiny model's packed step here). An all-true view that allocates nothing.
        inputs["attention_mask"] = torch.ones((1, 1, 1, 1), dtype=torch.bool).expand(rows, 1, width, width)
    text = torch.zeros((rows, width), dtype=torch.long)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for length in [*row_lengths, width - sum(row_lengths)]:  # the padding: a sequence of its own
            text[row, start : start + length] = torch.arange(length)
            start += length
    rotary_index = _rotary_index_function(model)
    if rotary_index is None:
        inputs["position_ids"] = text.to(inputs["input_ids"].device)
        return inputs
    rotary = text[None].repeat(3, 1, 1)  # text-only records and the padding: the text positions on all three axes
    grids, video_grids = inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
    used = used_videos = 0  # image and video grid rows of the records before
    for row, (row_lengths, row_images, row_videos) in enumerate(zip(lengths, images, videos, strict=True)):
        start = 0
        for length, count, video_count in zip(row_lengths, row_images, row_videos, strict=True):
            if count or video_count:
                span = slice(start, start + length)
                positions, _ = rotary_index(
                    inputs["input_ids"][row : row + 1, span],
                    mm_token_type_ids=inputs["mm_token_type_ids"][row : row + 1, span],
                    image_grid_thw=grids[used : used + count] if count else None,
                    video_grid_thw=video_grids[used_videos : used_videos + video_count] if video_count else None,
                    **_video_times(inputs, used_videos, video_count),
                )
                rotary[:, row, span] = positions[:, 0].to(rotary.dtype).cpu()
                used, used_videos = used + count, used_videos + video_count
            start += length
    inputs["position_ids"] = torch.cat([text[None], rotary]).to(inputs["input_ids"].device)
    return inputs


def _video_times(inputs: dict[str, Any], used: int, count: int) -> dict[str, Any]:
    """A record's videos' seconds per temporal patch (the Qwen2.5-VL family's get_rope_index takes them;
    Qwen2-VL's has no such argument, and its batches no such key)."""
    seconds = inputs.get(SECONDS_PER_PATCH)
    if seconds is None or not count:
        return {}
    return {SECONDS_PER_PATCH: seconds[used : used + count]}


def _text_attention(model: nn.Module) -> str:
    return str(base_model(model).config.get_text_config()._attn_implementation)


def _rotary_index_function(model: nn.Module) -> Any:
    """Qwen2-VL's get_rope_index (its inner model's), or None for a model with 1-D positions (LLaVA)."""
    model = base_model(model)
    inner = getattr(model, "model", model)
    return getattr(inner, "get_rope_index", None)


# ----------------------------------------------------------------------------- attention per record
PACKED_SPANS = "packed_spans"  # the model-call keyword that carries each row's record lengths to attention
PACKED_ATTENTION = "packed_sdpa"  # the attention implementation that reads it


def packed_sdpa_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """sdpa run record by record, each span of a row causal on its own: the fused causal kernel, where a
    block-diagonal mask over the whole row sends sdpa to its unfused kernel and computes every record
    against every other, only to mask them. Without spans (an unpacked batch) it is plain sdpa."""
    spans = kwargs.pop(PACKED_SPANS, None)
    if spans is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    width = query.shape[2]
    for row, lengths in enumerate(spans):
        pieces, start = [], 0
        for length in [*lengths, width - sum(lengths)]:
            if length:
                part = slice(start, start + length)
                out, _ = sdpa_attention_forward(
                    module, query[row : row + 1, :, part], key[row : row + 1, :, part], value[row : row + 1, :, part],
                    None, is_causal=True, **kwargs,
                )  # fmt: skip
                pieces.append(out)
                start += length
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0), None


# ----------------------------------------------------------------------------- one varlen kernel (CUDA)
PACKED_VARLEN = "packed_varlen"  # every record of the batch in one call of torch's varlen flash kernel
PACKED_BOUNDS = "packed_bounds"  # the model-call keyword with the sequences' bounds in the flattened batch


def varlen_bounds(spans: list[list[int]], width: int) -> torch.Tensor:
    """Where each record (and each row's padding, a sequence of its own) starts in the batch flattened to
    rows x width positions, and where the last ends: the varlen kernel's cu_seqlens, int32."""
    return torch.tensor([0, *_sequences(spans, width)], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _sequences(spans: list[list[int]], width: int) -> list[int]:
    """Each record's length and each row's padding (a sequence of its own), row by row."""
    return [n for row in spans for n in [*row, width - sum(row)] if n]


def _varlen_kernel() -> Any:
    """torch.nn.attention.varlen.varlen_attn (torch 2.10 and later; flash attention, CUDA only), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_runs(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether the flash kernel takes this call: CUDA, 16-bit, no attention dropout."""
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and not kwargs.get("dropout")


def packed_varlen_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, None]:
    """Every record (and each row's padding) of a packed batch as one sequence of a single varlen call:
    one kernel launch per layer whatever the records, no mask, no work across records. Falls back to the
    per-record sdpa where the kernel cannot run: fp32, attention dropout, a CPU tensor, an unpacked batch."""
    spans = kwargs.get(PACKED_SPANS)
    kernel = _varlen_kernel()
    if spans is None or kernel is None or not _varlen_runs(query, kwargs):
        return packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)
    rows, heads, width, dim = query.shape
    bounds = kwargs.get(PACKED_BOUNDS)
    if bounds is None:  # a call from outside the training step (packed_inputs makes them once a batch)
        bounds = varlen_bounds(spans, width)
    bounds = bounds.to(query.device)  # nothing to do when it came with the batch
    longest = max(_sequences(spans, width))

    def flat(tensor: torch.Tensor) -> torch.Tensor:  # [rows, heads, width, dim] -> [rows x width, heads, dim]
        return tensor.transpose(1, 2).reshape(rows * width, tensor.shape[1], dim)

    out = kernel(
        flat(query), flat(key), flat(value), bounds, bounds, longest, longest,
        scale=kwargs.get("scaling"), window_size=(-1, 0), enable_gqa=key.shape[1] != heads,
    )  # fmt: skip
    return out.reshape(rows, width, heads, dim), None


def use_packed_attention(model: nn.Module) -> str:
    """Make the language model attend record by record in packed batches (sdpa only: eager keeps the
    block-diagonal mask, flash-attention its own varlen path); returns the implementation it runs:
    packed_varlen (one varlen flash call per layer) where torch has the kernel and the model is on a CUDA
    device, else packed_sdpa (sdpa's fused causal kernel once per record)."""
    model = base_model(model)
    text = model.config.get_text_config()
    if text._attn_implementation != "sdpa":
        return str(text._attn_implementation)
    on_cuda = any(p.is_cuda for p in model.parameters())
    name, function = PACKED_ATTENTION, packed_sdpa_attention
    if on_cuda and _varlen_kernel() is not None:
        name, function = PACKED_VARLEN, packed_varlen_attention
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)  # unpacked batches keep sdpa's masks
    model.set_attn_implementation({"text_config": name})
    return name
