"""launcher.data.shapes: the built-in set is deterministic, balanced, disjoint between splits, reused from
its cache, and asks either of its two tasks about the same images."""

from __future__ import annotations

import hashlib
import itertools
import json

import numpy as np
import pytest
from PIL import Image

from launcher.core.errors import LauncherError
from launcher.data.records import load_records
from launcher.data.shapes import COLOUR_QUESTION, COLOURS, SHAPES, generate_shapes, prepare_data
from tests.helpers import compose_typed
from tests.unit.data.samples import answer


def test_shapes_are_deterministic_balanced_and_disjoint(tmp_path, shapes):
    train_json, eval_json, root = shapes
    again = generate_shapes(tmp_path / "again", seed=0, n_train=72, n_eval=36, image_size=32)
    assert train_json.read_bytes() == again[0].read_bytes() and eval_json.read_bytes() == again[1].read_bytes()
    for name in ("train/00000.png", "eval/00035.png"):
        assert (root / name).read_bytes() == (again[2] / name).read_bytes()
    other = generate_shapes(tmp_path / "other", seed=1, n_train=72, n_eval=36, image_size=32)
    assert (root / "train/00000.png").read_bytes() != (other[2] / "train/00000.png").read_bytes()

    train, _ = load_records(train_json, root)
    held_out, _ = load_records(eval_json, root)
    answers = [answer(r) for r in train]
    assert sorted(set(answers)) == sorted(f"{c} {s}" for c in COLOURS for s in SHAPES)
    assert all(answers.count(a) == 4 for a in set(answers))  # 72 images, 18 answers

    def digests(records):
        return {hashlib.sha1(np.asarray(Image.open(r["images"][0])).tobytes()).hexdigest() for r in records}

    assert len(digests(train)) == 72 and len(digests(held_out)) == 36
    assert not digests(train) & digests(held_out)
    assert Image.open(root / "train/00000.png").size == (32, 32)


def test_shapes_reuse_a_complete_set(tmp_path):
    paths = generate_shapes(tmp_path / "s", seed=3, n_train=4, n_eval=2, image_size=16)
    marker = tmp_path / "s" / "shapes.json"
    stamp = marker.stat().st_mtime_ns
    assert generate_shapes(tmp_path / "s", seed=3, n_train=4, n_eval=2, image_size=16) == paths
    assert marker.stat().st_mtime_ns == stamp
    generate_shapes(tmp_path / "s", seed=3, n_train=5, n_eval=2, image_size=16)
    assert len(json.loads(paths[0].read_text())) == 5
    assert [p.name for p in tmp_path.iterdir()] == ["s"]  # no temp dirs left behind


def test_a_damaged_image_of_the_set_is_drawn_again(tmp_path):
    """The built-in set is a cache like the others: a file that differs from the one written is not used."""
    paths = generate_shapes(tmp_path / "s", seed=3, n_train=4, n_eval=2, image_size=16)
    image = paths[2] / "train" / "00001.png"
    intact = image.read_bytes()
    image.write_bytes(intact[:20])
    assert generate_shapes(tmp_path / "s", seed=3, n_train=4, n_eval=2, image_size=16) == paths
    assert image.read_bytes() == intact


def test_the_colour_task_asks_about_the_same_images(tmp_path, shapes):
    train_json, eval_json, root = shapes
    colour = generate_shapes(tmp_path / "colour", seed=0, n_train=72, n_eval=36, image_size=32, task="colour")
    for name in ("train/00000.png", "train/00071.png", "eval/00035.png"):
        assert (root / name).read_bytes() == (colour[2] / name).read_bytes()
    for shape_file, colour_file in ((train_json, colour[0]), (eval_json, colour[1])):
        for asked_shape, asked_colour in zip(
            json.loads(shape_file.read_text()), json.loads(colour_file.read_text()), strict=True
        ):
            assert asked_colour["image"] == asked_shape["image"]
            assert asked_colour["conversations"][0]["value"] == f"<image>\n{COLOUR_QUESTION}"
            assert asked_colour["conversations"][1]["value"] == asked_shape["conversations"][1]["value"].split()[0]
    answers = [answer(r) for r in load_records(colour[0], colour[2])[0]]
    assert sorted(set(answers)) == sorted(COLOURS)
    assert all(answers.count(a) == 12 for a in COLOURS)  # 72 images, 6 answers
    with pytest.raises(LauncherError, match=r"data\.task=size is not a task of the built-in set"):
        generate_shapes(tmp_path / "size", seed=0, n_train=4, n_eval=2, image_size=16, task="size")


