"""Videos in records: checked when read, frames sampled and decoded with PyAV in the DataLoader's workers.

A record's video is a file (or its bytes, from a `datasets` column). Reading the records opens each video's
container header (`check_video`): a missing, empty or corrupt file, a container without a video stream, a
codec this build of FFmpeg cannot decode, zero frames, or a video longer than data.video.max_seconds is a bad
record, named in one line (or skipped under data.on_bad_record=skip). Nothing is decoded then.

Frames are sampled by time (`sample_frames`): data.video.fps frames per second of the video, at least
min_frames and at most max_frames, spread evenly over the whole video (the way the Qwen2-VL and LLaVA-Video
recipes sample), and decoded in a worker (`decode_frames`). The choice depends only on the video and these
settings, never on a random draw: a resumed run, another rank, the cache's worker all see the same frames.
Each frame is resized to at most data.video.max_pixels pixels (keeping its aspect) before the model's
processor sees it.

The model takes the sampled frames its own way (`as_model_takes`): the Qwen2-VL family as a video (its
video token, frames paired into temporal patches, `video_grid_thw`: `video_inputs` makes the pixels from
the image processor where the processor has no video processor of its own; the Qwen2.5-VL family also
each video's seconds per patch, `seconds_per_patch`, from the rate its frames were sampled at), the LLaVA
family as images placed where the video was, data.video.grid x grid frames tiled into each
(`frames_as_images`, `tile_frames`).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from launcher.core.errors import LauncherError

VIDEO_PLACEHOLDER = "<video>"


class BadVideoError(LauncherError):
    """A video that cannot train (formats.BadRecordError wraps it with the record's place)."""


@dataclass(frozen=True)
class VideoSampling:
    """Which frames of a video train (data.video, whose ranges launcher.config.ranges checks): `fps` per second
    of video, between `min_frames` and `max_frames`; each at most `max_pixels` pixels (None: as the video has
    them); tiled `grid` x `grid` into each image for a model that takes frames as images (`frames_as_images`)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 32
    max_pixels: int | None = 200_704  # 448 x 448
    max_seconds: float | None = 3600.0  # a longer video is a bad record
    grid: int = 2

    @classmethod
    def of(cls, video: Any) -> VideoSampling:
        """The sampling data.video gives."""
        return cls(
            fps=float(video.fps),
            min_frames=int(video.min_frames),
            max_frames=int(video.max_frames),
            max_pixels=None if video.max_pixels is None else int(video.max_pixels),
            max_seconds=None if video.max_seconds is None else float(video.max_seconds),
            grid=int(video.grid),
        )

    def frame_count(self, seconds: float) -> int:
        """Frames sampled from a video of `seconds`."""
        return int(min(self.max_frames, max(self.min_frames, round(seconds * self.fps))))


@dataclass(frozen=True)
class VideoInfo:
    """What a video's container says of it."""

    frames: int
    seconds: float
    width: int
    height: int
    codec: str


def _open(source: str | bytes) -> Any:
    import av  # imported where videos are met: reading image-only data never loads FFmpeg

    return av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source), mode="r")


def _what(source: str | bytes) -> str:
    return "embedded video" if isinstance(source, bytes) else f"video {source}"


def probe_video(source: str | bytes) -> VideoInfo:
    """The container's facts about its first video stream; BadVideoError when it has none, or none that
    decodes here. Reads headers (and, where the container does not count frames, its packets), no pixels."""
    import av

    what = _what(source)
    if isinstance(source, str):
        path = Path(source)
        if not path.exists():
            raise BadVideoError(f"{what} does not exist")
        if path.is_dir():
            raise BadVideoError(f"{what} is a directory, not a video file")
        if path.stat().st_size == 0:
            raise BadVideoError(f"{what} is empty (0 bytes)")
    elif not source:
        raise BadVideoError(f"{what} is empty (0 bytes)")
    try:
        with _open(source) as container:
            return _facts(container, what, count=True)
    except BadVideoError:
        raise
    except (av.FFmpegError, OSError, ValueError, EOFError) as error:
        raise BadVideoError(f"{what} cannot be opened as a video ({_reason(error)})") from None


