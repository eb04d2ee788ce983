"""Throughput, MFU and peak memory of a ~2B-parameter vision-language model per DeepSpeed preset, one GPU.

    python bench/gpu_presets.py                           # one CUDA GPU (written for an H200): ~6-8 min
    python bench/gpu_presets.py --presets z2 z3 --micro-batch 8
    python bench/gpu_presets.py --device cpu --tiny       # the same code path, tiny model, on a CPU
    python bench/gpu_presets.py --dry-run                 # sizes, FLOPs and DeepSpeed dicts; trains nothing

The model is a LLaVA built from config with random weights (no download): a CLIP ViT-L/14 at 336 px
(1024 wide, 24 layers) + a 2-layer MLP projector + a Llama-style language model (2048 wide, 30
layers, vocabulary 32064), about 2.0 B parameters in all (counted on the meta device and printed).
All vision layers feed the projector (`vision_feature_layer=-1`), so every layer does work.

Steps:
  1. the bf16 matmul rate of this device: torch.matmul of 8192 x 8192 bf16 matrices (2 n^3 FLOPs each);
  2. per preset, a fresh process (DeepSpeed keeps process-wide state; an out-of-memory must not end the
     sweep): the DeepSpeed dict is the one `python train.py deepspeed=PRESET precision=bf16` would give
     `deepspeed.initialize` (composed by Hydra and `launcher.entry.plan_deepspeed`, buckets from the
     language model's hidden size), the model is built on the GPU (ZeRO-3: partitioned at construction
     by `HfDeepSpeedConfig` + zero.Init, as train.py does), and trained on synthetic batches already on
     the device (random pixels and tokens: this measures the model and DeepSpeed, not data loading);
  3. a Markdown table. Per preset: samples/s and tokens/s (all sequence positions, image tokens
     included) over the measured steps, MFU, peak GPU memory (torch.cuda.max_memory_allocated over the
     whole process) and the process's peak host RSS (where offloaded states live).

Model FLOPs (PaLM-style; no recomputation counted): per sample
    6 * (N_vision * T_vision + N_projector * T_image + N_language * T_text)
  + 12 * (L_vision * T_vision^2 * d_vision + L_language * T_text^2 * d_language)
N_* are each component's parameters less its lookup tables (position and token embeddings; the
language model's output head is a matmul and counts), T_vision = patches + 1 (CLS), T_image = patches,
T_text = the language model's sequence (image tokens + text tokens). MFU = model FLOPs per second /
the measured matmul rate of step 1 (not the data-sheet peak).

A time budget (--budget-s, default 450 s) is checked before each preset: what does not fit is listed
as skipped, and a preset's process is stopped when the budget runs out. Without CUDA (and without
--device cpu) the script stops at once and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ["z0", "z1", "z2", "z3", "z2_offload", "z3_offload"]  # offloads last: slowest, need cpu_adam

# (vision: hidden, layers, heads, image, patch; language: hidden, layers, heads, intermediate, vocab)
FULL = {
    "vision": {"hidden": 1024, "layers": 24, "heads": 16, "image": 336, "patch": 14},
    "language": {"hidden": 2048, "layers": 30, "heads": 16, "intermediate": 5632, "vocab": 32064},
    "text_tokens": 64,
}
TINY = {
    "vision": {"hidden": 64, "layers": 2, "heads": 2, "image": 32, "patch": 8},
    "language": {"hidden": 64, "layers": 2, "heads": 2, "intermediate": 256, "vocab": 512},
    "text_tokens": 16,
}


# ----------------------------------------------------------------------------- model and FLOPs
def llava_config(size: dict[str, Any]) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    vision, language = size["vision"], size["language"]
    patches = (vision["image"] // vision["patch"]) ** 2
    return LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=vision["hidden"],
            intermediate_size=4 * vision["hidden"],
            num_hidden_layers=vision["layers"],
            num_attention_heads=vision["heads"],
            image_size=vision["image"],
            patch_size=vision["patch"],
            projection_dim=vision["hidden"],
        ),
        text_config=LlamaConfig(
            vocab_size=language["vocab"],
            hidden_size=language["hidden"],
            intermediate_size=language["intermediate"],
            num_hidden_layers=language["layers"],
            num_attention_heads=language["heads"],
            num_key_value_heads=language["heads"],
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        image_token_index=language["vocab"] - 1,  # the last id; random text tokens never take it
        image_seq_length=patches,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",  # drops CLS: one image token per patch
        tie_word_embeddings=False,
    )


def sequence_lengths(size: dict[str, Any]) -> dict[str, int]:
    patches = (size["vision"]["image"] // size["vision"]["patch"]) ** 2
    # bos, one token per patch, then text (the question and answer a real sample would hold)
    return {"vision": patches + 1, "image": patches, "text": 1 + patches + size["text_tokens"]}


def parameter_counts(size: dict[str, Any]) -> dict[str, int]:
    """Parameters per component, and the matmul (non-lookup) parameters the FLOPs formula uses."""
    import torch
    from transformers import LlavaForConditionalGeneration

    with torch.device("meta"):
        model = LlavaForConditionalGeneration(llava_config(size))

    def total(module: Any) -> int:
        return sum(p.numel() for p in module.parameters())

    inner = model.model
    vision = total(inner.vision_tower)
    projector = total(inner.multi_modal_projector)
    language = total(inner.language_model) + total(model.lm_head)
    tower = getattr(inner.vision_tower, "vision_model", inner.vision_tower)  # CLIPVisionModel's layout varies
    lookups_vision = tower.embeddings.position_embedding.weight.numel() + tower.embeddings.class_embedding.numel()
    lookups_language = inner.language_model.embed_tokens.weight.numel()
    return {
        "vision": vision,
        "projector": projector,
        "language": language,
        "total": total(model),
        "vision_matmul": vision - lookups_vision,
        "projector_matmul": projector,
        "language_matmul": language - lookups_language,
    }


def flops_per_sample(size: dict[str, Any], counts: dict[str, int]) -> float:
    """Training FLOPs of one sample (forward + backward), the formula in the module docstring."""
    tokens = sequence_lengths(size)
    vision, language = size["vision"], size["language"]
    dense = 6 * (
        counts["vision_matmul"] * tokens["vision"]
        + counts["projector_matmul"] * tokens["image"]
        + counts["language_matmul"] * tokens["text"]
    )
    attention = 12 * (
        vision["layers"] * tokens["vision"] ** 2 * vision["hidden"]
        + language["layers"] * tokens["text"] ** 2 * language["hidden"]
    )
    return float(dense + attention)


def matmul_tflops(device: str, n: int, repeats: int = 50) -> float:
    """Measured bf16 torch.matmul rate (TFLOP/s) for n x n matrices."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):
        a @ b
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync()
    rate = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()  # leave the device to the presets' processes
    return rate


