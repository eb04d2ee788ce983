"""The built-in data set: coloured shapes on noisy backgrounds, and a question about each.

Generated once per (seed, sizes, task) into cache_dir/data as ordinary LLaVA-format records and PNGs (or,
for the motion task, short videos), so it goes through the same reader as a user's data
(launcher.data.records).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from launcher.config.schema import DataConfig
from launcher.core.builds import build_once
from launcher.core.errors import LauncherError
from launcher.data.formats import IMAGE_PLACEHOLDER
from launcher.data.video import VIDEO_PLACEHOLDER, write_video

QUESTION = "what is in the image?"


COLOUR_QUESTION = "what colour is the shape?"


MOTION_QUESTION = "which way does the shape move?"


# The built-in set's tasks (data.task): the question each asks, and its answer from (colour, shape). The
# motion task asks about videos instead (`_draw_motion_split`): its answer is the direction.
TASKS = {
    "shape": (QUESTION, lambda colour, shape: f"{colour} {shape}"),
    "colour": (COLOUR_QUESTION, lambda colour, shape: colour),
    "motion": (MOTION_QUESTION, None),
}

# The motion task's clips: a shape crossing the frame in one of four directions, MOTION_FRAMES frames at
# MOTION_FPS (2 s).
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
MOTION_FRAMES, MOTION_FPS = 8, 4
MOTION_EXTENT = (0.25, 0.35)  # the shape's side as a fraction of the frame's
# MPEG-4 part 2 in mp4: 3.2 ms to write a 32 x 32 clip of 8 frames here, against H.264's 8.9 ms.
MOTION_CODEC = "mpeg4"


COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (225, 205, 30),
    "purple": (140, 60, 180),
    "orange": (245, 140, 30),
}


SHAPES = ("circle", "square", "triangle")


_SHAPES_VERSION = 1  # bump when the drawing changes, so cached sets are regenerated


# A shape's side as a fraction of the image side (min, max). At 32 px, shapes of 11-22 px left the tiny
# models guessing circle vs square for long (0.6 exact match after 1500 steps); 16-29 px is learned
# to >0.95 in 1000 steps of 32 (bench/learnability.py).
SHAPE_EXTENT = (0.5, 0.9)


_SHAPES_MARKER = "shapes.json"


def prepare_data(data: DataConfig, cache: Path) -> tuple[Path, Path, Path]:
    """The built-in set's train file, eval file and image root, generated first when not cached."""
    task, pairs = str(data.task), bool(data.pairs)
    kind = f"{task}_pairs" if pairs else task
    name = f"{data.name}_{kind}_seed{data.seed}_n{data.n_train}_{data.n_eval}_px{data.image_size}"
    train_file, eval_file, image_root = generate_shapes(
        cache / "data" / name, seed=data.seed, n_train=data.n_train, n_eval=data.n_eval,
        image_size=data.image_size, task=task, pairs=pairs,
    )  # fmt: skip
    return Path(train_file), Path(eval_file), Path(image_root)


