"""Records with videos: each format reads them into the one form, bad videos are one line each, and frames are
sampled by time, the same every time (launcher/data/video.py)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from launcher.core.errors import LauncherError
from launcher.data.formats import ReadOptions, read_records
from launcher.data.index import indexed_records
from launcher.data.video import VideoSampling, decode_frames, probe_video, sample_frames, write_video
from tests.unit.data.samples import write_image

ANSWER = "it moves left"


def frames(count: int, size: tuple[int, int] = (32, 48)) -> list[np.ndarray]:
    """Frames whose grey level says their index (10 levels apart, codecs keep it within a few; up to 25)."""
    return [np.full((*size, 3), 10 * index % 250, dtype=np.uint8) for index in range(count)]


def frame_levels(images) -> list[int]:
    return [round(float(np.asarray(image).mean()) / 10) for image in images]


@pytest.fixture
def clip(tmp_path: Path) -> Path:
    """12 frames at 4 per second: 3 s."""
    return write_video(tmp_path / "clip.mp4", frames(12), fps=4)


def read(path: Path, **options) -> tuple[list[dict], int, str]:
    return read_records(path, ReadOptions(**options))


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_a_video_record_reads_alike_in_every_format(tmp_path, clip):
    """LLaVA-Video's "video" key, LLaMA-Factory's "videos" with "<video>" markers, OpenAI-style video parts and
    LLaMA-Factory v1's video_url parts: one normalised record, its video part where the record puts it."""
    write_image(tmp_path / "a.png")
    question, clip_name = "which way?", clip.name
    rows = {
        "llava": {"image": "a.png", "video": clip_name, "conversations": [
            {"from": "human", "value": f"<image><video>\n{question}"}, {"from": "gpt", "value": ANSWER}]},
        "sharegpt": {"images": ["a.png"], "videos": [clip_name], "messages": [
            {"role": "user", "content": f"<image><video>{question}"}, {"role": "assistant", "content": ANSWER}]},
        "messages": {"messages": [
            {"role": "user", "content": [
                {"type": "image", "image": "a.png"}, {"type": "video", "video": clip_name},
                {"type": "text", "text": question}]},
            {"role": "assistant", "content": ANSWER}]},
        "openai": {"messages": [
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "a.png"}},
                {"type": "video_url", "video_url": {"url": clip_name}}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]},
        "v1": {"messages": [
            {"role": "user", "content": [
                {"type": "image_url", "value": "a.png"}, {"type": "video_url", "value": clip_name},
                {"type": "text", "value": question}]},
            {"role": "assistant", "content": [{"type": "text", "value": ANSWER}]}]},
        "listed": {"images": ["a.png"], "videos": [clip_name], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": ANSWER}]},
    }  # fmt: skip
    expected = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]},
    ]
    for name, row in rows.items():
        (record,), skipped, _ = read(write_rows(tmp_path / f"{name}.jsonl", [row]))
        assert skipped == 0, name
        assert record["messages"] == expected, name
        assert record["images"] == [str(tmp_path / "a.png")], name
        assert record["videos"] == [str(clip)], name


def test_without_markers_images_then_videos_go_before_the_first_question(tmp_path, clip):
    write_image(tmp_path / "a.png")
    row = {"images": ["a.png"], "videos": [clip.name, clip.name], "messages": [
        {"role": "user", "content": "what happens?"}, {"role": "assistant", "content": ANSWER}]}  # fmt: skip
    (record,), _, _ = read(write_rows(tmp_path / "data.jsonl", [row]))
    kinds = [part["type"] for part in record["messages"][0]["content"]]
    assert kinds == ["image", "video", "video", "text"]
    assert record["videos"] == [str(clip)] * 2


def test_image_records_hold_no_videos_key_and_the_record_index_keeps_both(tmp_path, clip):
    """An image-only record is what it was before videos were read (no "videos"); the memory-mapped record
    index gives back each record as read, videos and embedded video bytes included."""
    write_image(tmp_path / "a.png")
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}]},
        {"video": clip.name, "conversations": [{"from": "human", "value": "<video>x"}, {"from": "gpt", "value": "y"}]},
    ]
    path = write_rows(tmp_path / "data.jsonl", rows)
    read_back, _, _ = read(path)
    assert "videos" not in read_back[0] and read_back[1]["videos"] == [str(clip)]
    indexed, _, _ = indexed_records(str(path), ReadOptions(), tmp_path / "index")
    assert [dict(record) for record in indexed] == read_back