# ----------------------------------------------------------------------------- one preset (a worker)
def planned_ds_config(preset: str, micro: int, steps: int, hidden_size: int) -> dict[str, Any]:
    """The DeepSpeed dict `python train.py deepspeed=PRESET precision=bf16 ...` would hand to DeepSpeed."""
    from hydra import compose, initialize_config_dir

    from launcher.entry import plan_deepspeed
    from launcher.schema import register_configs

    register_configs()
    overrides = [
        f"deepspeed={preset}",
        "precision=bf16",
        f"train.micro_batch_size={micro}",
        "train.grad_accum=1",
        f"train.max_steps={steps}",
        f"model.hidden_size={hidden_size}",  # the composition derives bucket sizes from it
        "logger=none",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    ds_config, _ = plan_deepspeed(cfg, overrides)
    return ds_config


def gpu_adam_fallback(ds_config: dict[str, Any]) -> str | None:
    """On a GPU DeepSpeed's AdamW is its fused_adam op, JIT-built with nvcc on first use. Where it cannot
    be built (no CUDA toolkit), use torch's AdamW through DeepSpeed (`torch_adam`) and say so."""
    offloaded = ds_config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none"
    if offloaded:
        return None  # DeepSpeedCPUAdam (cpu_adam op); a failure to build it fails the preset
    try:
        from deepspeed.ops.op_builder import FusedAdamBuilder

        FusedAdamBuilder().load(verbose=False)
        return None
    except Exception as error:
        ds_config["optimizer"]["params"]["torch_adam"] = True
        first = str(error).strip().splitlines()[0][:120] if str(error).strip() else type(error).__name__
        return f"torch AdamW (fused_adam unavailable: {first})"


def synthetic_batch(size: dict[str, Any], config: Any, micro: int, device: Any) -> dict[str, Any]:
    import torch

    tokens = sequence_lengths(size)
    vocab, image_token = size["language"]["vocab"], config.image_token_id
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab - 1, (micro, tokens["text"]), generator=generator)
    input_ids[:, 1 : 1 + tokens["image"]] = image_token
    labels = input_ids.clone()
    labels[:, : 1 + tokens["image"]] = -100  # loss on text tokens only, as on real data
    pixels = torch.randn(micro, 3, size["vision"]["image"], size["vision"]["image"], generator=generator)
    batch = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "labels": labels,
        "pixel_values": pixels.to(torch.bfloat16),
    }
    return {key: value.to(device) for key, value in batch.items()}


