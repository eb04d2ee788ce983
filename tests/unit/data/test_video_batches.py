"""Videos as the model takes them: as videos (the Qwen2-VL family: frames paired in temporal patches) or as
their sampled frames placed as images where the video was (LLaVA);
the data cache keeps the video's file (never its frames) and gives the batch the records make without it;
packed video records keep the losses they have alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor

from launcher.data.cache import IMAGE_BYTES, IMAGE_LENGTHS, VIDEO_FRAMES, CachedDataset, RecordEncoder, ensure_cache
from launcher.data.collate import Collator
from launcher.data.formats import ReadOptions, read_records
from launcher.data.length import IGNORE_INDEX, LengthLimit, RecordTooLong, fit_to_length, one_row, pad_rows
from launcher.data.packing import RECORD_LENGTHS, PackedCollator
from launcher.data.records import ConversationDataset
from launcher.data.video import (
    VideoSampling,
    frames_as_images,
    takes_videos,
    tile_frames,
    video_inputs,
    write_video,
)
from launcher.model.loading import load_model_and_processor, without_video_processor
from launcher.model.packing import packed_inputs
from launcher.model.tiny import build_tiny_model_dir
from tests.unit.data.samples import SIZES, VOCABULARY, vision_inputs_alone, write_image
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
    """data.video.grid=1: each frame an image, in place; the default 2: the 4 frames tiled 2 x 2 into one."""
    dataset = ConversationDataset(video_records, dataclasses.replace(SAMPLING, grid=1))
    image_only, both = dataset[0], dataset[2]
    assert frames_as_images(image_only) is image_only
    seen = frames_as_images(both)
    assert [part["type"] for part in seen["messages"][0]["content"]] == ["image"] * 4 + ["text", "image", "text"]
    assert seen["images"][:4] == both["videos"][0] and "videos" not in seen and "video_grid" not in seen
    assert seen["images"][4].size == image_only["images"][0].size  # the image after the frames is the image
    tiled = frames_as_images(ConversationDataset(video_records, SAMPLING)[2])
    assert [part["type"] for part in tiled["messages"][0]["content"]] == ["image", "text", "image", "text"]
    assert tiled["images"][0].size == (64, 64) and tiled["images"][1].size == image_only["images"][0].size


def test_frames_tile_in_time_order_along_rows_and_the_last_tile_is_filled_with_black():
    frames = [Image.new("RGB", (3, 2), (10 * k, 0, 0)) for k in range(1, 6)]
    tiles = tile_frames(frames, 2)
    assert [tile.size for tile in tiles] == [(6, 4)] * 2
    first, last = np.asarray(tiles[0]), np.asarray(tiles[1])
    assert [first[0, 0, 0], first[0, 3, 0], first[2, 0, 0], first[2, 3, 0]] == [10, 20, 30, 40]
    assert last[0, 0, 0] == 50 and not last[0, 3:].any() and not last[2:].any()
    assert tile_frames(frames, 1) == frames and tile_frames(frames, 3)[0].size == (9, 6)


def test_each_family_takes_a_video_its_own_way(video_records, model_and_processor):
    """Qwen2-VL: the video's frames paired in temporal patches, its tokens t x h x w / 4 (8 for 4 frames of
    4 x 4 patches), counted as video tokens; LLaVA: its 4 frames tiled into one image (data.video.grid 2)."""
    model, processor = model_and_processor
    sample = ConversationDataset(video_records, SAMPLING)[1]
    batch = Collator(processor)([sample])
    if takes_videos(processor):
        assert batch["video_grid_thw"].tolist() == [[2, 4, 4]] and "pixel_values" not in batch
        assert int((batch["input_ids"] == processor.video_token_id).sum()) == 8
        assert int((batch["mm_token_type_ids"] == 2).sum()) == 8
    else:
        assert len(batch["pixel_values"]) == 1 and "pixel_values_videos" not in batch
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
    # The vision tower's share of each record, for the memory planner: a video as the images its frames make
    # (LLaVA: its 4 frames tiled 2 x 2 into one; Qwen2-VL: 2 temporal patches of two frames), read without pixels.
    images, patches = cached.vision_inputs()
    assert (images.tolist(), patches if patches is None else patches.tolist()) == vision_inputs_alone(
        processor, dataset, len(video_records)
    )
    assert images.tolist() == ([1, 2, 3, 0] if takes_videos(processor) else [1, 1, 2, 0])
    collate = Collator(processor)
    for index in range(len(video_records)):
        alone = collate([dataset[index]])
        tensors = cached[index]["tensors"]
        for name, value in tensors.items():
            if name not in alone:  # a tensor other records hold: none of it in this one
                assert value.numel() == 0, name
                continue
            assert torch.equal(value, alone[name][0] if value.dim() == alone[name].dim() - 1 else alone[name]), name


def packed_losses_equal_alone(model, processor, records: list[dict], packings: list[list[list[int]]]) -> list[dict]:
    """Each packing (rows of record numbers) collated and run: every packed record's loss equals its loss
    alone (1e-5). The packed batches, for what else a test checks of them."""
    encode = RecordEncoder(processor, None, "pixels", SAMPLING)
    dataset = ConversationDataset(records, SAMPLING)
    tensors = [encode(dataset[index])[0] for index in range(len(records))]
    pad = processor.tokenizer.pad_token_id
    batches = []
    with torch.no_grad():
        alone = [float(model(**pad_rows([t], pad)).loss) for t in tensors]
        for rows in packings:
            batch = PackedCollator(processor)([[{"tensors": tensors[i]} for i in row] for row in rows])
            inputs = packed_inputs(model, batch)
            logits = model(**inputs).logits
            for number, row in enumerate(rows):
                packed = record_losses(logits[number], inputs["labels"][number], batch[RECORD_LENGTHS][number])
                for index, loss in zip(row, packed, strict=True):
                    assert loss == pytest.approx(alone[index], rel=1e-5), (rows, index)
            batches.append(batch)
    return batches


def test_packed_video_records_have_the_losses_they_have_alone(video_records, model_and_processor):
    model, processor = model_and_processor
    model.eval()
    packed_losses_equal_alone(model, processor, video_records, [[[0, 1, 2, 3]], [[2, 0], [3, 1]]])


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


# ----------------------------------------------------------------------------- Qwen2.5-VL: videos in time
@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory):
    """A tiny Qwen2.5-VL (windowed vision attention; a video's patches placed in absolute time): the tiny
    Qwen2-VL's tokenizer and image processor under Qwen2.5-VL's processor class, a model of its shape."""
    out = build_tiny_model_dir("tiny_qwen2_vl", tmp_path_factory.mktemp("qwen2_5"), VOCABULARY, seed=0, **SIZES)
    base, processor = load_model_and_processor(str(out))
    vision = base.config.vision_config
    config = Qwen2_5_VLConfig(
        text_config=base.config.text_config.to_dict(),
        vision_config={
            "depth": vision.depth, "hidden_size": vision.embed_dim, "out_hidden_size": vision.hidden_size,
            "intermediate_size": 4 * vision.embed_dim, "num_heads": vision.num_heads, "patch_size": vision.patch_size,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 2 * vision.patch_size,
            "fullatt_block_indexes": [vision.depth - 1], "tokens_per_second": 4,
        },
        **{key: getattr(base.config, key) for key in
           ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    made = without_video_processor(Qwen2_5_VLProcessor)(
        image_processor=processor.image_processor, tokenizer=processor.tokenizer, chat_template=processor.chat_template
    )
    return model, made


def test_qwen2_5_vl_places_each_video_in_time_at_its_sampled_rate(video_records, qwen2_5_vl, tmp_path):
    """right.mp4 is 2 s, sampled at 2 frames a second: 1 s per temporal patch of 2 frames; left.mp4 is 3 s,
    4 frames (max_frames): 1.5 s per patch. The rotary time index moves tokens_per_second x that per patch,
    with the data cache or without it; a cut that drops a video drops its seconds."""
    model, processor = qwen2_5_vl
    dataset = ConversationDataset(video_records, SAMPLING)
    assert dataset[1]["video_fps"] == [2.0] and dataset[2]["video_fps"] == [pytest.approx(4 / 3)]
    batch = Collator(processor)([dataset[1], dataset[2]])
    assert batch["second_per_grid_ts"].tolist() == pytest.approx([1.0, 1.5])
    positions, _ = model.model.get_rope_index(
        batch["input_ids"][1:], mm_token_type_ids=batch["mm_token_type_ids"][1:],
        video_grid_thw=batch["video_grid_thw"][1:], image_grid_thw=batch["image_grid_thw"],
        second_per_grid_ts=batch["second_per_grid_ts"][1:], attention_mask=batch["attention_mask"][1:],
    )  # fmt: skip
    times = positions[0, 0][batch["mm_token_type_ids"][1] == 2]  # the time axis, over the video's tokens
    steps = times.unique()
    assert len(steps) == 2 and int(steps[1] - steps[0]) == int(4 * 1.5)  # tokens_per_second x seconds per patch
    # The data cache remakes them with the pixels; a cut after the first answer keeps only the first video's.
    encode = RecordEncoder(processor, None, "encoded", SAMPLING)
    info = ensure_cache(
        tmp_path, video_records, processor, "tiny", encode, dataset.__getitem__, on_bad_record="error", num_workers=0
    )
    cached = CachedDataset(info.path, processor)
    assert cached[2]["tensors"]["second_per_grid_ts"].tolist() == pytest.approx([1.5])
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)
    video, question = {"type": "video"}, {"type": "text", "text": "which way?"}
    answer = {"type": "text", "text": " ".join(["right"] * 20)}  # the first answer: room for its tokens
    messages = [{"role": "user", "content": [video, question]}, {"role": "assistant", "content": [answer]}] * 2
    two = {"id": "two", "where": "two", "images": [], "messages": messages, "video_fps": [2.0, 4 / 3],
           "videos": [dataset[1]["videos"][0], dataset[2]["videos"][0]]}  # fmt: skip
    row = one_row(Collator(processor).labelled([two]))
    assert row["second_per_grid_ts"].tolist() == pytest.approx([1.0, 1.5])
    answers = (row["labels"] != IGNORE_INDEX).nonzero().flatten()
    first_end = int(answers[int(((answers[1:] - answers[:-1]) > 1).nonzero()[0])]) + 1
    cut, _ = fit_to_length(row, LengthLimit(first_end + 3), processor)
    assert cut["second_per_grid_ts"].tolist() == [1.0] and len(cut["video_grid_thw"]) == 1


def test_qwen2_5_vl_packed_video_records_have_the_losses_they_have_alone(video_records, qwen2_5_vl):
    """Each packed record's rotary index takes its own videos' seconds per patch."""
    model, processor = qwen2_5_vl
    [batch] = packed_losses_equal_alone(model, processor, video_records, [[[1, 2, 0, 3]]])
    assert batch["second_per_grid_ts"].tolist() == pytest.approx([1.0, 1.5])
