"""What the data tests share: small records written to disk, and how to read a batch's labels back.

The fixtures over them (a built-in set, the tiny models, records of 0-3 images) are in conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from launcher.data.length import IGNORE_INDEX
from launcher.data.records import load_records
from launcher.data.shapes import COLOURS, QUESTION, SHAPES

QUESTIONS = ["what is in the image?", "compare them", "which is red?", "say hi", "and the shape?"]

# The words of every record the data tests write: each is one token of the tiny models' tokenizer.
VOCABULARY = [QUESTION] + [f"{c} {s}" for c in COLOURS for s in SHAPES] + ["what colour?", "and the shape?"] + QUESTIONS

# The tiny models' dimensions: one layer each side, 32 px images of 8 px patches.
SIZES = {
    "hidden_size": 64,
    "num_layers": 1,
    "vision_hidden_size": 32,
    "vision_layers": 1,
    "image_size": 32,
    "patch_size": 8,
}

MULTI_TURN = {
    "id": "multi",
    "image": "a.png",
    "conversations": [
        {"from": "human", "value": "<image>\nwhat colour?"},
        {"from": "gpt", "value": "blue"},
        {"from": "human", "value": "and the shape?"},
        {"from": "gpt", "value": "square"},
    ],
}

LONG_ANSWER = " ".join(["blue square"] * 60)  # about 120 tokens


def write_image(path: Path, size: tuple[int, int] = (32, 32), colour: str = "blue") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path.name


def record(image: str = "a.png", answer: str = "blue square", **extra) -> dict:
    """A one-image LLaVA record asking the built-in question."""
    turns = [{"from": "human", "value": f"<image>\n{QUESTION}"}, {"from": "gpt", "value": answer}]
    return {"image": image, "conversations": turns, **extra}


def two_records(root: Path) -> list[dict]:
    """`record()` and `MULTI_TURN`, read from root/data.json (images in root)."""
    write_image(root / "a.png")
    path = root / "data.json"
    path.write_text(json.dumps([record(), MULTI_TURN]))
    return load_records(path, root)[0]


def answer(record: dict) -> str:
    """The text of a record's first assistant turn."""
    return record["messages"][1]["content"][0]["text"]


def labelled_text(processor, batch, row: int) -> str:
    """The labelled tokens of a batch's row, decoded, without spaces."""
    ids = batch["input_ids"][row][batch["labels"][row] != IGNORE_INDEX]
    return "".join(processor.tokenizer.decode(ids).split())


def long_records(root: Path) -> list[dict]:
    """A short record; a long answer; a long answer before a turn with a second image; a long prompt."""
    write_image(root / "a.png")
    Image.new("RGB", (64, 48), "red").save(root / "b.png")
    second_image = [
        {"from": "human", "value": "<image>\nwhat colour?"},
        {"from": "gpt", "value": LONG_ANSWER},
        {"from": "human", "value": "<image>\nand the shape?"},
        {"from": "gpt", "value": "square"},
    ]
    long_prompt = [{"from": "human", "value": "<image>\n" + "what colour? " * 80}, {"from": "gpt", "value": "blue"}]
    rows = [
        record(id="short"),
        record(answer=LONG_ANSWER, id="long_answer"),
        {"id": "second_image", "image": ["a.png", "b.png"], "conversations": second_image},
        {"id": "long_prompt", "image": "a.png", "conversations": long_prompt},
    ]
    path = root / "long.json"
    path.write_text(json.dumps(rows))
    return load_records(path, root)[0]


def vision_inputs_alone(processor, dataset, count: int) -> tuple[list[int], list[int] | None]:
    """What each record's batch alone gives the vision tower, as CachedDataset.vision_inputs counts it: (images, a
    video's temporal patches counted as images for the Qwen2-VL family, its tiled images in the pixel rows for
    LLaVA; vision-tower patches where the batch has grids, else None)."""
    from launcher.data.collate import Collator

    collate = Collator(processor)
    images, patches, grids = [], [], False
    for index in range(count):
        alone = collate([dataset[index]])
        held = [alone[name] for name in ("image_grid_thw", "video_grid_thw") if name in alone]
        grids = grids or bool(held)
        if held:
            images.append(sum(int(grid[:, 0].sum()) for grid in held))
            patches.append(sum(int(grid.prod(-1).sum()) for grid in held))
        else:
            images.append(len(alone["pixel_values"]) if "pixel_values" in alone else 0)
            patches.append(0)
    return images, patches if grids else None
