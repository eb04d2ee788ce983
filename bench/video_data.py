"""What videos cost the data path: reading (each video's header checked into the record index), decoding the
sampled frames and running the image processor on them (what a DataLoader worker does per record and step),
and the data cache (bytes per record against the source file's, its build time per record).

    python bench/video_data.py                      # 1,000 and 10,000 clips of 32 px, 200 of 224 px
    python bench/video_data.py --small 1000 --large 100
    python bench/video_data.py --wait               # the data-wait share of training with 0, 2, 4 workers
    python bench/video_data.py --startup 1000 10000 # a new job's start-up on that many video records
    python bench/video_data.py --learn tiny_qwen2_vl tiny_llava --seeds 0 1 2   # the motion task learned?
    python bench/video_data.py --threads            # decoding with FFmpeg's threads off against PyAV's defaults

Clips: the built-in motion task's (32 x 32, 8 frames, 2 s; 4 frames sampled at data.video's default 2 per
second) and larger ones (224 x 224, 64 frames at 8 per second, 8 s; 16 frames sampled). The processor is the
tiny LLaVA's (CLIP, 32 px) for the first and a LLaVA-1.5-shaped one (CLIP at 336 px, 576 tokens a frame) for
the second. Prints one table; each figure is this process's CPU seconds and the wall time beside it.

--wait trains the built-in motion task (`python train.py data.task=motion`, the tiny LLaVA, micro batch 32,
its videos decoded from the data cache's files each step) with data.num_workers 0, 2 and 4, and the image
question (`data.task=shape`, its images cached as pixels) with 0 for comparison: the share of each step spent
waiting for the batch (perf/data_wait_frac, median over the steps after the first 10), the step's wall time
and the run's summary samples/s. The tiny model's step is short, so the wait shows as it would beside the
fastest model step. (bench/data_wait.py: the same share for 336 px images.)

--startup N...: a first `python train.py` of one step on N records of 32 px clips (data=llava_json, the tiny
LLaVA, an empty cache): the seconds from the command to its end; the launcher's before the rank starts
(imports, the record index with each video's header checked, the tiny model's build and the checks); the
rank's data cache build and the rest of the rank (summary.json: imports, DeepSpeed, the step).

--learn ARCH... --seeds S...: the plain `python train.py data.task=motion model=ARCH train.seed=S` (1,000 steps,
an evaluation every 250), each in a cache of its own: its held-out exact match at each evaluation, and its
wall time from the command to its end (the tiny model's build and the data's generation and cache included).

--threads: one clip of each size decoded as a worker decodes it (launcher.data.video.decode_clip: one open,
the sampled frames scaled to RGB, FFmpeg's threads off) and the same with PyAV's defaults (a thread pool per
core for the decoder and for the scaler): CPU and wall ms per clip, the median of 5 rounds of 20 (range beside).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import ROOT, bench_env, print_markdown_table, read_metrics, run_train_py

from launcher.data.cache import RecordEncoder, ensure_cache
from launcher.data.formats import ReadOptions, read_records
from launcher.data.records import ConversationDataset
from launcher.data.shapes import MOTION_FPS, _draw_motion
from launcher.data.video import VideoSampling, _facts, _open, decode_clip, sample_frames, write_video
from launcher.model.tiny import build_tiny_model_dir

WORDS = ["which way does the shape move?", "left", "right", "up", "down"]


def clips(root: Path, count: int, size: int, frames: int, fps: int) -> Path:
    """`count` records, each its own clip (a shape moving on noise), in a JSON lines file."""
    rng = np.random.default_rng(0)
    (root / "clips").mkdir(parents=True)
    rows = []
    for index in range(count):
        direction = WORDS[1 + index % 4]
        drawn = _draw_motion(rng, "red", "square", size, direction)
        moving = [drawn[min(len(drawn) - 1, step * len(drawn) // frames)] for step in range(frames)]
        write_video(root / "clips" / f"{index:05d}.mp4", moving, fps=fps, codec="mpeg4")
        messages = [{"role": "user", "content": f"<video>{WORDS[0]}"}, {"role": "assistant", "content": direction}]
        rows.append({"videos": [f"clips/{index:05d}.mp4"], "messages": messages})
    path = root / "data.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def timed(work) -> tuple[float, float, object]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = work()
    return time.process_time() - cpu, time.perf_counter() - wall, result


def measure(name: str, root: Path, count: int, size: int, frames: int, fps: int, processor) -> dict:
    data = clips(root, count, size, frames, fps)
    source_bytes = sum(path.stat().st_size for path in (root / "clips").iterdir()) / count
    sampling = VideoSampling(max_pixels=None)
    read_cpu, read_wall, (records, _, _) = timed(lambda: read_records(data, ReadOptions(video=sampling)))
    dataset = ConversationDataset(records, sampling)
    few = min(count, 200)
    decode_cpu, decode_wall, samples = timed(lambda: [dataset[index] for index in range(few)])
    sampled = len(samples[0]["images"])
    process_cpu, process_wall, _ = timed(
        lambda: [processor.image_processor(sample["images"], return_tensors="pt") for sample in samples]
    )
    encode = RecordEncoder(processor, None, "encoded", sampling)
    build_cpu, build_wall, info = timed(
        lambda: ensure_cache(
            root / "cache", records, processor, "bench", encode, dataset.__getitem__, on_bad_record="error",
            num_workers=0,
        )
    )  # fmt: skip
    return {
        "clips": name,
        "records": count,
        "frames sampled": sampled,
        "read (ms/record)": f"{1000 * read_cpu / count:.2f} ({1000 * read_wall / count:.2f})",
        "decode (ms/record)": f"{1000 * decode_cpu / few:.2f} ({1000 * decode_wall / few:.2f})",
        "decode (ms/frame)": f"{1000 * decode_cpu / few / sampled:.2f}",
        "process (ms/record)": f"{1000 * process_cpu / few:.2f} ({1000 * process_wall / few:.2f})",
        "cache build (ms/record)": f"{1000 * build_cpu / count:.2f} ({1000 * build_wall / count:.2f})",
        "cache bytes/record": round(info.bytes / count),
        "source bytes/record": round(source_bytes),
    }


WAIT_STEPS, WAIT_SKIP = 60, 10


def data_wait(root: Path) -> list[dict]:
    """The data-wait share of `python train.py` steps on the motion task with 0, 2, 4 workers, and on the image
    question with 0."""
    rows = []
    for task, workers in (("shape", 0), ("motion", 0), ("motion", 2), ("motion", 4)):
        ran = run_train_py(
            root / f"{task}-w{workers}", WAIT_STEPS, [f"data.task={task}", f"data.num_workers={workers}"],
            env=bench_env(),
        )  # fmt: skip
        waits = [m["perf/data_wait_frac"] for m in read_metrics(root / f"{task}-w{workers}")][WAIT_SKIP:]
        rows.append({
            "task": task,
            "workers": workers,
            "data wait (median)": f"{np.median(waits):.1%}",
            "data wait (max)": f"{max(waits):.1%}",
            "step s (median)": f"{np.median(ran['step_times'][WAIT_SKIP:]):.3f}",
            "samples/s": f"{ran['summary']['samples_per_sec']:.0f}",
        })  # fmt: skip
    return rows


def startup(root: Path, count: int) -> dict:
    """A new job's first start on `count` video records: one step, nothing cached."""
    data = clips(root, count, 32, 8, MOTION_FPS)
    env = {**bench_env(), "VLM_LAUNCHER_CACHE": str(root / "cache")}
    wall = time.perf_counter()
    summary = run_train_py(root / "run", 1, ["data=llava_json", f"data.path={data}"], env=env)["summary"]
    wall = time.perf_counter() - wall
    cache, rank = summary["data_cache"]["build_s"], summary["wall_s"]  # the rank's wall time holds the build
    return {
        "video records": f"{count:,}",
        "first job, 1 step (s)": f"{wall:.1f}",
        "launcher, before the rank (s)": f"{wall - rank:.1f}",
        "rank: data cache build (s)": f"{cache:.1f}",
        "rank: the rest (s)": f"{rank - cache:.1f}",
    }


