"""Videos as the model takes them: each video part becomes its sampled frames, placed as images where it was;
the data cache keeps the video's file (never its frames) and gives the batch the records make without it;
packed video records keep the losses they have alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from launcher.data.cache import IMAGE_BYTES, IMAGE_LENGTHS, VIDEO_FRAMES, CachedDataset, RecordEncoder, ensure_cache
from launcher.data.collate import Collator
from launcher.data.formats import ReadOptions, read_records
from launcher.data.length import pad_rows
from launcher.data.packing import RECORD_LENGTHS, PackedCollator
from launcher.data.records import ConversationDataset
from launcher.data.video import VideoSampling, write_video
from launcher.model.packing import packed_inputs
from tests.unit.data.samples import write_image
from tests.unit.model.test_packing import record_losses

SAMPLING = VideoSampling(fps=2, min_frames=2, max_frames=4, max_pixels=None)


def moving_square(steps: int, *, rightwards: bool) -> list[np.ndarray]:
    frames = []
    for step in range(steps):
        pixels = np.zeros((32, 32, 3), dtype=np.uint8)
        x = 4 + 3 * step if rightwards else 27 - 3 * step
        pixels[12:20, x - 2 : x + 2] = (255, 255, 255)
        frames.append(pixels)
    return frames


@pytest.fixture(scope="module")
def video_records(tmp_path_factory) -> list[dict]:
    """An image record, two video records (one also with an image after its video), and a text-only one."""
    root = tmp_path_factory.mktemp("videos")
    write_image(root / "a.png")
    write_video(root / "right.mp4", moving_square(8, rightwards=True), fps=4)  # 2 s: 4 frames at 2 per second
    write_video(root / "left.mp4", moving_square(12, rightwards=False), fps=4)  # 3 s: 4 frames (max_frames)
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>what colour?"},
                                             {"from": "gpt", "value": "red"}]},
        {"video": "right.mp4", "conversations": [{"from": "human", "value": "<video>which way?"},
                                                 {"from": "gpt", "value": "right"}]},
        {"video": "left.mp4", "image": "a.png", "conversations": [
            {"from": "human", "value": "<video>which way? <image>and this?"}, {"from": "gpt", "value": "left red"}]},
        {"conversations": [{"from": "human", "value": "say hi"}, {"from": "gpt", "value": "hi"}]},
    ]  # fmt: skip
    (root / "data.json").write_text(json.dumps(rows))
    return read_records(root / "data.json", ReadOptions(video=SAMPLING))[0]


def test_a_video_becomes_its_sampled_frames_placed_as_images_where_it_was(video_records):
    dataset = ConversationDataset(video_records, SAMPLING)
    image_only, video, both, text = (dataset[index] for index in range(4))
    assert "media" not in image_only and "media" not in text  # records without videos: as before
    assert [part["type"] for part in video["messages"][0]["content"]] == ["image"] * 4 + ["text"]
    assert len(video["images"]) == 4 and video["media"] == [(video_records[1]["videos"][0], 4)]
    kinds = [part["type"] for part in both["messages"][0]["content"]]
    assert kinds == ["image"] * 4 + ["text", "image", "text"]  # the video's frames, then its own image
    assert both["media"] == [(video_records[2]["videos"][0], 4), (video_records[2]["images"][0], 0)]
    assert both["images"][4].size == image_only["images"][0].size  # the image after the frames is the image
    columns = [int(np.asarray(frame)[16].argmax(axis=0)[0]) for frame in video["images"]]
    assert columns == sorted(columns) and columns[0] < columns[-1]  # the square moves right, frame after frame


def test_the_cache_keeps_each_video_file_and_gives_the_batch_the_records_make_alone(
    video_records, model_and_processor, tmp_path
):
    _, processor = model_and_processor
    encode = RecordEncoder(processor, None, "encoded", SAMPLING)
    dataset = ConversationDataset(video_records, SAMPLING)
    info = ensure_cache(
        tmp_path, video_records, processor, "tiny", encode, dataset.__getitem__, on_bad_record="error", num_workers=0
    )
    cached = CachedDataset(info.path, processor)
    stored = encode(dataset[2])[0]
    files = [Path(video_records[2]["videos"][0]).read_bytes(), Path(video_records[2]["images"][0]).read_bytes()]
    assert stored[IMAGE_BYTES].numpy().tobytes() == b"".join(files)  # the files as they are: no frame stored
    assert stored[IMAGE_LENGTHS].tolist() == [len(file) for file in files]
    assert stored[VIDEO_FRAMES].tolist() == [4, 0]
    collate = Collator(processor)
    for index in range(len(video_records)):
        alone = collate([dataset[index]])
        tensors = cached[index]["tensors"]
        for name, value in tensors.items():
            if name not in alone:  # a tensor other records hold: none of it in this one
                assert value.numel() == 0, name
                continue
            assert torch.equal(value, alone[name][0] if value.dim() == alone[name].dim() - 1 else alone[name]), name


def test_packed_video_records_have_the_losses_they_have_alone(video_records, model_and_processor):
    model, processor = model_and_processor
    model.eval()
    encode = RecordEncoder(processor, None, "pixels", SAMPLING)
    dataset = ConversationDataset(video_records, SAMPLING)
    tensors = [encode(dataset[index])[0] for index in range(len(video_records))]
    pad = processor.tokenizer.pad_token_id
    with torch.no_grad():
        alone = [float(model(**pad_rows([t], pad)).loss) for t in tensors]
        for rows in ([[0, 1, 2, 3]], [[2, 0], [3, 1]]):
            batch = PackedCollator(processor)([[{"tensors": tensors[i]} for i in row] for row in rows])
            inputs = packed_inputs(model, batch)
            logits = model(**inputs).logits
            for number, row in enumerate(rows):
                packed = record_losses(logits[number], inputs["labels"][number], batch[RECORD_LENGTHS][number])
                for index, loss in zip(row, packed, strict=True):
                    assert loss == pytest.approx(alone[index], rel=1e-5), (rows, index)
