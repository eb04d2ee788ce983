"""The prepared GPU run of issue 41: a plain PyTorch loop, then this launcher, at real model shapes, as rows.

    python3 bench/gpu_run.py --commit "$(git rev-parse HEAD)"     # one GPU: rows in $OUT (gpu.json, gpu.md)
    python bench/gpu_run.py --cpu                                 # the rehearsal here: every phase, tiny sizes

On a bare GPU machine the wheels in .whl/ (bench/device_wheels.sh) are installed first, as
bench/device_check.py does. Phases, in this order (issue 41's targets first, then what each change buys),
each skipped when the time left (--budget-s, default 540) is less than it needs; one call of 9 minutes
measures the first few (their needs add up to more), and `--phases` runs the rest in another call:

  plain     bench/plain_loop.py: transformers' Qwen2-VL-2B at its real shape (2,208,985,600 parameters,
            random weights), no launcher code, at 8 x 1,024, 1 x 8,192 and 4 x 1,024 tokens (one 448 x 448
            image per 1,024). Every other row is a ratio to the fastest of these.
  fixed     the launcher at the plain loop's own batch: `model=qwen2_vl_2b model.source=random`, records of one
            448-pixel image cut to 1,024 tokens (data.max_length), micro batch 8, ZeRO 0, bf16.
  packing   variable-length records (one image and 20 to 1,800 answer words each: about 290 to 2,070
            tokens), packed into rows of 8,192 of at most 12 images at micro batches 1, 2, 4, ZeRO 0;
  profile   the fastest launcher row so far once more, its step 3 profiled (train.profile_steps): where the
            step goes, by part (launcher/train/profile.py), as OUT/profile.md.
  padding   the same records, length grouping and plain padding at micro batches 2, 4, 8 (data.max_length
            8,192, sharing the packing phase's data cache; the tuner plans each at the longest record it holds).
  lora7b    Qwen2.5-VL-7B (8,292,166,656 parameters) LoRA, packed 16,384, checkpointing, micro batch 1.
  liger     the packing phase's rows (micro batches 1 and 2) with model.kernels=liger: liger-kernel's fused
            loss, RMSNorm, SwiGLU, rotary and LayerNorm kernels (docs/models.md), as a ratio to those rows.
  z2        packed 8,192 at ZeRO 2 with activation checkpointing, micro batches 2 and 4.
  compile   the fixed row with model.compile=true (each layer's MLP and norms compiled by torch.compile; the
            first step pays the compilation): what fusing them buys, as a ratio to the fixed row.
  z3_7b     Qwen2.5-VL-7B full at ZeRO 3, packed 16,384, checkpointing, micro batch 1. Not in the default
            list: planned at ~171 GiB, it is pruned on one GPU (`--plan`).
  video16   Qwen2-VL-2B on video records (issue 43): one clip each, 16 frames of 448 x 448 sampled (4 per
            second of a 4 s clip), taken as a video (8 temporal patches of two frames: 2,048 tokens), a
            200-word answer; micro batches 1, 2, 4, padded, ZeRO 0, decoded by 4 DataLoader workers.
  video64   the same with 64 frames (a 16 s clip: 8,192 video tokens), micro batch 1, checkpointing.
            Not in the default list: `--phases video16 video64` in a call of their own, whose .whl was
            made with WITH_AV=1 (PyAV decodes the clips; the image has no video decoder).

Every model trains every part (model.freeze_vision=false), as the plain loop does, so the rows do the same
work. The launcher's rows are `python -m launcher.tune` candidates (each one train.py job, stopped once its
steps are measured, so no 20-100 GB checkpoint is written): real tokens/s, MFU (launcher.model.flops, vision
tower counted, against the device's table peak), the peak memory torch's allocator reserved, the planner's
figure, the data-wait share of the measured steps. The plain loop's MFU is counted the same way.

Files, rewritten as each row ends (a run cut at its limit keeps what it measured): OUT/gpu.json (the rows:
the list bench/results/gpu.json keeps), OUT/gpu.md (the table with each row's ratio to the plain loop's best),
OUT/profile.md, OUT/run.log (with the last lines of any command that failed or was stopped). OUT is --out-dir,
else $OUT, else outputs/bench/gpu_run/TIME. Work files (data, tuner directories: each phase's made afresh, as a
warm machine keeps them between calls) stay in --work-dir (outputs/bench/gpu_run/work).

CPU mode (--cpu): the same phases but liger (its kernels need CUDA) on shrunk configs of the same two families
(64 wide, 2 layers, the real vocabularies and image processors), fp32, rows of 1,024 and 2,048 tokens, a few
records; the figures mean nothing, the path is what is rehearsed (tests/e2e/test_gpu_run.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PRESETS = ROOT / "launcher" / "model" / "presets"
QWEN2_VL_2B = PRESETS / "Qwen--Qwen2-VL-2B-Instruct" / "config.json"
QWEN2_5_VL_7B = PRESETS / "Qwen--Qwen2.5-VL-7B-Instruct" / "config.json"
# Letters only, each one token of the random build's tokenizer: Qwen's pre-tokenizer splits digits off a word
# ("w12": "w", "12"), which made the answers twice the tokens the phases were sized for (seen by planning them
# from the data cache: the variable records' longest was 3,870 tokens, not ~2,100).
WORDS = [f"w{first}{second}" for first in "abcdefghij" for second in "abcdefghijklmnopqrst"]
MiB = 2**20
ZERO_STAGE = {"z0": 0, "z1": 1, "z2": 2, "z3": 3, "z2_offload": 2, "z3_offload": 3}
STOP_GRACE_S = 5
LOG_TAIL_LINES = 30  # of a failed or stopped command's log, into run.log


# ================================================================================ what is run
@dataclass(frozen=True)
class Phase:
    """One group of rows: the plain loop, or one tuner run (its overrides: model, data, the space)."""

    name: str
    needs_s: float  # what it needs at least; skipped when less is left
    model: str  # the rows' model name
    config: Path  # the architecture's config.json
    method: str = "full"
    overrides: tuple[str, ...] = ()
    data: str = "variable"  # fixed | variable
    shapes: tuple[str, ...] = ()  # the plain loop's


def space(preset: str, micro: str, checkpointing: str, batching: str, pack: int | None, length: int, batch: int):
    """A tuner space as overrides: the candidates of one phase."""
    overrides = [f"tune.presets=[{preset}]", f"tune.micro_batch_sizes=[{micro}]", f"data.max_length={length}",
                 f"tune.gradient_checkpointing=[{checkpointing}]", f"tune.batching=[{batching}]",
                 f"train.global_batch_size={batch}"]  # fmt: skip
    return (*overrides, *([f"tune.pack_lengths=[{pack}]"] if pack else []))


def gpu_phases() -> list[Phase]:
    # Every part trains; the recipes' own accumulation gives way to the global batch each phase names, and their
    # length in epochs to one in steps (a packed job cannot count epochs: its best.yaml would not run).
    # Each row measured once (tune.confirm_runs=0): the lease is short, and a GPU to itself is a quiet machine.
    base = ("model.source=random", "model.freeze_vision=false", "tune.precisions=[bf16]", "train.grad_accum=null",
            "train.max_steps=1000", "tune.confirm_runs=0")  # fmt: skip
    two_b, seven_b = ("model=qwen2_vl_2b", *base), ("model=qwen2_5_vl_7b", *base)
    qwen2, qwen25 = "Qwen2-VL-2B", "Qwen2.5-VL-7B"
    return [
        Phase("plain", 60, qwen2, QWEN2_VL_2B, shapes=("8x1024", "1x8192", "4x1024")),
        Phase("fixed", 60, qwen2, QWEN2_VL_2B, data="fixed",
              overrides=(*two_b, *space("z0", "8", "false", "pad", None, 1024, 8))),
        Phase("packing", 90, qwen2, QWEN2_VL_2B,
              overrides=(*two_b, ROW_IMAGES, *space("z0", "1,2,4", "false", "pack", 8192, 8192, 8))),
        Phase("profile", 60, qwen2, QWEN2_VL_2B),  # the fastest launcher row so far, its step 3 profiled
        # data.max_length 8,192 as the packing phase's, so its data cache serves here too (the length is in the
        # cache's key); a padded row is as long as its batch's longest record (about 2,100 tokens) either way,
        # and the tuner plans the candidates from the records in that cache (docs/tune.md).
        Phase("padding", 90, qwen2, QWEN2_VL_2B,
              overrides=(*two_b, *space("z0", "2,4,8", "false", "group,pad", None, 8192, 8))),
        Phase("lora7b", 75, qwen25, QWEN2_5_VL_7B, method="lora",
              overrides=(*seven_b, "method=lora", *space("z0", "1", "true", "pack", 16384, 16384, 4))),
        Phase("liger", 60, qwen2, QWEN2_VL_2B,
              overrides=(*two_b, ROW_IMAGES, LIGER, *space("z0", "1,2", "false", "pack", 8192, 8192, 8))),
        Phase("z2", 60, qwen2, QWEN2_VL_2B,
              overrides=(*two_b, ROW_IMAGES, *space("z2", "2,4", "true", "pack", 8192, 8192, 8))),
        Phase("compile", 90, qwen2, QWEN2_VL_2B, data="fixed",  # the fixed row, each layer's MLP and norms compiled
              overrides=(*two_b, "model.compile=true", *space("z0", "8", "false", "pad", None, 1024, 8))),
        # Planned at ~171 GiB: pruned on one GPU (`--plan`), so asked for by name only.
        Phase("z3_7b", 90, qwen25, QWEN2_5_VL_7B,
              overrides=(*seven_b, *space("z3", "1", "true", "pack", 16384, 16384, 4))),
        Phase("video16", 90, qwen2, QWEN2_VL_2B, data="video16",
              overrides=(*two_b, *VIDEO_LOADING, *space("z0", "1,2,4", "false", "pad", None, 2560, 4))),
        Phase("video64", 90, qwen2, QWEN2_VL_2B, data="video64",
              overrides=(*two_b, *VIDEO_LOADING, *space("z0", "1", "true", "pad", None, 8704, 1))),
    ]  # fmt: skip


# At most 12 images a packed row of 8,192 (data.pack_max_images): without it the rows that gather short records
# hold up to 23 images (7.0 on average) and the planner prunes micro batch 2; with it 96.1% of a row is records
# (99.5% without) and micro batch 2 plans 127,862 MiB (`python bench/gpu_run.py --plan 139`, BENCHMARKS.md).
ROW_IMAGES = "data.pack_max_images=12"
LIGER = "model.kernels=liger"

# Phases run only when asked for (--phases): the video phases' call carries PyAV (bench/device_wheels.sh
# WITH_AV=1); z3_7b's one candidate is pruned on one GPU.
ASKED_ONLY = ("z3_7b", "video16", "video64")
VIDEO_LOADING = ("data.num_workers=4",)


def cpu_phases(small: dict[str, Path]) -> list[Phase]:
    """The rehearsal: each GPU phase's path on shrunk configs, fp32, short rows (z2's and z3_7b's paths are
    the packing phase's with another ZeRO stage: left out to keep the rehearsal short). The liger phase is the
    packing phase's with model.kernels=liger, left out too: its kernels need CUDA, and in Triton's interpreter
    the fused loss over the real vocabulary took 169 s for one step of 128 answer tokens (the fused loss is
    tests/unit/model/test_kernels.py's, the whole job with it tests/unit/train/test_trainer.py's)."""
    base = ("model.source=random", "model.freeze_vision=false", "tune.precisions=[fp32]", "train.grad_accum=null",
            "train.max_steps=1000", "tune.warmup_steps=1", "tune.measure_steps=1", "tune.confirm_runs=0")  # fmt: skip
    two_b = ("model=qwen2_vl_2b", f"model.path={small['qwen2_vl'].parent}", *base)
    seven_b = ("model=qwen2_5_vl_7b", f"model.path={small['qwen2_5_vl'].parent}", *base)
    qwen2, qwen25 = "Qwen2-VL-2B (shrunk)", "Qwen2.5-VL-7B (shrunk)"
    return [
        Phase("plain", 10, qwen2, small["qwen2_vl"], shapes=("1x1024", "1x2048")),
        Phase("fixed", 10, qwen2, small["qwen2_vl"], data="fixed",
              overrides=(*two_b, *space("z0", "2", "false", "pad", None, 1024, 2))),
        Phase("packing", 10, qwen2, small["qwen2_vl"],
              overrides=(*two_b, ROW_IMAGES, *space("z0", "1", "false", "pack", 2048, 2048, 2))),
        Phase("profile", 10, qwen2, small["qwen2_vl"]),
        Phase("padding", 10, qwen2, small["qwen2_vl"],
              overrides=(*two_b, *space("z0", "1", "false", "pad", None, 2048, 2))),
        Phase("lora7b", 10, qwen25, small["qwen2_5_vl"], method="lora",
              overrides=(*seven_b, "method=lora", *space("z0", "1", "false", "pack", 2048, 2048, 1))),
        Phase("compile", 10, qwen2, small["qwen2_vl"], data="fixed",
              overrides=(*two_b, "model.compile=true", *space("z0", "2", "false", "pad", None, 1024, 2))),
        Phase("video16", 10, qwen2, small["qwen2_vl"], data="video4x224",
              overrides=(*two_b, *space("z0", "1", "false", "pad", None, 2560, 1))),
    ]  # fmt: skip


def shrunk_config(config_path: Path, out: Path) -> Path:
    """The architecture of `config_path` at 64 wide and 2 layers (vision tower too), its vocabulary, special
    tokens and image geometry kept: what a CPU runs in seconds."""
    config = json.loads(config_path.read_text())
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_window_layers=2)  # fmt: skip
    config["rope_scaling"] = {**config["rope_scaling"], "mrope_section": [2, 3, 3]}  # head dim 16: 8 pairs
    vision = config["vision_config"]
    vision.update(depth=2, num_heads=4)
    if config["model_type"] == "qwen2_vl":
        vision.update(embed_dim=64, hidden_size=64)
    else:  # Qwen2.5-VL: windowed attention but in the full-attention layers
        vision.update(hidden_size=64, intermediate_size=128, out_hidden_size=64, fullatt_block_indexes=[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out / "config.json"


# ================================================================================ data
def write_data(out: Path, kind: str, records: int, image_side: int = 448) -> list[str]:
    """A llava-format set of `records` records, one image each (a few distinct JPEGs of image_side px),
    the question short and the answer long: fixed (900 words: every record longer than 1,024 tokens, cut
    to it) or variable (20 to 1,800 words); or videoF / videoFxSIDE (`write_videos`: F frames of SIDE px,
    default image_side). Written once; the train.py overrides that read it."""
    from PIL import Image

    if kind.startswith("video"):  # videoF, or videoFxSIDE
        frames, _, side = kind.removeprefix("video").partition("x")
        return write_videos(out, int(frames), records, int(side or image_side))
    path = out / f"{kind}.json"
    images = out / "images"
    if not path.is_file():
        rng = random.Random(0)
        images.mkdir(parents=True, exist_ok=True)
        for index in range(8):
            pixels = bytes(rng.randrange(256) for _ in range(3 * 64 * 64))
            small = Image.frombytes("RGB", (64, 64), pixels)
            small.resize((image_side, image_side)).save(images / f"{index}.jpg", quality=90)
        rows = []
        for index in range(records):
            words = 900 if kind == "fixed" else rng.randint(20, 1800)
            answer = " ".join(rng.choice(WORDS) for _ in range(words))
            turns = [{"from": "human", "value": "<image>\ndescribe it"}, {"from": "gpt", "value": answer}]
            rows.append({"id": str(index), "image": f"{index % 8}.jpg", "conversations": turns})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.rename(path)
    return ["data=llava_json", f"data.path={path}", f"data.image_root={images}"]


def write_videos(out: Path, frames: int, records: int, side: int) -> list[str]:
    """`records` records of one clip each (8 distinct mp4 clips of `frames` frames of side x side at 4 per
    second: noise drifting frame by frame, so the encoder keeps every frame), a short question, a 200-word
    answer; and the overrides that sample every frame of each, at most side x side pixels, and plan a video
    (no image) per record."""
    import numpy as np

    from launcher.data.video import write_video

    path, clips = out / f"video{frames}_{side}.json", out / f"clips{frames}_{side}"
    if not path.is_file():
        rng = random.Random(0)
        clips.mkdir(parents=True, exist_ok=True)
        for index in range(8):
            base = np.random.default_rng(index).integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
            shown = [np.kron(np.roll(base, step, axis=1), np.ones((8, 8, 1), np.uint8)) for step in range(frames)]
            write_video(clips / f"{index}.mp4", shown, fps=4)
        rows = []
        for index in range(records):
            answer = " ".join(rng.choice(WORDS) for _ in range(200))
            turns = [{"from": "human", "value": "<video>\ndescribe it"}, {"from": "gpt", "value": answer}]
            rows.append({"id": str(index), "video": f"{index % 8}.mp4", "conversations": turns})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.rename(path)
    sampled = ["data.video.fps=4", f"data.video.min_frames={frames}", f"data.video.max_frames={frames}",
               f"data.video.max_pixels={side * side}", "plan.images_per_sample=0",
               "plan.videos_per_sample=1"]  # fmt: skip
    return ["data=llava_json", f"data.path={path}", f"data.image_root={clips}", *sampled]


# ================================================================================ rows
def plain_row(line: dict[str, Any], phase: Phase, context: dict[str, Any], peak_flops: float | None) -> dict[str, Any]:
    """One plain-loop shape as a row; its MFU from launcher.model.flops on the same architecture."""
    ok = line.get("status") == "ok"
    mfu = None
    if ok and peak_flops:
        flops = plain_step_flops(phase.config, int(line["micro_batch"]), int(line["seq_len"]), int(line["images"]))
        mfu = flops / float(line["step_s"]) / peak_flops
    peak = line.get("peak_reserved_mib", line.get("peak_rss_mib"))
    return {
        "runner": "plain-loop",
        "phase": phase.name,
        "model": phase.model,
        "real_shape": context["real_shape"],
        "batching": "pad",  # full rows, no padding
        "pack_length": None,
        "micro_batch": line.get("micro_batch"),
        "seq_len": line.get("seq_len"),
        "zero": None,
        "checkpointing": False,
        "method": "full",
        "real_tokens_per_s": line.get("tokens_per_s"),
        "mfu": mfu,
        "peak_mib": peak,
        "peak_allocated_mib": line.get("peak_allocated_mib"),
        "planned_mib": None,
        "data_wait_frac": None,  # the batch is made on the device once: no data loading
        "status": line.get("status"),
        "note": line.get("error", ""),
        **context["stamp"],
    }


def plain_step_flops(config_path: Path, rows: int, length: int, images: int) -> float:
    """Model FLOPs of one plain-loop step (launcher.model.flops, every part training), on a meta model."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from launcher.model.flops import FlopModel, ImageRows

    config = AutoConfig.from_pretrained(str(config_path.parent))
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    counts = FlopModel.of(model)
    vision = config.vision_config
    patches = (448 // int(vision.patch_size)) ** 2
    image = ImageRows(patches, patches // int(vision.spatial_merge_size) ** 2, patches)
    return counts.step_flops([length] * rows, [image] * images)


def tune_row(result: dict[str, Any], phase: Phase, context: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One tuner candidate (results.json) as a row: exactly its figures, plus its run's data-wait share."""
    candidate = result["candidate"]
    peak, planned = result.get("peak"), result.get("planned")
    # What its run's summary says ran (the layers liger patched, where the loss went), else what the phase asked.
    ran = ran_kernels(result.get("run_dir"))
    return {
        "runner": "launcher",
        "phase": phase.name,
        "model": phase.model,
        "real_shape": context["real_shape"],
        "batching": candidate.get("batching") or "pad",
        "pack_length": candidate.get("pack_length"),
        "micro_batch": candidate["micro"],
        "seq_len": None,
        "zero": ZERO_STAGE.get(candidate["preset"]),
        "preset": candidate["preset"],
        "checkpointing": bool(candidate["checkpointing"]),
        "method": phase.method,
        "kernels": ran.split(" ", 1)[0] if ran else ("liger" if LIGER in phase.overrides else "torch"),
        "kernels_ran": ran,
        "compile": "model.compile=true" in phase.overrides,
        "real_tokens_per_s": result.get("tokens_per_s"),
        "mfu": result.get("mfu"),
        "peak_mib": None if peak is None else peak / MiB,
        "peak_allocated_mib": None,
        "planned_mib": None if planned is None else planned / MiB,
        "data_wait_frac": data_wait(result.get("run_dir"), warmup),
        "status": result["status"],
        "note": result.get("note", ""),
        "candidate": result["name"],
        **context["stamp"],
    }


def ran_kernels(run_dir: str | None) -> str | None:
    """model.kernels as a candidate run's summary.json records it (None: no summary, or none recorded)."""
    from launcher.core.rundir import RunDir

    summary = RunDir(Path(run_dir)).read_summary() if run_dir else None
    return None if summary is None else summary.kernels


def data_wait(run_dir: str | None, warmup: int) -> float | None:
    """The measured steps' share of time spent waiting for data (perf/data_wait_frac, time-weighted)."""
    if not run_dir or not (Path(run_dir) / "metrics.jsonl").is_file():
        return None
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    measured = [r for r in rows if int(r.get("step", 0)) > warmup and r.get("perf/data_wait_frac") is not None]
    seconds = sum(float(r.get("perf/step_time_s") or 0) for r in measured)
    if not measured or not seconds:
        return None
    return sum(float(r["perf/data_wait_frac"]) * float(r["perf/step_time_s"] or 0) for r in measured) / seconds


def table(rows: list[dict[str, Any]]) -> str:
    """gpu.md: every row, with its real tokens/s as a ratio to the plain loop's best row of the run."""
    best = max((r["real_tokens_per_s"] for r in rows if r["runner"] == "plain-loop" and r["real_tokens_per_s"]),
               default=None)  # fmt: skip
    head = ["runner", "phase", "model", "batching", "micro", "ZeRO", "ckpt", "method", "real tokens/s", "x plain best",
            "MFU", "peak MiB", "planned MiB", "data wait", "status"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def number(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        tokens = r["real_tokens_per_s"]
        batching = r["batching"] + (f" {r['pack_length']}" if r["pack_length"] else "")
        batching += f" x {r['seq_len']}" if r["seq_len"] else ""
        cells = [r["runner"], r["phase"], r["model"], batching, number(r["micro_batch"], "d"), number(r["zero"], "d"),
                 "yes" if r["checkpointing"] else "no", r["method"], number(tokens, ",.0f"),
                 number(tokens / best if tokens and best else None, ".2f"), number(r["mfu"], ".1%"),
                 number(r["peak_mib"], ",.0f"), number(r["planned_mib"], ",.0f"), number(r["data_wait_frac"], ".1%"),
                 r["status"] + (f": {r['note'][:80]}" if r["note"] else "")]  # fmt: skip
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


# ================================================================================ the run
@dataclass
class Run:
    out: Path
    work: Path
    deadline: float
    env: dict[str, str]
    context: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        with (self.out / "run.log").open("a") as log:
            log.write(stamped + "\n")

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        write_atomic(self.out / "gpu.json", json.dumps(self.rows, indent=1) + "\n")
        write_atomic(self.out / "gpu.md", self.context["header"] + "\n" + table(self.rows))
        name = row.get("candidate", row.get("seq_len"))
        tokens, peak = row["real_tokens_per_s"] or 0, row["peak_mib"] or 0
        self.log(f"row: {row['phase']} {name}: {row['status']}, {tokens:,.0f} real tokens/s, peak {peak:,.0f} MiB")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run_until(run: Run, command: list[str], log: Path, limit_s: float, poll: Any = None) -> int | None:
    """Run a command in its own process group until it ends (its exit code) or `limit_s` passes (None: it
    was stopped: SIGTERM to its group, SIGKILL after a grace). `poll()` runs every 2 s meanwhile. A command that
    fails or is stopped leaves the last lines of its log in run.log: its log stays on the machine, only OUT
    comes back."""
    start = log.stat().st_size if log.is_file() else 0  # what an earlier call on a warm machine wrote there
    with log.open("a") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=run.env, cwd=ROOT,
                                   start_new_session=True)  # fmt: skip
        ends = time.time() + limit_s
        try:
            while process.poll() is None and time.time() < ends:
                time.sleep(2)
                if poll is not None:
                    poll()
        finally:  # the limit, or a stop signal (KeyboardInterrupt): nothing is left running on the device
            stopped = process.poll() is None
            if stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if poll is not None:
        poll()  # the rows it finished meanwhile
    if stopped or process.returncode != 0:
        with log.open("rb") as written:
            written.seek(start)
            tail = written.read().decode(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        run.log(f"the last {len(tail)} lines of {log.name}:\n" + "\n".join(f"  | {line}" for line in tail))
    return None if stopped else process.returncode


def run_plain(run: Run, phase: Phase, cpu: bool) -> None:
    out = run.work / "plain.jsonl"
    out.unlink(missing_ok=True)
    done: set[int] = set()
    peak = peak_flops(cpu)

    def poll() -> None:
        if not out.is_file():
            return
        for index, line in enumerate(out.read_text().splitlines()):
            if index not in done and line.strip():
                done.add(index)
                run.add(plain_row(json.loads(line), phase, run.context, peak))

    command = [sys.executable, "bench/plain_loop.py", "--config", str(phase.config), "--out", str(out),
               "--shapes", *phase.shapes]  # fmt: skip
    if cpu:
        command += ["--device", "cpu", "--dtype", "fp32", "--warmup", "1", "--steps", "2"]
    code = run_until(run, command, run.work / "plain.log", run.left(), poll)
    run.log(f"plain loop: {'stopped at the time limit' if code is None else f'exit {code}'}")


def run_tuner(run: Run, phase: Phase, data_overrides: list[str]) -> None:
    directory = run.work / f"tune_{phase.name}"
    results = directory / "results.json"
    done: set[str] = set()
    warmup = next((int(o.split("=")[1]) for o in phase.overrides if o.startswith("tune.warmup_steps=")), 1)

    def poll() -> None:
        if not results.is_file():
            return
        with contextlib.suppress(ValueError, OSError):
            for result in json.loads(results.read_text()):
                if result["status"] != "not run" and result["name"] not in done:
                    done.add(result["name"])
                    run.add(tune_row(result, phase, run.context, warmup))

    command = [sys.executable, "-m", "launcher.tune", *phase.overrides, *data_overrides, f"tune.dir={directory}",
               "tune.candidate_timeout_s=240", "logger=none"]  # fmt: skip
    fresh_folder(directory)
    code = run_until(run, command, run.work / f"tune_{phase.name}.log", run.left(), poll)
    run.log(f"{phase.name}: launcher.tune {'stopped at the time limit' if code is None else f'exit {code}'}")


def fresh_folder(directory: Path) -> None:
    """An earlier call's tuning out of the way: a warm machine keeps the work folder between calls, and the
    tuner refused its folder ("already holds a tuning") while its results.json gave this call's rows."""
    shutil.rmtree(directory, ignore_errors=True)


SPACE_KEYS = ("tune.presets=", "tune.micro_batch_sizes=", "tune.gradient_checkpointing=", "tune.batching=",
              "tune.pack_lengths=")  # fmt: skip


def profile_overrides(row: dict[str, Any], phase: Phase) -> list[str]:
    """The tuner space of one row alone (its phase's model, data and batch), its step 3 profiled."""
    kept = [override for override in phase.overrides if not override.startswith(SPACE_KEYS)]
    checkpointing = "true" if row["checkpointing"] else "false"
    batching = f"tune.batching=[{row['batching']}]"
    chosen = [f"tune.presets=[{row['preset']}]", f"tune.micro_batch_sizes=[{row['micro_batch']}]",
              f"tune.gradient_checkpointing=[{checkpointing}]", batching]  # fmt: skip
    if row["pack_length"]:
        chosen.append(f"tune.pack_lengths=[{row['pack_length']}]")
    return [*kept, *chosen, "train.profile_steps=[3,3]", "tune.warmup_steps=1", "tune.measure_steps=3"]


def run_profile(run: Run, phases: dict[str, Phase], records: int) -> None:
    """torch.profiler's table (launcher.train.profile) of the fastest launcher row so far, as OUT/profile.md:
    one more tuner run of that candidate alone, with train.profile_steps (its row is not kept: the profiled
    step is slower)."""
    measured = [r for r in run.rows if r["runner"] == "launcher" and r["status"] == "fits" and r["real_tokens_per_s"]]
    if not measured:
        run.log("profile: skipped, no launcher row was measured")
        return
    best = max(measured, key=lambda r: r["real_tokens_per_s"])
    phase = phases[best["phase"]]
    directory = run.work / "tune_profile"
    command = [sys.executable, "-m", "launcher.tune", *profile_overrides(best, phase),
               *write_data(run.work / "data", phase.data, records), f"tune.dir={directory}",
               "tune.candidate_timeout_s=240", "logger=none"]  # fmt: skip
    fresh_folder(directory)
    code = run_until(run, command, run.work / "tune_profile.log", run.left())
    tables = sorted(directory.glob("runs/*/profile.md"))
    if tables:
        text = f"{run.context['header']}\nThe fastest launcher row: {best['candidate']} ({best['phase']})\n\n"
        write_atomic(run.out / "profile.md", text + tables[0].read_text())
    run.log(f"profile of {best['candidate']}: {'written to profile.md' if tables else 'none written'}, exit {code}")


def plan_phases(run: Run, phases: list[Phase], records: int, memory_gb: float, extra: list[str]) -> int:
    """--plan: each tuner phase's candidates as the tuner plans them for a GPU of `memory_gb` GiB, nothing trained:
    at data.max_length (the tuner without a data cache) and from the records of the data cache it builds first
    (launcher.tune.tuner._prepared_shapes), side by side, as OUT/plan.md. `extra`: overrides after each phase's."""
    os.environ.update(run.env)  # the cache folder and offline settings the tuner's children would get
    from launcher.config.compose import compose
    from launcher.config.schema import typed
    from launcher.tune import tuner
    from launcher.tune.decide import prune_reason

    head = "| phase | candidate | planned MiB at data.max_length | planned MiB from the records |"
    lines = [f"{head} on {memory_gb:g} GiB |", "|---|---|---:|---:|---|"]
    notes: list[str] = []
    for phase in phases:
        if phase.shapes or not phase.overrides:  # the plain loop and the profile: nothing the tuner plans
            continue
        started = time.time()
        overrides = [*phase.overrides, *write_data(run.work / "data", phase.data, records),
                     f"plan.gpu_memory_gb={memory_gb:g}", f"tune.memory_gb={memory_gb:g}",
                     f"tune.dir={run.work / 'plan' / phase.name}", "logger=none", *extra]  # fmt: skip
        cfg = typed(compose(overrides))
        shapes = tuner._prepared_shapes(cfg, run.log)
        at_limit = tuner._tuning(cfg, overrides)
        from_records = tuner._tuning(cfg, overrides, lambda shapes=shapes: shapes)
        for limit, records_plan in zip(at_limit.results, from_records.results, strict=True):
            why = prune_reason(records_plan.candidate, records_plan.planned, [], from_records.budget, 0.1)
            figures = [f"{r.planned / MiB:,.0f}" if r.planned else r.note for r in (limit, records_plan)]
            lines.append(f"| {phase.name} | {limit.name} | {' | '.join(figures)} | {'pruned' if why else 'runs'} |")
        packed = next((o.split("=[")[1].strip("]") for o in overrides if o.startswith("tune.pack_lengths=[")), None)
        if shapes is not None and packed is not None:  # the first epoch's rows, as the packed candidates train
            notes.append(packed_rows_line(phase.name, shapes, int(packed), cfg))
        run.log(f"{phase.name}: planned in {time.time() - started:.0f} s")
        write_atomic(run.out / "plan.md", "\n".join([*lines, *([""] if notes else []), *notes]) + "\n")
    return 0


def packed_rows_line(name: str, shapes: Any, budget: int, cfg: Any) -> str:
    """The first epoch's packed rows of a phase's records: how full, how many images a row holds."""
    import numpy as np

    from launcher.data.packing import pack_rows

    most = cfg.data.pack_max_images
    rows = pack_rows(shapes.lengths, budget, seed=int(cfg.train.seed), epoch=0, images=shapes.images, max_images=most)
    images = np.array([shapes.images[row].sum() for row in rows])
    fill = shapes.lengths.sum() / (len(rows) * budget)
    return (
        f"- {name}: {len(rows)} rows of {budget:,} tokens (data.pack_max_images={most}), {fill:.1%} of them records; "
        f"images a row {images.mean():.1f} on average, {int(images.max())} at most"
    )


def peak_flops(cpu: bool) -> float | None:
    """The device's peak, as the launcher's MFU counts it (launcher.train.peak)."""
    import torch

    from launcher.train.peak import device_peak

    dtype = torch.float32 if cpu else torch.bfloat16
    device = torch.device("cpu" if cpu else "cuda")
    return device_peak(device, dtype).flops


def install_wheels(env: dict[str, str]) -> str:
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return "no carried wheels: this interpreter's packages"
    site = Path("/tmp/gpu_run_site")
    done = subprocess.run(["bash", "bench/device_install.sh", str(site)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"gpu_run: the install of {len(wheels)} carried wheels failed: {done.stderr[-500:]}")
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    sys.path[:0] = [str(site), str(ROOT)]
    return f"{len(wheels)} carried wheels installed into {site}"


def device_name(cpu: bool) -> str:
    if cpu:
        import platform

        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() or "CUDA device (nvidia-smi gave nothing)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: shrunk configs, fp32, on this CPU")
    parser.add_argument("--budget-s", type=float, default=540, help="the whole run's time, from its start")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="data and tuner directories (default: "
                        "outputs/bench/gpu_run/work, work-cpu in CPU mode)")  # fmt: skip
    parser.add_argument("--phases", nargs="+", default=None, help="run only these phases (in their order)")
    parser.add_argument("--records", type=int, default=None, help="records per data set (default 2,000; CPU 24)")
    parser.add_argument("--commit", default=None, help="the commit the rows name (default: git rev-parse HEAD)")
    parser.add_argument("--plan", type=float, default=None, metavar="GIB", help="train nothing: plan each tuner "
                        "phase's candidates for a GPU of GIB, at data.max_length and from the records, as "
                        "OUT/plan.md; the tuner's budget there is the memory less plan.headroom (10%%): about 126 on "
                        "an H200 (139.8 GiB), 71 on an H100")  # fmt: skip
    parser.add_argument("--plan-override", action="append", default=[], metavar="KEY=VALUE",
                        help="with --plan: one train.py override more for each phase planned (repeatable)")  # fmt: skip
    args = parser.parse_args()
    started = time.time()
    stamp_dir = time.strftime("%Y%m%d-%H%M%S")
    out = args.out_dir or Path(os.environ.get("OUT") or ROOT / "outputs" / "bench" / "gpu_run" / stamp_dir)
    work = args.work_dir or ROOT / "outputs" / "bench" / "gpu_run" / ("work-cpu" if args.cpu else "work")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    # Unbuffered: a child stopped at the time limit has its last lines in its log.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_SKIP_CUDA_CHECK": "1", "WANDB_MODE": "disabled",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    env.setdefault("VLM_LAUNCHER_CACHE", str(work / "cache"))
    planning = args.plan is not None
    installed = "this interpreter's packages" if args.cpu or planning else install_wheels(env)
    commit = args.commit or _git_commit()
    context = {
        "real_shape": not args.cpu,
        "stamp": {
            "device": device_name(args.cpu or planning),
            "commit": commit,
            "date": datetime.date.today().isoformat(),
        },
    }
    context["header"] = (
        f"# GPU run ({'CPU rehearsal: figures mean nothing' if args.cpu else 'real shapes'})\n\n"
        f"device {context['stamp']['device']}; commit {commit}; {context['stamp']['date']}; {installed}\n"
    )
    run = Run(out, work, started + args.budget_s, env, context)
    (out / "run.log").unlink(missing_ok=True)
    run.log(context["header"].strip().replace("\n\n", ": "))
    for name in ("gpu.json", "gpu.md"):
        (out / name).unlink(missing_ok=True)

    if args.cpu:
        small = {
            "qwen2_vl": shrunk_config(QWEN2_VL_2B, work / "small" / "qwen2_vl"),
            "qwen2_5_vl": shrunk_config(QWEN2_5_VL_7B, work / "small" / "qwen2_5_vl"),
        }
        phases, records = cpu_phases(small), args.records or 24
    else:
        phases, records = gpu_phases(), args.records or 2000
    if args.phases:
        unknown = sorted(set(args.phases) - {p.name for p in phases})
        if unknown:
            raise SystemExit(f"gpu_run: no phase {unknown}; the phases: {[p.name for p in phases]}")
        phases = [p for p in phases if p.name in args.phases]
    else:
        phases = [p for p in phases if p.name not in ASKED_ONLY]

    if args.plan is not None:
        return plan_phases(run, phases, records, args.plan, args.plan_override)

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    try:
        for phase in phases:
            if run.left() < phase.needs_s:
                run.log(f"{phase.name}: skipped, {run.left():.0f} s left of the budget, it needs {phase.needs_s:.0f}")
                continue
            run.log(f"{phase.name}: starting, {run.left():.0f} s left")
            if phase.shapes:
                run_plain(run, phase, args.cpu)
            elif phase.name == "profile":
                run_profile(run, {p.name: p for p in phases}, records)
            else:
                run_tuner(run, phase, write_data(work / "data", phase.data, records))
    except KeyboardInterrupt as stopped:
        run.log(f"stopped by {stopped or 'SIGINT'}: the rows so far are in {out / 'gpu.json'}")
        return 130
    ok = [r for r in run.rows if r["status"] in ("ok", "fits")]
    run.log(f"done in {time.time() - started:.0f} s: {len(run.rows)} rows ({len(ok)} measured) in {out / 'gpu.json'}")
    return 0


def _git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
