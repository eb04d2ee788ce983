"""Gradient checkpointing: activation memory, step time and the loss curve, with it off and on.

    .venv/bin/python bench/gradient_checkpointing.py
    .venv/bin/python bench/gradient_checkpointing.py --arch tiny_qwen2_vl --image-size 224 --patch-size 14

Three variants, each from the same initial weights on the same batch: off; the language model
checkpointed (model.gradient_checkpointing); the language model and the vision tower (also
model.vision_gradient_checkpointing). The model is a tiny build big enough to show it (defaults:
tiny_llava, hidden 256, 4 + 4 layers, 224 px images in 14 px patches = 256 image tokens, + ~270 text
tokens per sample, micro batch 4, fp32, AdamW, 2 threads), trained by a plain loop in Python through
the launcher's own `load_model_and_processor`, `enable_gradient_checkpointing` and `Collator`. Each
variant runs twice, each time in a fresh process: once for memory, once for time and the loss curve.

Figures per variant:
  saved      bytes of the tensors autograd keeps for backward during one forward pass (each storage
             once, parameters left out): what checkpointing removes. Deterministic.
  peak       the most resident memory above the level before the step, over forward + backward of
             step 2 (Adam's states exist by then): the kernel's high-water mark of the process (VmHWM,
             reset by writing 5 to /proc/self/clear_refs just before the step). It includes the
             backward's recomputation and the gradients. In this run glibc gives every allocation of
             64 KiB or more its own mapping and unmaps it when freed (mallopt M_MMAP_THRESHOLD, which
             also stops the threshold from adapting), so resident memory follows the live tensors
             rather than what malloc kept; PyTorch keeps no CPU cache. Deterministic to a few MiB.
  planner    `launcher.plan.memory.activation_bytes` for the same model, sequence and batch.
  step       median wall and CPU time (the process, all threads) per step over steps 2..N, in the other
             run, with glibc left alone (the page faults of a mapping per allocation cost ~40% more CPU).
             The machine's noise is ~25%; with other processes busy, OpenMP's spinning threads inflate
             CPU time as well, so the share of the CPU they used is printed.
  loss       the largest relative difference of the loss curve from the variant without checkpointing
             over all steps (same seed: expected 0 up to rounding).
Prints a Markdown table, then the ratios against "off".
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _common as common

from launcher.data.collate import Collator
from launcher.data.shapes import COLOURS, QUESTION, SHAPES
from launcher.model.components import enable_gradient_checkpointing
from launcher.model.loading import load_model_and_processor
from launcher.model.stats import model_stats
from launcher.model.tiny import build_tiny_model_dir
from launcher.plan.memory import Layout, activation_bytes

MiB = 2**20
VARIANTS = {"off": (False, False), "language": (True, False), "language+vision": (True, True)}


# ----------------------------------------------------------------------------- memory
def follow_live_tensors() -> None:
    """Let resident memory follow live tensors: large allocations mmapped, and unmapped when freed."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 128 * 1024)


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