def test_both_tasks_coexist_in_the_cache(tmp_path):
    cache = tmp_path / "cache"
    shapes = compose_typed(["data=shapes", "data.n_train=18", "data.n_eval=6"]).data
    colour = compose_typed(["data=shapes", "data.n_train=18", "data.n_eval=6", "data.task=colour"]).data
    shape_files = prepare_data(shapes, cache)
    marker = shape_files[0].parent / "shapes.json"
    stamp = marker.stat().st_mtime_ns
    colour_files = prepare_data(colour, cache)
    assert shape_files[0].parent != colour_files[0].parent
    assert json.loads(marker.read_text())["task"] == "shape"
    assert json.loads((colour_files[0].parent / "shapes.json").read_text())["task"] == "colour"
    assert prepare_data(shapes, cache) == shape_files and marker.stat().st_mtime_ns == stamp  # reused, not redrawn
    assert json.loads(colour_files[0].read_text())[0]["conversations"][1]["value"] in COLOURS


def test_prepare_data_writes_the_configured_set_under_the_cache(tmp_path):
    """The typed data config decides the set: its sizes, its image size, and where it is cached."""
    data = compose_typed(["data=shapes", "data.n_train=6", "data.n_eval=3", "data.image_size=16"]).data
    train_file, eval_file, image_root = prepare_data(data, tmp_path)
    assert train_file.parent.parent == tmp_path / "data" and image_root == train_file.parent / "images"
    train, _ = load_records(train_file, image_root)
    held_out, _ = load_records(eval_file, image_root)
    assert (len(train), len(held_out)) == (6, 3)
    assert {Image.open(r["images"][0]).size for r in train + held_out} == {(16, 16)}


@pytest.mark.parametrize("task", ["colour", "shape"])
def test_the_preference_task_prefers_the_right_answer_about_the_same_images(tmp_path, shapes, task):
    """With a preference loss (data.pairs) the built-in records are pairs about the same images: the right
    answer chosen, a wrong one rejected, every wrong answer as often rejected as the others, so that only
    the image tells which answer of a pair is right."""
    questions = generate_shapes(tmp_path / "q", seed=0, n_train=72, n_eval=36, image_size=32, task=task)
    pairs = generate_shapes(tmp_path / "p", seed=0, n_train=72, n_eval=36, image_size=32, task=task, pairs=True)
    assert (pairs[2] / "train/00071.png").read_bytes() == (shapes[2] / "train/00071.png").read_bytes()
    rejected = []
    for asked, pair in zip(json.loads(questions[0].read_text()), json.loads(pairs[0].read_text()), strict=True):
        assert pair["images"] == [asked["image"]] and pair["conversations"] == asked["conversations"][:1]
        assert pair["chosen"] == asked["conversations"][1]
        assert pair["rejected"]["value"] != pair["chosen"]["value"]
        rejected.append(pair["rejected"]["value"])
    chosen = [answer(r) for r in load_records(questions[0], questions[2])[0]]
    # Each answer is rejected about as often as it is chosen: the answers alone tell nothing.
    for value in set(chosen):
        assert abs(rejected.count(value) - chosen.count(value)) <= chosen.count(value) // 2 + 1, (value, rejected)


def test_the_motion_task_asks_which_way_a_shape_moves_in_a_clip(tmp_path):
    """data.task=motion: 2 s clips of a shape crossing the frame, the four directions balanced, the splits'
    clips disjoint; between every two frames sampled for training the shape moves that way."""
    from launcher.data.shapes import DIRECTIONS, MOTION_FRAMES, MOTION_QUESTION
    from launcher.data.video import VideoSampling, decode_frames, probe_video

    made = generate_shapes(tmp_path / "m", seed=0, n_train=40, n_eval=8, image_size=32, task="motion")
    again = generate_shapes(tmp_path / "again", seed=0, n_train=40, n_eval=8, image_size=32, task="motion")
    train_json, eval_json, root = made
    assert train_json.read_bytes() == again[0].read_bytes()
    assert (root / "train/00000.mp4").read_bytes() == (again[2] / "train/00000.mp4").read_bytes()
    train, _ = load_records(train_json, root)
    held_out, _ = load_records(eval_json, root)
    assert [answer(r) for r in train].count("left") == 10 and {answer(r) for r in train} == set(DIRECTIONS)
    assert train[0]["messages"][0]["content"] == [{"type": "video"}, {"type": "text", "text": MOTION_QUESTION}]
    assert not {r["videos"][0] for r in train} & {r["videos"][0] for r in held_out}
    for record in train:
        assert probe_video(record["videos"][0]).frames == MOTION_FRAMES
        masks = []
        for frame in decode_frames(record["videos"][0], VideoSampling()):  # the shape: far from the background
            pixels = np.asarray(frame, dtype=float)
            masks.append(np.abs(pixels - np.median(pixels, axis=(0, 1))).sum(axis=2) > 120)
        dy, dx = DIRECTIONS[answer(record)][1], DIRECTIONS[answer(record)][0]
        for before, after in itertools.pairwise(masks):  # the shift that matches best
            shifts = [(r, c) for r in range(-12, 13) for c in range(-12, 13)]
            best = max(shifts, key=lambda shift: int((np.roll(before, shift, axis=(0, 1)) & after).sum()))
            assert best[0] * dy + best[1] * dx > 0 and best[0] * dx == 0 and best[1] * dy == 0, (record["id"], best)
