"""Videos as the model takes them: as videos (the Qwen2-VL family: frames paired in temporal patches) or as
their sampled frames placed as images where the video was (LLaVA);
the data cache keeps the video's file (never its frames) and gives the batch the records make without it;
packed video records keep the losses they have alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from launcher.data.cache import IMAGE_BYTES, IMAGE_LENGTHS, VIDEO_FRAMES, CachedDataset, RecordEncoder, ensure_cache
from launcher.data.collate import Collator
from launcher.data.formats import ReadOptions, read_records
from launcher.data.length import IGNORE_INDEX, LengthLimit, RecordTooLong, fit_to_length, one_row, pad_rows
from launcher.data.packing import RECORD_LENGTHS, PackedCollator
from launcher.data.records import ConversationDataset
from launcher.data.video import VideoSampling, frames_as_images, takes_videos, video_inputs, write_video
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


def test_a_sample_keeps_its_video_parts_with_their_sampled_frames(video_records):
    dataset = ConversationDataset(video_records, SAMPLING)
    image_only, video, both, text = (dataset[index] for index in range(4))
    assert "media" not in image_only and "videos" not in text  # records without videos: as before
    assert [part["type"] for part in video["messages"][0]["content"]] == ["video", "text"]
    assert [len(frames) for frames in video["videos"]] == [4] and video["images"] == []
    assert video["media"] == [(video_records[1]["videos"][0], 4)]
    assert both["media"] == [(video_records[2]["videos"][0], 4), (video_records[2]["images"][0], 0)]
    columns = [int(np.asarray(frame)[16].argmax(axis=0)[0]) for frame in video["videos"][0]]
    assert columns == sorted(columns) and columns[0] < columns[-1]  # the square moves right, frame after frame


def test_for_a_model_of_images_a_video_becomes_its_frames_placed_as_images_where_it_was(video_records):
    dataset = ConversationDataset(video_records, SAMPLING)
    image_only, both = dataset[0], dataset[2]
    assert frames_as_images(image_only) is image_only
    seen = frames_as_images(both)
    assert [part["type"] for part in seen["messages"][0]["content"]] == ["image"] * 4 + ["text", "image", "text"]
    assert seen["images"][:4] == both["videos"][0] and "videos" not in seen
    assert seen["images"][4].size == image_only["images"][0].size  # the image after the frames is the image


def test_each_family_takes_a_video_its_own_way(video_records, model_and_processor):
    """Qwen2-VL: the video's frames paired in temporal patches, its tokens t x h x w / 4 (8 for 4 frames of
    4 x 4 patches), counted as video tokens; LLaVA: 4 images of its image tokens each."""
    model, processor = model_and_processor
    sample = ConversationDataset(video_records, SAMPLING)[1]
    batch = Collator(processor)([sample])
    if takes_videos(processor):
        assert batch["video_grid_thw"].tolist() == [[2, 4, 4]] and "pixel_values" not in batch
        assert int((batch["input_ids"] == processor.video_token_id).sum()) == 8
        assert int((batch["mm_token_type_ids"] == 2).sum()) == 8
    else:
        assert len(batch["pixel_values"]) == 4 and "pixel_values_videos" not in batch
    answer = batch["input_ids"][0][batch["labels"][0] != IGNORE_INDEX]
    assert processor.tokenizer.decode(answer).strip().startswith("right")
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


def test_the_video_processors_layout_made_from_the_image_processor(model_and_processor):
    """A video of one still, repeated: the same patches the image processor makes of the still (it repeats an
    image over the temporal patch), and each pair of distinct frames keeps its frames apart in time."""
    _, processor = model_and_processor
    if not takes_videos(processor):
        pytest.skip("LLaVA takes a video's frames as images")
    still, other = (
        Image.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 24, 3), np.uint8)) for seed in (0, 1)
    )
    image = processor.image_processor([still], return_tensors="pt")
    video = video_inputs(processor.image_processor, [[still, still]])
    assert torch.equal(video["pixel_values_videos"], image["pixel_values"])
    assert video["video_grid_thw"].tolist() == image["image_grid_thw"].tolist()
    pair = video_inputs(processor.image_processor, [[still, other, other]])  # the last frame repeated to fill
    assert pair["video_grid_thw"].tolist() == [[2, *image["image_grid_thw"][0, 1:].tolist()]]
    channels, patch = 3, processor.image_processor.patch_size
    rows = pair["pixel_values_videos"].reshape(-1, channels, 2, patch, patch)
    first = image["pixel_values"].reshape(-1, channels, 2, patch, patch)
    half = len(rows) // 2
    assert torch.equal(rows[:half, :, 0], first[:, :, 0]) and not torch.equal(rows[:half, :, 1], first[:, :, 1])
    assert torch.equal(rows[half:, :, 0], rows[half:, :, 1])  # the repeated last frame


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
    assert ("video_grid_thw" in stored) == takes_videos(processor)  # its tokens and grid kept, its pixels not
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


def test_a_video_too_long_for_data_max_length_is_named_with_the_frame_knobs(video_records, model_and_processor):
    """Where a video's tokens leave no room for the answer under data.max_length, the reason names the frame
    budget (the Qwen2-VL family; LLaVA's frames are images, whose fix its reason names)."""
    _, processor = model_and_processor
    row = one_row(Collator(processor).labelled([ConversationDataset(video_records, SAMPLING)[1]]))
    prompt = int((row["labels"] == IGNORE_INDEX).sum())
    with pytest.raises(RecordTooLong, match="no room for") as raised:
        fit_to_length(row, LengthLimit(prompt - 1), processor)
    assert ("data.video.max_frames" in str(raised.value)) == takes_videos(processor)


def test_a_cut_keeps_whole_videos_and_drops_those_past_it(video_records, model_and_processor):
    """Two turns, a video in each prompt: data.max_length ending inside the second prompt cuts after the first
    answer, the second video goes whole (its tokens and its pixels), the first stays whole."""
    _, processor = model_and_processor
    dataset = ConversationDataset(video_records, SAMPLING)
    first, second = dataset[1]["videos"][0], dataset[2]["videos"][0]
    words = " ".join(["right"] * 20)

    def turn(role: str, *parts: dict) -> dict:
        return {"role": role, "content": list(parts)}

    video, question = {"type": "video"}, {"type": "text", "text": "which way?"}
    messages = [
        turn("user", video, question),
        turn("assistant", {"type": "text", "text": words}),
        turn("user", video, question),
        turn("assistant", {"type": "text", "text": "left"}),
    ]
    sample = {"id": "two", "where": "two", "images": [], "videos": [first, second], "messages": messages}
    row = one_row(Collator(processor).labelled([sample]))
    answers = (row["labels"] != IGNORE_INDEX).nonzero().flatten()
    gap = int(((answers[1:] - answers[:-1]) > 1).nonzero()[0])  # the first answer ends where the labels pause
    first_end = int(answers[gap]) + 1
    cut, was_cut = fit_to_length(row, LengthLimit(first_end + 3), processor)
    assert was_cut and len(cut["input_ids"]) == first_end
    alone = one_row(Collator(processor).labelled([{**sample, "videos": [first], "messages": messages[:2]}]))
    for name, value in alone.items():
        if name in ("pixel_values", "pixel_values_videos", "video_grid_thw"):
            assert torch.equal(cut[name], value), name  # the first video's, whole; none of the second's