def generate_shapes(
    out_dir: Path, *, seed: int, n_train: int, n_eval: int, image_size: int, task: str = "shape", pairs: bool = False
) -> tuple[Path, Path, Path]:
    """Write a deterministic coloured-shapes question set; return (train json, eval json, image root).

    Each image holds one shape (6 colours x 3 shapes) at a random position and size (SHAPE_EXTENT) on a
    lightly noisy background, with jittered colours. `task` picks the question: "shape" asks what is in
    the image (18 answers such as "red circle"), "colour" asks the shape's colour (6 answers such as
    "red"); the images are the same for the same seed whatever the task. Classes are balanced; the eval
    split holds images that do not occur in the train split. The files are ordinary LLaVA-format records
    + PNGs, so they go through the same loader as user data. `pairs`: preference records instead, in
    LLaMA-Factory's format (the same images and questions; the right answer chosen, a wrong one
    rejected). A complete, intact set for the same arguments is reused; a new one is written to a
    temporary directory and renamed into place (launcher.core.builds).
    """
    if task not in TASKS:
        raise LauncherError(f"data.task={task} is not a task of the built-in set: choose one of {', '.join(TASKS)}")
    out_dir = Path(out_dir)
    arguments = {
        "version": _SHAPES_VERSION,
        "task": task,
        "seed": seed,
        "n_train": n_train,
        "n_eval": n_eval,
        "image_size": image_size,
        "extent": list(SHAPE_EXTENT),
        **({"pairs": True} if pairs else {}),
    }

    if task == "motion" and pairs:
        raise LauncherError(
            "data.task=motion with a preference loss: the built-in preference pairs ask about images; "
            "train the motion task with loss=sft"
        )
    draw = _draw_motion_split if task == "motion" else _draw_split

    def write(where: Path) -> None:
        seen: set[str] = set()
        for split, count, stream in (("train", n_train, 0), ("eval", n_eval, 1)):
            records = draw(
                where, split, count, np.random.default_rng([seed, stream]), image_size, task, seen, pairs=pairs
            )
            (where / f"{split}.json").write_text(json.dumps(records, indent=1) + "\n")

    build_once(out_dir, arguments, _SHAPES_MARKER, write)
    return out_dir / "train.json", out_dir / "eval.json", out_dir / "images"


def _draw_split(
    out_dir: Path,
    split: str,
    count: int,
    rng: np.random.Generator,
    image_size: int,
    task: str,
    seen: set[str],
    *,
    pairs: bool = False,
) -> list[dict[str, Any]]:
    """`count` images of one split (PNGs under out_dir/images/SPLIT, none drawn before) and their records,
    the classes balanced."""
    question, answer = TASKS[task]
    (out_dir / "images" / split).mkdir(parents=True)
    records = []
    labels = [(c, s) for c in COLOURS for s in SHAPES]
    order = [labels[i % len(labels)] for i in rng.permutation(count)]
    for index, (colour, shape) in enumerate(order):
        pixels = _draw_unseen(rng, colour, shape, image_size, seen)
        name = f"{split}/{index:05d}.png"
        Image.fromarray(pixels).save(out_dir / "images" / name)
        if pairs:
            records.append(_pair(f"{split}-{index:05d}", name, question, answer, colour, shape, index))
            continue
        records.append(
            {
                "id": f"{split}-{index:05d}",
                "image": name,
                "conversations": [
                    {"from": "human", "value": f"{IMAGE_PLACEHOLDER}\n{question}"},
                    {"from": "gpt", "value": answer(colour, shape)},
                ],
            }
        )
    return records


def _draw_motion_split(
    out_dir: Path,
    split: str,
    count: int,
    rng: np.random.Generator,
    image_size: int,
    task: str,
    seen: set[str],
    *,
    pairs: bool = False,
) -> list[dict[str, Any]]:
    """`count` clips of one split (mp4 under out_dir/images/SPLIT, the set's media root; none drawn before)
    and their records, the directions balanced."""
    (out_dir / "images" / split).mkdir(parents=True)
    directions = list(DIRECTIONS)
    order = [directions[i % len(directions)] for i in rng.permutation(count)]
    records = []
    for index, direction in enumerate(order):
        colour, shape = list(COLOURS)[rng.integers(len(COLOURS))], SHAPES[rng.integers(len(SHAPES))]
        while True:
            frames = _draw_motion(rng, colour, shape, image_size, direction)
            digest = hashlib.sha1(b"".join(frame.tobytes() for frame in frames)).hexdigest()
            if digest not in seen:
                seen.add(digest)
                break
        name = f"{split}/{index:05d}.mp4"
        write_video(out_dir / "images" / name, frames, fps=MOTION_FPS, codec=MOTION_CODEC)
        records.append(
            {
                "id": f"{split}-{index:05d}",
                "video": name,
                "conversations": [
                    {"from": "human", "value": f"{VIDEO_PLACEHOLDER}\n{MOTION_QUESTION}"},
                    {"from": "gpt", "value": direction},
                ],
            }
        )
    return records