def reset_peak() -> int:
    """Reset the high-water mark to the current resident set; return that level in bytes."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def peak_since_reset() -> int:
    return _status_kib("VmHWM") * 1024


def saved_for_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes autograd keeps for backward in one forward pass (each storage once, parameters left out)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**batch)
    return sum(saved.values())


# ----------------------------------------------------------------------------- the job
def make_batch(processor, *, size: int, image_size: int, text_words: int, seed: int) -> dict[str, torch.Tensor]:
    """`size` conversations: a noise image, a question of `text_words` words, a two-word answer."""
    rng = np.random.default_rng(seed)
    words = sorted({word for text in vocabulary() for word in text.split()})
    samples = []
    for index in range(size):
        question = " ".join(rng.choice(words, size=text_words))
        pixels = rng.integers(0, 256, size=(image_size, image_size, 3), dtype=np.uint8)
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"{list(COLOURS)[index % 6]} circle"}]},
        ]
        samples.append({"images": [Image.fromarray(pixels)], "messages": messages})
    return Collator(processor)(samples)


def vocabulary() -> list[str]:
    return [QUESTION] + [f"{c} {s}" for c in COLOURS for s in SHAPES]


def planner_bytes(args: argparse.Namespace, path: Path, seq_len: int, language: bool, vision: bool) -> int:
    from launcher.config.compose import compose
    from launcher.config.schema import typed

    cfg = typed(
        compose(
            [
                f"model={args.arch}",
                f"model.hidden_size={args.hidden_size}",
                f"model.num_layers={args.num_layers}",
                f"model.vision_hidden_size={args.vision_hidden_size}",
                f"model.vision_layers={args.vision_layers}",
                f"model.image_size={args.image_size}",
                f"model.patch_size={args.patch_size}",
                f"model.gradient_checkpointing={str(language).lower()}",
                f"model.vision_gradient_checkpointing={str(vision).lower()}",
            ]
        )
    )
    stats = model_stats(cfg, path=str(path))
    return activation_bytes(
        stats, Layout(stage=0, dtype="fp32", micro_batch=args.batch_size), seq_len=seq_len, images=1
    )


def run_variant(args: argparse.Namespace, path: Path, name: str, mode: str) -> dict[str, Any]:
    """One variant in a fresh process (`--child MODE`): its figures, as the child printed them."""
    command = [sys.executable, __file__, *sys.argv[1:], "--child", mode, "--variant", name, "--model-dir", str(path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=common.bench_env())
    if result.returncode != 0:
        raise RuntimeError(f"{name} ({mode}) exited with {result.returncode}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def child(args: argparse.Namespace) -> dict[str, Any]:
    """memory: bytes saved in one forward pass, and the peak over forward + backward of step 2 (glibc set
    to follow live tensors); time: `args.steps` steps with glibc as it is, their times and losses."""
    if args.child == "memory":
        follow_live_tensors()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    language, vision = VARIANTS[args.variant]
    model, processor = load_model_and_processor(str(args.model_dir))
    model.config.use_cache = False
    enable_gradient_checkpointing(model, language=language, vision=vision)
    model.train()
    batch = make_batch(
        processor, size=args.batch_size, image_size=args.image_size, text_words=args.text_words, seed=args.seed
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    out: dict[str, Any] = {"tokens": int(batch["input_ids"].shape[1])}
    if args.child == "memory":
        out["saved"] = saved_for_backward(model, batch)
    losses, walls, cpus = [], [], []
    load = common.ForeignLoad()
    for step in range(2 if args.child == "memory" else args.steps):
        if step == 1 and args.child == "memory":
            base = reset_peak()
        wall, cpu = time.perf_counter(), time.process_time()
        loss = model(**batch).loss
        loss.backward()
        if step == 1 and args.child == "memory":
            out["peak"] = peak_since_reset() - base
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    if args.child == "time":
        out.update(
            wall=statistics.median(walls[1:]),
            cpu=statistics.median(cpus[1:]),
            losses=losses,
            foreign_cpu=load.share(),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="tiny_llava", choices=["tiny_llava", "tiny_qwen2_vl"])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vision-hidden-size", type=int, default=256)
    parser.add_argument("--vision-layers", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--patch-size", type=int, default=14)
    parser.add_argument("--text-words", type=int, default=240, help="words per question (one token each)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-foreign-cpu", type=float, default=0.10, help="wait (up to 2 min) for a quiet machine")
    parser.add_argument("--work-dir", type=Path, help="keep the tiny model here (default: temporary)")
    parser.add_argument("--child", choices=["memory", "time"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    with tempfile.TemporaryDirectory(prefix="gc-bench-") as tmp:
        work = args.work_dir or Path(tmp)
        path = build_tiny_model_dir(
            args.arch,
            work / f"{args.arch}-{args.hidden_size}-{args.num_layers}-{args.image_size}",
            vocabulary(),
            seed=args.seed,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            vision_hidden_size=args.vision_hidden_size,
            vision_layers=args.vision_layers,
            image_size=args.image_size,
            patch_size=args.patch_size,
        )
        results = {}
        for name, (language, vision) in VARIANTS.items():
            memory = run_variant(args, path, name, "memory")
            if args.max_foreign_cpu > 0:
                common.wait_for_quiet(args.max_foreign_cpu, max_wait_s=120)
            run = {**memory, **run_variant(args, path, name, "time")}
            run["planner"] = planner_bytes(args, path, run["tokens"], language, vision)
            results[name] = run
            print(
                f"  {name}: saved {run['saved'] / MiB:.1f} MiB, peak {run['peak'] / MiB:.1f} MiB, "
                f"{run['wall']:.2f} s/step, others used {run['foreign_cpu']:.0%} of the CPU",
                file=sys.stderr,
            )
    print(report(args, results))


def report(args: argparse.Namespace, results: dict[str, dict]) -> str:
    off = results["off"]
    tokens = off["tokens"]
    lines = [
        f"{args.arch}, hidden {args.hidden_size} x {args.num_layers} layers, vision {args.vision_hidden_size} x "
        f"{args.vision_layers} layers, {args.image_size} px / {args.patch_size} px patches; micro batch "
        f"{args.batch_size} x {tokens} tokens; fp32; {args.steps} steps of AdamW; {args.threads} threads",
        "",
        "| checkpointed | saved for backward (MiB) | peak over fwd+bwd (MiB) | planner activations (MiB) "
        "| step wall (s) | step CPU (s) | loss: max rel. diff vs off |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, run in results.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], off["losses"], strict=True))
        lines.append(
            f"| {name} | {run['saved'] / MiB:.1f} | {run['peak'] / MiB:.1f} | {run['planner'] / MiB:.1f} "
            f"| {run['wall']:.2f} | {run['cpu']:.2f} | {diff:.1e} |"
        )
    foreign = max(run["foreign_cpu"] for run in results.values())
    lines += ["", "| ratio | saved | peak | planner | step wall | step CPU |", "|---|---|---|---|---|---|"]
    for name, run in list(results.items())[1:]:
        ratios = [run[key] / off[key] for key in ("saved", "peak", "planner", "wall", "cpu")]
        lines.append(f"| {name} / off | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")
    lines.append("")
    lines.append(f"loss at step 1 / {args.steps}: {off['losses'][0]:.4f} / {off['losses'][-1]:.4f} (off)")
    lines.append(f"other processes used at most {foreign:.0%} of the CPU during a timed run")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
