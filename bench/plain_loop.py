"""The plain PyTorch loop every GPU row of bench/gpu_run.py is a ratio to: transformers' own Qwen2-VL model,
none of this project's code (no launcher import, no DeepSpeed), the way a careful engineer would write it.

    python bench/plain_loop.py --config launcher/model/presets/Qwen--Qwen2-VL-2B-Instruct/config.json \
        --shapes 8x1024 1x8192 --out rows.jsonl
    python bench/plain_loop.py --config SMALL/config.json --shapes 1x1024 --dtype fp32 --device cpu --out r.jsonl

The model is `Qwen2VLForConditionalGeneration` (or Qwen2.5-VL's) built from the config with random weights:
fp32 master weights, bf16 autocast, torch's fused AdamW on CUDA, SDPA attention, no activation
checkpointing. A shape BxS is B rows of S tokens, one 448 x 448 image per 1,024 tokens (its 32 x 32 patches
of 14 pixels merged 2 x 2: 256 image tokens, between the vision start and end tokens), the rest random text
tokens; one row of 8,192 tokens is one causal sequence with 8 images. The labels are the text tokens.
Per shape: --warmup steps, then --steps timed steps (synchronised), the median step; peak memory is torch's
allocator's (CUDA), or the process's peak RSS on a CPU. Each shape's row is appended to --out as a JSON
line the moment it is measured; an out-of-memory is a row too ("status": "out of memory"), and the next
shape runs after the memory is freed.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

IMAGE_PIXELS = 448  # per side
TOKENS_PER_IMAGE_CHUNK = 1024  # one image per this many tokens


def build_model(config_path: Path, device: torch.device) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    config = AutoConfig.from_pretrained(str(config_path.parent))
    config._attn_implementation = "sdpa"
    config.use_cache = False
    classes = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
    if config.model_type not in classes:
        raise SystemExit(f"plain_loop: {config_path} is a {config.model_type} model; it covers {sorted(classes)}")
    torch.manual_seed(0)
    with device:
        model = classes[config.model_type]._from_config(config, dtype=torch.float32)
    return model.train(), config


def synthetic_batch(config: Any, rows: int, length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """`rows` rows of `length` tokens with one 448 x 448 image per 1,024 tokens (at least one)."""
    vision = config.vision_config
    patch, merge, temporal = int(vision.patch_size), int(vision.spatial_merge_size), int(vision.temporal_patch_size)
    side = IMAGE_PIXELS // patch  # patches per side
    image_tokens = side * side // (merge * merge)
    images_per_row = max(1, length // TOKENS_PER_IMAGE_CHUNK)
    special = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    vocabulary = int(config.get_text_config().vocab_size)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocabulary, min(special)), (rows, length), generator=generator)
    labels = ids.clone()
    chunk = length // images_per_row
    for image in range(images_per_row):
        start = image * chunk
        ids[:, start] = config.vision_start_token_id
        ids[:, start + 1 : start + 1 + image_tokens] = config.image_token_id
        ids[:, start + 1 + image_tokens] = config.vision_end_token_id
        labels[:, start : start + 2 + image_tokens] = -100
    images = rows * images_per_row
    per_patch = int(vision.in_chans if hasattr(vision, "in_chans") else 3) * temporal * patch * patch
    pixels = torch.randn(images * side * side, per_patch, generator=generator)
    grid = torch.tensor([[1, side, side]] * images)
    # transformers 5 places the 3-D rotary positions of images by this map (its processor returns it too).
    token_types = (ids == config.image_token_id).long()
    batch = {"input_ids": ids, "labels": labels, "pixel_values": pixels, "image_grid_thw": grid}
    batch["mm_token_type_ids"] = token_types
    return {key: value.to(device) for key, value in batch.items()}


def peak_memory(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {
            "peak_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
            "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20,
        }
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model, config, optimizer, shape: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rows, length = (int(part) for part in shape.lower().split("x"))
    batch = synthetic_batch(config, rows, length, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    times = []
    for step in range(args.warmup + args.steps):
        synchronize(device)
        started = time.perf_counter()
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - started)
    step_s = statistics.median(times)
    images = int(batch["image_grid_thw"].shape[0])
    return {
        "shape": shape,
        "micro_batch": rows,
        "seq_len": length,
        "images": images,
        "tokens_per_s": rows * length / step_s,
        "step_s": step_s,
        "step_s_all": times,
        "loss": float(loss.detach()),
        "status": "ok",
        **peak_memory(device),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="a Qwen2-VL or Qwen2.5-VL config.json")
    parser.add_argument("--shapes", nargs="+", default=["8x1024", "1x8192", "4x1024"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="autocast dtype (fp32: none)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per shape, appended")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    model, config = build_model(args.config, device)
    params = sum(p.numel() for p in model.parameters())
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0, **fused)
    build_s = time.time() - started
    for shape in args.shapes:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            row = measure(model, config, optimizer, shape, args, device)
        except torch.OutOfMemoryError as err:
            rows, length = (int(part) for part in shape.lower().split("x"))  # which shape did not fit, in the row
            row = {"shape": shape, "micro_batch": rows, "seq_len": length, "status": "out of memory",
                   "error": str(err).splitlines()[0], **peak_memory(device)}  # fmt: skip
        row.update(parameters=params, model_type=config.model_type, dtype=args.dtype, build_s=build_s)
        with args.out.open("a") as out:
            out.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