def _draw_motion(rng: np.random.Generator, colour: str, shape: str, size: int, direction: str) -> list[np.ndarray]:
    """One clip: the shape travels 60-90% of the room it has in `direction`, frame by frame, starting anywhere
    its path fits, on a noisy background drawn afresh for each frame."""
    extent = int(rng.integers(round(MOTION_EXTENT[0] * size), round(MOTION_EXTENT[1] * size) + 1))
    layer = Image.new("L", (size, size), 0)
    _draw_one(ImageDraw.Draw(layer), shape, 0, 0, extent, 255)
    mask = np.asarray(layer) > 0
    room = size - extent
    travel = int(rng.integers(round(0.6 * room), round(0.9 * room) + 1))
    start = int(rng.integers(0, room - travel + 1))  # along the motion, counted in its own sense
    across = int(rng.integers(0, room + 1))
    fill = np.array([np.clip(v + rng.integers(-20, 21), 0, 255) for v in COLOURS[colour]], dtype=np.uint8)
    background = rng.integers(200, 250)
    dx, dy = DIRECTIONS[direction]
    frames = []
    for step in range(MOTION_FRAMES):
        along = start + round(travel * step / (MOTION_FRAMES - 1))
        along = along if dx + dy > 0 else room - along  # left and up count from the far side
        shift = (along, across) if dy else (across, along)  # (rows, columns) of the shape's corner
        noise = rng.integers(-12, 13, size=(size, size, 3))
        frame = np.clip(background + noise, 0, 255).astype(np.uint8)
        frame[np.roll(mask, shift, axis=(0, 1))] = fill
        frames.append(frame)
    return frames


def _pair(record_id: str, image: str, question: str, answer: Any, colour: str, shape: str, index: int) -> dict:
    """A preference record (LLaMA-Factory's format): the right answer chosen over a wrong one, whose colour
    (or, for every other record of the shape task, shape) is another; chosen without drawing from the
    generator, so the images are those of the question set."""
    colours, shapes = list(COLOURS), list(SHAPES)
    wrong_colour = colours[(colours.index(colour) + 1 + index % (len(colours) - 1)) % len(colours)]
    wrong = (wrong_colour, shape)
    if answer(colour, shape) != answer(colour, "") and index % 2:  # the shape task: a wrong shape instead
        wrong = (colour, shapes[(shapes.index(shape) + 1 + index // 2 % (len(shapes) - 1)) % len(shapes)])
    return {
        "id": record_id,
        "images": [image],
        "conversations": [{"from": "human", "value": f"{IMAGE_PLACEHOLDER}\n{question}"}],
        "chosen": {"from": "gpt", "value": answer(colour, shape)},
        "rejected": {"from": "gpt", "value": answer(*wrong)},
    }


def _draw_unseen(rng: np.random.Generator, colour: str, shape: str, size: int, seen: set[str]) -> np.ndarray:
    """Draw until the image differs from every image drawn before (keeps the splits disjoint)."""
    while True:
        pixels = _draw_shape(rng, colour, shape, size)
        digest = hashlib.sha1(pixels.tobytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            return pixels


def _draw_shape(rng: np.random.Generator, colour: str, shape: str, size: int) -> np.ndarray:
    background = rng.integers(200, 250)
    noise = rng.integers(-12, 13, size=(size, size, 3))
    image = Image.fromarray(np.clip(background + noise, 0, 255).astype(np.uint8))
    extent = int(rng.integers(round(SHAPE_EXTENT[0] * size), round(SHAPE_EXTENT[1] * size) + 1))
    left = int(rng.integers(0, size - extent + 1))
    top = int(rng.integers(0, size - extent + 1))
    fill = tuple(int(np.clip(v + rng.integers(-20, 21), 0, 255)) for v in COLOURS[colour])
    _draw_one(ImageDraw.Draw(image), shape, left, top, extent, fill)
    return np.asarray(image)


def _draw_one(draw: ImageDraw.ImageDraw, shape: str, left: int, top: int, extent: int, fill: Any) -> None:
    box = (left, top, left + extent - 1, top + extent - 1)
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon([(left + (extent - 1) / 2, top), (box[0], box[3]), (box[2], box[3])], fill=fill)