def learn(root: Path, arch: str, seed: int) -> dict:
    """One plain run of the built-in motion task: held-out exact match at each evaluation."""
    run_dir = root / f"{arch}-{seed}"
    env = {**bench_env(), "VLM_LAUNCHER_CACHE": str(root / f"cache-{arch}-{seed}")}
    command = [sys.executable, "train.py", "data.task=motion", f"model={arch}", f"train.seed={seed}", "logger=none",
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    wall = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=3600)
    wall = time.perf_counter() - wall
    evals = [m for m in read_metrics(run_dir) if "eval/accuracy" in m]
    return {
        "model": arch,
        "seed": seed,
        "held-out exact match at steps " + ", ".join(str(m["step"]) for m in evals): " / ".join(
            f"{m['eval/accuracy']:.3f}" for m in evals
        ),
        "wall (s)": f"{wall:.0f}",
    }


def decode_threads(root: Path, rounds: int = 5, clips_per_round: int = 20) -> list[dict]:
    """decode_clip (FFmpeg's threads off) against the same decode with PyAV's default threads, per clip."""
    rng = np.random.default_rng(0)

    def with_defaults(path: str, sampling: VideoSampling) -> None:  # decode_clip as it was: one open, no threads=1
        with _open(path) as container:
            wanted = set(sample_frames(_facts(container, path, count=False), sampling))
            for index, frame in enumerate(container.decode(container.streams.video[0])):
                if index in wanted:
                    frame.to_image()
                if index >= max(wanted):
                    break

    rows = []
    for name, side, count, sampled in (("32 px, 8 frames", 32, 8, 4), ("224 px, 64 frames", 224, 64, 16)):
        noise = [np.clip(rng.normal(128, 40, (side, side, 3)), 0, 255).astype(np.uint8) for _ in range(count)]
        path = str(write_video(root / f"{side}.mp4", noise, fps=8, codec="mpeg4"))
        sampling = VideoSampling(min_frames=sampled, max_frames=sampled)
        for how, decode in (("PyAV's defaults", with_defaults), ("decode_clip (threads off)", decode_clip)):
            decode(path, sampling)  # warm
            cpus, walls = [], []
            for _ in range(rounds):
                cpu, wall, _ = timed(lambda d=decode, p=path, s=sampling: [d(p, s) for _ in range(clips_per_round)])
                cpus.append(1e3 * cpu / clips_per_round)
                walls.append(1e3 * wall / clips_per_round)
            cpus.sort()
            walls.sort()
            rows.append({"clip": name, "frames sampled": sampled, "decoding": how,
                         "CPU ms/clip": f"{cpus[rounds // 2]:.2f} ({cpus[0]:.2f}-{cpus[-1]:.2f})",
                         "wall ms/clip": f"{walls[rounds // 2]:.2f} ({walls[0]:.2f}-{walls[-1]:.2f})"})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", type=int, nargs="+", default=[1000, 10000], help="32 px clips per run")
    parser.add_argument("--large", type=int, default=200, help="224 px clips")
    parser.add_argument("--wait", action="store_true", help="the data-wait share in training, 0/2/4 workers")
    parser.add_argument("--startup", type=int, nargs="+", help="a first job's start-up on this many video records")
    parser.add_argument("--learn", nargs="+", help="train the motion task on these tiny models (--seeds)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", action="store_true", help="decoding with FFmpeg's threads off and on")
    args = parser.parse_args()
    if args.threads:
        with tempfile.TemporaryDirectory() as tmp:
            print_markdown_table(decode_threads(Path(tmp)))
        return
    if args.learn:
        with tempfile.TemporaryDirectory() as tmp:
            rows = []
            for arch in args.learn:
                for seed in args.seeds:
                    rows.append(learn(Path(tmp), arch, seed))
                    print(rows[-1], flush=True)
            print_markdown_table(rows)
        return
    if args.startup:
        with tempfile.TemporaryDirectory() as tmp:
            print_markdown_table([startup(Path(tmp) / str(count), count) for count in args.startup])
        return
    if args.wait:
        with tempfile.TemporaryDirectory() as tmp:
            print_markdown_table(data_wait(Path(tmp)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = dict(hidden_size=64, num_layers=1, vision_hidden_size=32, vision_layers=1)
        small = build_tiny_model_dir("tiny_llava", root / "small", WORDS, seed=0, image_size=32, patch_size=8, **tiny)
        large = build_tiny_model_dir("tiny_llava", root / "large", WORDS, seed=0, image_size=336, patch_size=14, **tiny)
        from transformers import AutoProcessor

        small_processor, large_processor = AutoProcessor.from_pretrained(small), AutoProcessor.from_pretrained(large)
        rows = [
            measure("32 px, 8 frames", root / f"small{count}", count, 32, 8, MOTION_FPS, small_processor)
            for count in args.small
        ]
        if args.large:
            rows.append(measure("224 px, 64 frames", root / "large", args.large, 224, 64, 8, large_processor))
    print_markdown_table(rows)


if __name__ == "__main__":
    main()