def worker(args: argparse.Namespace) -> None:
    """Train one preset for warm-up + measured steps; write figures to args.out as JSON."""
    from launcher.processes import free_port

    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    )
    os.environ["MASTER_PORT"] = str(free_port())
    import logging

    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils import logger as deepspeed_logger
    from transformers import LlavaForConditionalGeneration
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed_logger.setLevel(logging.WARNING)
    size = TINY if args.tiny else FULL
    cuda = args.device == "cuda"
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    steps = args.warmup + args.steps
    ds_config = planned_ds_config(args.worker, args.micro_batch, steps, size["language"]["hidden"])
    optimizer_note = gpu_adam_fallback(ds_config) if cuda else None
    config = llava_config(size)
    torch.manual_seed(0)
    setup_start = time.perf_counter()
    if ds_config["zero_optimization"]["stage"] == 3:
        keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 (from_config partitions at construction)
        model = LlavaForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    else:
        with device:
            model = LlavaForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    model.config.use_cache = False
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    setup_s = time.perf_counter() - setup_start
    batch = synthetic_batch(size, config, args.micro_batch, device)
    accelerator = get_accelerator()
    engine.train()
    losses = []
    for step in range(steps):
        if step == args.warmup:
            accelerator.synchronize()
            start = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        if step == args.warmup - 1 or step == steps - 1:
            losses.append(float(loss))  # a sync point; also a check that training is finite
    accelerator.synchronize()
    elapsed = time.perf_counter() - start
    result = {
        "preset": args.worker,
        "zero_stage": ds_config["zero_optimization"]["stage"],
        "offload_optimizer": ds_config["zero_optimization"].get("offload_optimizer", {}).get("device", "none"),
        "offload_param": ds_config["zero_optimization"].get("offload_param", {}).get("device", "none"),
        "step_s": elapsed / args.steps,
        "samples_per_sec": args.micro_batch * args.steps / elapsed,
        "tokens_per_sec": args.micro_batch * sequence_lengths(size)["text"] * args.steps / elapsed,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "setup_s": setup_s,
        "losses": losses,
        "optimizer": optimizer_note or type(engine.optimizer).__name__,
    }
    args.out.write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- the sweep
