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
    them)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 32
    max_pixels: int | None = 200_704  # 448 x 448
    max_seconds: float | None = 3600.0  # a longer video is a bad record

    @classmethod
    def of(cls, video: Any) -> VideoSampling:
        """The sampling data.video gives."""
        return cls(
            fps=float(video.fps),
            min_frames=int(video.min_frames),
            max_frames=int(video.max_frames),
            max_pixels=None if video.max_pixels is None else int(video.max_pixels),
            max_seconds=None if video.max_seconds is None else float(video.max_seconds),
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


def decode_frames(source: str | bytes, sampling: VideoSampling) -> list[Image.Image]:
    """The sampled frames of a video as RGB images, each within sampling.max_pixels; BadVideoError when the
    video does not decode (a truncated file, a damaged stream)."""
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
        # FFmpeg's own threads stay off: the DataLoader's workers decode videos side by side already.
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in needed:
                decoded[index] = _within(frame.to_image(), sampling.max_pixels)
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
    return [decoded[i] for i in wanted]


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


def frames_as_images(
    messages: list[dict], images: list[tuple[Any, Image.Image]], videos: list[tuple[Any, list[Image.Image]]]
) -> tuple[list[dict], list[Image.Image], list[tuple[Any, int]]]:
    """A decoded record as a model that takes images sees its videos: each video part becomes one image part
    per sampled frame, in place (the frames in time order, nothing pooled: a frame costs an image's tokens).

    `images`: (source, decoded image) per image part, in order; `videos`: (source, sampled frames) per video
    part, in order. Returns the messages, every image and frame in the order of their parts, and (source,
    frames) per image or video in that order (0 frames: an image), which the data cache stores."""
    image_iter, video_iter = iter(images), iter(videos)
    out_messages: list[dict] = []
    pictures: list[Image.Image] = []
    media: list[tuple[Any, int]] = []
    for message in messages:
        content = []
        for part in message["content"]:
            if part["type"] == "video":
                source, frames = next(video_iter)
                content += [{"type": "image"}] * len(frames)
                pictures += frames
                media.append((source, len(frames)))
            elif part["type"] == "image":
                source, picture = next(image_iter)
                content.append(part)
                pictures.append(picture)
                media.append((source, 0))
            else:
                content.append(part)
        out_messages.append({**message, "content": content})
    return out_messages, pictures, media
