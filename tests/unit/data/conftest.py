"""Fixtures of the data tests, built once per session: the built-in set, both tiny model families, and
records that mix zero to three images (helpers: samples.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from launcher.data.formats import ReadOptions, read_records
from launcher.data.shapes import generate_shapes
from launcher.model.loading import load_model_and_processor
from launcher.model.tiny import TINY_ARCHITECTURES, build_tiny_model_dir
from tests.unit.data.samples import QUESTIONS, SIZES, VOCABULARY


@pytest.fixture(scope="session")
def shapes(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The built-in set, small: (train json, eval json, image root); 72 train and 36 eval images."""
    return generate_shapes(tmp_path_factory.mktemp("data") / "shapes", seed=0, n_train=72, n_eval=36, image_size=32)


@pytest.fixture(scope="session", params=TINY_ARCHITECTURES)
def model_and_processor(request, tmp_path_factory):
    """(model, processor) of each tiny family. Shared: a test that changes either puts it back."""
    out = build_tiny_model_dir(
        request.param, tmp_path_factory.mktemp("model") / request.param, VOCABULARY, seed=0, **SIZES
    )
    return load_model_and_processor(str(out))


@pytest.fixture(scope="session")
def mixed_records(tmp_path_factory) -> list[dict]:
    """12 records with 0, 1, 2 and 3 images, of different sizes and colours; some with a second turn."""
    root = tmp_path_factory.mktemp("mixed")
    colours = ["red", "green", "blue", "yellow"]
    for number, colour in enumerate(colours):
        Image.new("RGB", (24 + 8 * number, 32), colour).save(root / f"{colour}.png")
    rows = []
    for index in range(12):
        count = index % 4  # 0, 1, 2, 3 images
        images = [f"{colours[(index + k) % 4]}.png" for k in range(count)]
        question = " ".join(["<image>"] * count + [QUESTIONS[index % len(QUESTIONS)]])
        turns = [
            {"from": "human", "value": question},
            {"from": "gpt", "value": " ".join(c[:-4] for c in images) or "hi"},
        ]
        if index % 5 == 0:
            turns += [{"from": "human", "value": "and the shape?"}, {"from": "gpt", "value": "square"}]
        rows.append({"id": str(index), "images": images, "conversations": turns})
    (root / "data.json").write_text(json.dumps(rows))
    return read_records(root / "data.json", ReadOptions())[0]