def run_preset(preset: str, args: argparse.Namespace, out: Path, timeout: float) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        preset,
        "--out",
        str(out),
        "--device",
        args.device,
        "--micro-batch",
        str(args.micro_batch),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        *(["--tiny"] if args.tiny else []),
    ]
    log = out.with_suffix(".log")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":  # as bench/overhead.py: DeepSpeed's CPU ops in a directory of our own
        env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / "outputs" / "bench" / "torch_extensions"))
    try:
        with open(log, "w") as handle:
            completed = subprocess.run(
                command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout
            )
    except subprocess.TimeoutExpired:
        return {"preset": preset, "status": f"stopped: time budget ({timeout:.0f} s) ran out"}
    if completed.returncode != 0 or not out.is_file():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        reason = next(
            (line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else ""
        )
        if "out of memory" in log.read_text(errors="replace").lower():
            reason = "CUDA out of memory"
        return {"preset": preset, "status": f"failed (exit {completed.returncode}): {reason.strip()[:160]}"}
    return {**json.loads(out.read_text()), "status": "ok"}


def print_table(rows: list[dict[str, Any]], tflops: float, flops: float) -> None:
    print(
        "| preset | ZeRO | offload opt/param | samples/s | tokens/s | step s | MFU | peak GPU GiB | "
        "peak host RSS GiB | optimizer | status |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if row["status"] != "ok":
            print(f"| {row['preset']} | | | | | | | | | | {row['status']} |")
            continue
        mfu = row["samples_per_sec"] * flops / (tflops * 1e12)
        gpu = f"{row['peak_gpu_bytes'] / 2**30:.1f}" if row["peak_gpu_bytes"] is not None else "n/a (CPU)"
        print(
            f"| {row['preset']} | {row['zero_stage']} | {row['offload_optimizer']}/{row['offload_param']} | "
            f"{row['samples_per_sec']:.2f} | {row['tokens_per_sec']:.0f} | {row['step_s']:.3f} | {mfu:.1%} | "
            f"{gpu} | {row['peak_rss_bytes'] / 2**30:.1f} | {row['optimizer']} | ok |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=PRESETS)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (checks the code path on a CPU)")
    parser.add_argument("--micro-batch", type=int, help="samples per step (default: 16, or 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before the clock starts")
    parser.add_argument("--steps", type=int, help="measured steps per preset (default: 5, or 2 with --tiny)")
    parser.add_argument("--matmul-n", type=int, help="matrix side for the matmul rate (default: 8192, 256 tiny)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-time budget for the whole sweep")
    parser.add_argument("--dry-run", action="store_true", help="print sizes, FLOPs and the DeepSpeed dicts only")
    parser.add_argument("--worker", choices=PRESETS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.micro_batch = args.micro_batch or (2 if args.tiny else 16)
    args.steps = args.steps or (2 if args.tiny else 5)
    if args.worker:
        worker(args)
        return
    started = time.perf_counter()
    if args.device == "cuda" and not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device (torch.cuda.is_available() is False, torch "
                f"{torch.__version__}): this benchmark needs a GPU. Check the code path on a CPU with "
                "`python bench/gpu_presets.py --device cpu --tiny`, or print the plan with --dry-run",
                file=sys.stderr,
            )
            sys.exit(2)

    size = TINY if args.tiny else FULL
    counts = parameter_counts(size)
    flops = flops_per_sample(size, counts)
    tokens = sequence_lengths(size)
    print(
        f"model: LLaVA, vision {counts['vision']:,} + projector {counts['projector']:,} + language "
        f"{counts['language']:,} = {counts['total']:,} parameters ({counts['total'] / 1e9:.3g} B); sequence "
        f"{tokens['text']} tokens ({tokens['image']} image), micro batch {args.micro_batch}, bf16"
    )
    print(
        f"model FLOPs per training sample: {flops:.4g} ({flops / tokens['text']:.4g} per token; 6 x all "
        f"parameters would give {6 * counts['total']:.4g})"
    )
    if args.dry_run:
        for preset in args.presets:
            ds = planned_ds_config(preset, args.micro_batch, args.warmup + args.steps, size["language"]["hidden"])
            print(f"\n{preset}: {json.dumps(ds['zero_optimization'])}")
        return

    n = args.matmul_n or (256 if args.tiny else 8192)
    tflops = matmul_tflops(args.device, n)
    print(f"measured bf16 matmul rate ({n} x {n}, {args.device}): {tflops:.3g} TFLOP/s\n")

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-presets-") as tmp:
        for preset in args.presets:
            left = args.budget_s - (time.perf_counter() - started)
            if left < 30:
                rows.append({"preset": preset, "status": f"skipped: {left:.0f} s of the time budget left"})
                continue
            row = run_preset(preset, args, Path(tmp) / f"{preset}.json", timeout=left)
            rows.append(row)
            print(f"  {preset}: {row['status']} at {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print()
    print_table(rows, tflops, flops)
    print(f"\nwall {time.perf_counter() - started:.0f} s; MFU against the measured matmul rate {tflops:.3g} TFLOP/s")


if __name__ == "__main__":
    main()