def _facts(container: Any, what: str, *, count: bool) -> VideoInfo:
    """The facts of an open container's first video stream. Where the container does not count its frames
    (webm, some mkv), `count` counts the packets (reading the file to its end); without it, 0 frames."""
    import av

    if not container.streams:
        raise BadVideoError(f"{what} holds no stream at all (a truncated or damaged file?)")
    if not container.streams.video:
        kinds = sorted({stream.type for stream in container.streams})
        raise BadVideoError(f"{what} has no video stream ({' and '.join(kinds)} only)")
    stream = container.streams.video[0]
    codec = stream.codec_context.name if stream.codec_context is not None else None
    if not codec or codec not in av.codecs_available:
        raise BadVideoError(f"{what}: its codec {codec or stream.codec_tag!r} cannot be decoded here")
    frames = int(stream.frames or 0)
    if not frames and not count:
        return VideoInfo(frames=0, seconds=0.0, width=0, height=0, codec=codec)
    rate = stream.average_rate or stream.guessed_rate
    seconds = float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0
    if not frames:
        frames = sum(1 for packet in container.demux(stream) if packet.size)
    if not seconds and container.duration:
        seconds = container.duration / 1_000_000
    if not seconds and rate:
        seconds = frames / float(rate)
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if frames <= 0:
        raise BadVideoError(f"{what} has no frames")
    if width <= 0 or height <= 0:
        raise BadVideoError(f"{what} has no frame size ({width}x{height})")
    return VideoInfo(frames=frames, seconds=seconds, width=width, height=height, codec=codec)


def check_video(source: str | bytes, sampling: VideoSampling) -> VideoInfo:
    """`probe_video`, and the video's length within data.video.max_seconds."""
    info = probe_video(source)
    if sampling.max_seconds is not None and info.seconds > sampling.max_seconds:
        every = info.seconds / sampling.max_frames
        raise BadVideoError(
            f"{_what(source)} is {info.seconds:.0f} s long, over data.video.max_seconds={sampling.max_seconds:g} "
            f"(at data.video.max_frames={sampling.max_frames} a frame every {every:.0f} s): cut it into clips, or "
            "raise the limit"
        )
    return info