def test_a_split_whose_only_video_comes_after_the_sample_is_still_cached_encoded(tmp_path, clip, model_and_processor):
    """data.cache_images=auto decides from a sample of the first 1,000 records, but a video anywhere in the
    split keeps it encoded (its frames are never decoded onto disk): looked up in the index's videos column."""
    from launcher.data.cache import image_storage
    from launcher.data.index import Records, holds_videos

    write_image(tmp_path / "a.png")
    image = {"image": "a.png", "conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}]}
    video = {
        "video": clip.name,
        "conversations": [{"from": "human", "value": "<video>x"}, {"from": "gpt", "value": "y"}],
    }
    for rows, expected in (([image] * 1500, False), ([image] * 1500 + [video], True)):
        path = write_rows(tmp_path / f"data{len(rows)}.jsonl", rows)
        indexed, _, _ = indexed_records(str(path), ReadOptions(), tmp_path / "index")
        records = Records([indexed])
        assert holds_videos(records) is expected and holds_videos(list(records)) is expected
        sample = [records[i] for i in range(1000)]
        assert not any(record.get("videos") for record in sample)
        storage = image_storage("auto", model_and_processor[1], sample, len(records), videos=holds_videos(records))
        assert storage == ("encoded" if expected else "pixels")


def test_a_parquet_video_column_of_paths_or_bytes_reads(tmp_path, clip):
    datasets = pytest.importorskip("datasets")
    rows = {
        "videos": [[str(clip)], [{"bytes": clip.read_bytes(), "path": None}]],
        "messages": [[{"role": "user", "content": "<video>which way?"}, {"role": "assistant", "content": ANSWER}]] * 2,
    }
    features = datasets.Features(
        {
            "videos": datasets.List(datasets.Video()),
            "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        }
    )
    path = tmp_path / "videos.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    records, skipped, fmt = read(path, cache_dir=tmp_path / "hf")
    assert (len(records), skipped, fmt) == (2, 0, "sharegpt")
    assert records[0]["videos"] == [str(clip)] and records[1]["videos"] == [clip.read_bytes()]
    options = VideoSampling(fps=2, min_frames=2, max_frames=8)
    assert frame_levels(decode_frames(records[1]["videos"][0], options)) == [0, 2, 4, 7, 9, 11]


def bad_video_cases(tmp_path: Path, clip: Path) -> dict[str, tuple[str, str]]:
    """name -> (the video, what its one line says)."""
    (tmp_path / "empty.mp4").write_bytes(b"")
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all" * 50)
    (tmp_path / "cut.mp4").write_bytes(clip.read_bytes()[:40])  # inside its header
    (tmp_path / "folder.mp4").mkdir()
    _audio_only(tmp_path / "sound.wav")
    _no_frames(tmp_path / "none.mkv")
    write_video(tmp_path / "long.mp4", frames(40), fps=4)  # 10 s, over the 5 s the tests allow
    return {
        "missing": ("nope.mp4", "nope.mp4 does not exist"),
        "empty": ("empty.mp4", "empty.mp4 is empty (0 bytes)"),
        "not a video": ("junk.mp4", "junk.mp4 cannot be opened as a video (Invalid data found"),
        "header cut short": ("cut.mp4", "cut.mp4 holds no stream at all (a truncated or damaged file?)"),
        "a folder": ("folder.mp4", "folder.mp4 is a directory"),
        "sound only": ("sound.wav", "sound.wav has no video stream (audio only)"),
        "no frames": ("none.mkv", "none.mkv cannot be opened as a video (End of file)"),
        "too long": ("long.mp4", "long.mp4 is 10 s long, over data.video.max_seconds=5"),
        "outside the root": ("../elsewhere.mp4", "video path '../elsewhere.mp4' leaves the image root"),
        "a URL": ("https://example.com/v.mp4", "is a URL; videos are not downloaded"),
    }


def _audio_only(path: Path) -> None:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)


def _no_frames(path: Path) -> None:
    import av

    with av.open(str(path), mode="w") as container:  # a header and no frame
        stream = container.add_stream("mpeg4", rate=Fraction(4))
        stream.width, stream.height = 32, 32
        container.start_encoding()


def test_each_bad_video_is_one_line_naming_the_record_or_is_skipped_and_listed(tmp_path, clip):
    cases = bad_video_cases(tmp_path, clip)
    good = {"video": clip.name, "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}
    for name, (video, says) in cases.items():
        row = {**good, "video": video}
        path = write_rows(tmp_path / "one.jsonl", [good, row])
        options = {"video": VideoSampling(max_seconds=5)}
        with pytest.raises(LauncherError) as refused:
            read(path, **options)
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"{path}:2 (record 1): "), (name, line)
        assert says in line, (name, line)
        log: list[dict] = []
        records, skipped, _ = read_records(path, ReadOptions(on_bad_record="skip", **options), log)
        assert (len(records), skipped) == (1, 1), name
        assert log[0]["record"] == 1 and says in log[0]["reason"], name


def test_a_video_cut_short_of_its_header_fails_when_its_frames_are_decoded(tmp_path):
    """An mp4 cut short keeps its header (the index up front) and opens: reading with `decode`
    (data.on_bad_record=skip without the data cache) decodes the sampled frames and finds it."""
    whole = write_video(tmp_path / "clip.mp4", frames(40), fps=4).read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(whole[: int(len(whole) * 0.8)])
    assert probe_video(str(cut)).frames == 40
    row = {"video": cut.name, "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}
    path = write_rows(tmp_path / "cut.jsonl", [row])
    read(path)  # the header is whole
    with pytest.raises(
        LauncherError,
        match=r"record 0\): video .*cut.mp4 (ends after \d+ of the 40 frames|fails to decode at frame \d+ of the 40)",
    ):
        read(path, decode=True)


@pytest.mark.parametrize(
    ("seconds", "sampling", "count"),
    [
        (3.0, VideoSampling(fps=2, min_frames=2, max_frames=8), 6),  # by fps
        (3.0, VideoSampling(fps=2, min_frames=2, max_frames=4), 4),  # capped
        (3.0, VideoSampling(fps=0.5, min_frames=4, max_frames=8), 4),  # at least min_frames
        (600.0, VideoSampling(fps=2, min_frames=4, max_frames=32), 32),
    ],
)
def test_frames_are_sampled_by_time_within_the_budget_evenly_over_the_video(seconds, sampling, count):
    from launcher.data.video import VideoInfo

    info = VideoInfo(frames=int(seconds * 4), seconds=seconds, width=48, height=32, codec="h264")
    chosen = sample_frames(info, sampling)
    assert len(chosen) == count and chosen[0] == 0 and chosen[-1] == info.frames - 1
    steps = np.diff(chosen)
    assert steps.max() - steps.min() <= 1  # evenly
    assert sample_frames(info, sampling) == chosen  # no draw: a resume, another rank, a worker see the same


def test_decoded_frames_are_the_sampled_ones_within_the_pixel_budget(tmp_path):
    clip = write_video(tmp_path / "big.mp4", frames(12, size=(96, 128)), fps=4)
    sampling = VideoSampling(fps=2, min_frames=2, max_frames=8, max_pixels=3_072)
    decoded = decode_frames(str(clip), sampling)
    assert frame_levels(decoded) == [0, 2, 4, 7, 9, 11]
    assert {image.size for image in decoded} == {(64, 48)}  # 128 x 96 scaled by 1/2: 3,072 pixels, aspect kept
    assert frame_levels(decode_frames(clip.read_bytes(), sampling)) == [0, 2, 4, 7, 9, 11]
    for codec, suffix in (("libvpx-vp9", ".webm"), ("mjpeg", ".avi")):  # containers that count no frames, others
        other = write_video(tmp_path / f"clip{suffix}", frames(12), fps=4, codec=codec)
        assert probe_video(str(other)).frames == 12
        assert frame_levels(decode_frames(str(other), sampling)) == [0, 2, 4, 7, 9, 11], codec


def test_decoding_starts_no_thread_of_ffmpeg(tmp_path):
    """Neither the decoder nor the scaler to RGB starts threads (PyAV's defaults start a pool per core for each,
    4 more threads here): the DataLoader's workers decode side by side, and in a forked worker the scaler's pool
    once never woke, hanging a cache build. Every thread of this process is counted while a clip decodes."""
    import os
    import threading
    import time

    rng = np.random.default_rng(0)
    noisy = [rng.integers(0, 256, (256, 256, 3), dtype=np.uint8) for _ in range(16)]  # work enough to thread
    clip = write_video(tmp_path / "noisy.mp4", noisy, fps=8)
    before, most, done = len(os.listdir("/proc/self/task")), [0], threading.Event()

    def count() -> None:
        while not done.is_set():
            most[0] = max(most[0], len(os.listdir("/proc/self/task")))
            time.sleep(0.0005)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        decoded = decode_frames(str(clip), VideoSampling(min_frames=8, max_frames=16))
    finally:
        done.set()
        counter.join()
    assert len(decoded) >= 8
    assert most[0] == before + 1, f"{most[0] - before - 1} threads started while decoding"  # +1: the counter