def sample_frames(info: VideoInfo, sampling: VideoSampling) -> list[int]:
    """The indices of the frames that train: `frame_count` of them, evenly over the whole video (the first
    and the last included); a video with fewer frames than wanted repeats some."""
    count = sampling.frame_count(info.seconds)
    if count == 1:
        return [info.frames // 2]
    return np.linspace(0, info.frames - 1, count).round().astype(int).tolist()


@dataclass(frozen=True)
class Clip:
    """A video's sampled frames (RGB, in time order) and how many of them there are per second of the
    video (`fps`: what the Qwen2.5-VL family's rotary time counts, `seconds_per_patch`)."""

    frames: list[Image.Image]
    fps: float


def decode_frames(source: str | bytes, sampling: VideoSampling) -> list[Image.Image]:
    """The sampled frames of a video (`decode_clip`)."""
    return decode_clip(source, sampling).frames


def decode_clip(source: str | bytes, sampling: VideoSampling) -> Clip:
    """The sampled frames of a video as RGB images, each within sampling.max_pixels, and their rate;
    BadVideoError when the video does not decode (a truncated file, a damaged stream)."""
    import av

    what = _what(source)
    decoded: dict[int, Image.Image] = {}
    index, info, needed = -1, None, set()
    try:
        container = _open(source)
    except (av.FFmpegError, OSError, ValueError, EOFError) as error:
        raise BadVideoError(f"{what} cannot be opened as a video ({_reason(error)})") from None
    try:
        info = _facts(container, what, count=False)  # one open: the header, then the frames
        if not info.frames:  # the container counts no frames: count them first, then read it again
            container.close()
            info = probe_video(source)
            container = _open(source)
        wanted = sample_frames(info, sampling)
        needed, last = set(wanted), max(wanted)
        # FFmpeg's own threads stay off, the decoder's and the scaler's to RGB (PyAV's defaults ask both for a
        # thread per core): the DataLoader's workers decode videos side by side already, and in a forked worker
        # the scaler's pool once never woke, so the cache build waited there for good.
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        for index, frame in enumerate(container.decode(stream)):
            if index in needed:
                decoded[index] = _within(frame.to_image(threads=1), sampling.max_pixels)
            if index >= last:
                break
    except (av.FFmpegError, OSError, ValueError, EOFError) as error:
        listed = f" of the {info.frames} its header lists" if info is not None else ""
        raise BadVideoError(
            f"{what} fails to decode at frame {index + 2}{listed} ({_reason(error)}): a truncated or damaged file?"
        ) from None
    finally:
        container.close()
    if len(decoded) < len(needed):
        # The container promised more frames than the stream holds (a file cut short): the missing ones are
        # the last sampled, and evenly spread frames of what is there would be another sampling altogether.
        raise BadVideoError(
            f"{what} ends after {index + 1} of the {info.frames} frames its header lists (a truncated file?)"
        )
    # Frames per second of video as transformers' VideoMetadata.sampled_fps counts them (frames / duration);
    # a container that gives no duration: the rate asked for.
    fps = len(wanted) / info.seconds if info.seconds > 0 else sampling.fps
    return Clip([decoded[i] for i in wanted], fps)


def _within(image: Image.Image, max_pixels: int | None) -> Image.Image:
    """The frame, scaled down (aspect kept) to at most `max_pixels` pixels."""
    image = image.convert("RGB")
    if max_pixels is None or image.width * image.height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (image.width * image.height))
    size = (max(1, math.floor(image.width * scale)), max(1, math.floor(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def _reason(error: BaseException) -> str:
    """FFmpeg's own words (PyAV's message repeats the file's name after them)."""
    text = getattr(error, "strerror", None) or str(error).strip() or type(error).__name__
    return text.splitlines()[0][:200]


def write_video(path: Path, frames: list[np.ndarray], fps: int = 4, codec: str = "libx264") -> Path:
    """Frames (H x W x 3 uint8, even sides) encoded into a video file, written atomically: the built-in
    video task's and the tests' videos."""
    import av

    height, width = frames[0].shape[:2]
    partial = path.with_name(f".{path.name}.partial")
    container_format = _container_of(path)
    # mp4's index up front (faststart), as files made for the web have it: a reader needs no seek to its end.
    options = {"movflags": "faststart"} if container_format == "mp4" else {}
    with av.open(str(partial), mode="w", format=container_format, options=options) as container:
        stream = container.add_stream(codec, rate=Fraction(fps))
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p" if codec != "mjpeg" else "yuvj420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "crf": "18"}
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    partial.replace(path)
    return path


def _container_of(path: Path) -> str:
    return {".mp4": "mp4", ".mkv": "matroska", ".webm": "webm", ".avi": "avi", ".mov": "mov"}.get(
        path.suffix.lower(), "mp4"
    )


# ----------------------------------------------------------------------------- videos as the model takes them
def takes_videos(processor: Any) -> bool:
    """Whether the model takes a video as a video (the Qwen2-VL family: a video token its processor expands,
    frames paired into temporal patches, `video_grid_thw`); otherwise each video's frames go in as images
    (`frames_as_images`: LLaVA)."""
    image_processor = getattr(processor, "image_processor", None)
    return getattr(processor, "video_token", None) is not None and all(
        hasattr(image_processor, name) for name in ("temporal_patch_size", "merge_size", "patch_size")
    )


def video_inputs(image_processor: Any, videos: list[list[Image.Image]]) -> dict[str, Any]:
    """`pixel_values_videos` and `video_grid_thw` of sampled videos, as the Qwen2-VL family's video processor
    lays them out, made with the model's image processor (so no torchvision): each frame resized,
    rescaled and normalised as an image, then `temporal_patch_size` frames in a row stacked into each
    patch (the last frame repeated to fill the last group, as the video processor does). A video's
    frames share its size, so one grid (t, h, w) per video; rows (t x h x w, C x T x P x P), in the
    merged-window order of the image processor's own rows."""
    import torch  # the pure reading of videos above does not need it

    temporal, patch = int(image_processor.temporal_patch_size), int(image_processor.patch_size)
    pixels, grids = [], []
    for frames in videos:
        frames = list(frames) + [frames[-1]] * (-len(frames) % temporal)
        out = image_processor(frames, temporal_patch_size=1, return_tensors="pt")
        rows, frame_grids = out["pixel_values"], out["image_grid_thw"]
        if len({tuple(grid.tolist()) for grid in frame_grids}) != 1:
            raise BadVideoError(f"a video's frames come in {len(frame_grids)} sizes: its frames must share one")
        _, height, width = (int(n) for n in frame_grids[0])
        steps, channels = len(frames) // temporal, rows.shape[1] // (patch * patch)
        # (frames, patches, C, P, P) -> (steps, patches, C, temporal, P, P): each patch's frames side by side.
        grouped = rows.reshape(steps, temporal, height * width, channels, patch, patch).permute(0, 2, 3, 1, 4, 5)
        pixels.append(grouped.reshape(steps * height * width, channels * temporal * patch * patch))
        grids.append([steps, height, width])
    return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": torch.tensor(grids, dtype=torch.int64)}


def video_pixels(processor: Any, videos: list[list[Image.Image]], fps: list[float]) -> dict[str, Any]:
    """The model's tensors of sampled videos (each `fps` frames per second of video): its processor's own
    video processor where it has one (transformers' need torchvision), frames taken as sampled (no sampling
    of its own), else `video_inputs` with its image processor; and each video's seconds per temporal patch
    where the model places patches in time (`seconds_per_patch`)."""
    import torch

    video_processor = getattr(processor, "video_processor", None)
    if video_processor is None:
        out = video_inputs(processor.image_processor, videos)
    else:
        made = video_processor(videos=videos, do_sample_frames=False, return_tensors="pt")
        out = {key: made[key] for key in ("pixel_values_videos", "video_grid_thw")}
    seconds = seconds_per_patch(processor, fps)
    if seconds is not None:
        out[SECONDS_PER_PATCH] = torch.tensor(seconds)
    return out


# The processors' name for a video's seconds per temporal patch (Qwen2.5-VL's `second_per_grid_ts`).
SECONDS_PER_PATCH = "second_per_grid_ts"


def takes_model_dtype(key: str, value: Any) -> bool:
    """Whether a batch tensor goes to the model in its dtype (bf16 where it trains in bf16): floating inputs,
    the pixels, do; a video's seconds per temporal patch stay fp32, as the processor makes them (the rotary
    time index multiplies them)."""
    return value.is_floating_point() and key != SECONDS_PER_PATCH


def seconds_per_patch(processor: Any, fps: list[float]) -> list[float] | None:
    """Seconds of video one temporal patch spans, per video sampled at `fps` frames per second: where the
    model places a video's patches in absolute time (the Qwen2.5-VL family: its rotary time index moves
    tokens_per_second x these per patch), else None (Qwen2-VL counts patches). Without them transformers
    takes 1 s, right only at 2 frames per second: data.video's min_frames and max_frames change a video's
    rate (a 60 s video at 32 frames: 3.75 s per patch)."""
    if SECONDS_PER_PATCH not in getattr(processor, "model_input_names", ()):
        return None
    source = getattr(processor, "video_processor", None) or processor.image_processor
    temporal = int(source.temporal_patch_size)
    return [temporal / rate for rate in fps]


def frames_metadata(videos: list[list[Any]], fps: list[float]) -> list[dict[str, Any]]:
    """transformers' video metadata of videos whose frames are already sampled: all of each video's frames,
    at its sampled rate (so its `sampled_fps` is that rate, which Qwen2.5-VL's processor turns into seconds
    per patch; without it the processor takes 24 frames per second)."""
    return [
        {"fps": rate, "total_num_frames": len(frames), "frames_indices": list(range(len(frames)))}
        for frames, rate in zip(videos, fps, strict=True)
    ]


def media_in_order(messages: list[dict], images: list[Any], videos: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """(source, frames) per image or video part of a record, in the order of its parts (0 frames: an image):
    what the data cache stores of it. `images`: the image sources in order; `videos`: (source, frames
    sampled) per video in order."""
    image_iter, video_iter = iter(images), iter(videos)
    kinds = [part["type"] for message in messages for part in message["content"]]
    return [next(video_iter) if kind == "video" else (next(image_iter), 0) for kind in kinds if kind in MEDIA_PARTS]


MEDIA_PARTS = ("image", "video")


def frames_as_images(sample: dict) -> dict:
    """A decoded sample as a model that takes images sees its videos: each video part becomes image parts in
    place, its sampled frames tiled grid x grid into each (`tile_frames`; the sample's "video_grid",
    data.video.grid), and `images` holds every image and tile in the order of their parts. A sample without
    videos, as it is."""
    if not sample.get("videos"):
        return sample
    grid = int(sample.get("video_grid", VideoSampling.grid))
    image_iter, video_iter = iter(sample["images"]), iter(sample["videos"])
    messages: list[dict] = []
    pictures: list[Image.Image] = []
    for message in sample["messages"]:
        content = []
        for part in message["content"]:
            if part["type"] == "video":
                tiles = tile_frames(next(video_iter), grid)
                content += [{"type": "image"}] * len(tiles)
                pictures += tiles
            elif part["type"] == "image":
                content.append(part)
                pictures.append(next(image_iter))
            else:
                content.append(part)
        messages.append({**message, "content": content})
    rest = {k: v for k, v in sample.items() if k not in ("videos", "video_fps", "video_grid")}
    return {**rest, "messages": messages, "images": pictures}


def tile_frames(frames: list[Image.Image], grid: int) -> list[Image.Image]:
    """A video's frames as images of grid x grid frames each, in time order along each row, then down (the
    image grids of IG-VLM): a model of images then sees grid^2 frames in one image, its vision tower
    relating them (where a frame's content is, and when), at the cost of one image's tokens; the last
    image's cells past the video's end black. A frame is 1/grid of the image's side once the processor
    resizes it. grid 1: each frame an image of its own."""
    if grid == 1:
        return list(frames)
    width, height = frames[0].size
    per_image = grid * grid
    tiles = []
    for start in range(0, len(frames), per_image):
        canvas = Image.new("RGB", (grid * width, grid * height))
        for cell, frame in enumerate(frames[start : start + per_image]):
            canvas.paste(frame, ((cell % grid) * width, (cell // grid) * height))
        tiles.append(canvas)
    return tiles


def images_per_video(frames: int, grid: int) -> int:
    """Images a video of `frames` sampled frames becomes where frames are tiled grid x grid (`tile_frames`)."""
    return -(-frames // (grid * grid))


def as_model_takes(sample: dict, processor: Any) -> dict:
    """The sample as the model takes it: its videos as videos where the model takes them (`takes_videos`),
    else as their frames placed as images (`frames_as_images`)."""
    return sample if takes_videos(processor) else frames_as_images(sample)
