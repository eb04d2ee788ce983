"""Loading a vision-language model and its processor the way a real preset loads, and reading its config.

Every model goes through the same door as a real preset (llava-hf/llava-1.5-7b-hf,
Qwen/Qwen2-VL-2B-Instruct): `AutoModelForImageTextToText` + `AutoProcessor`, by hub id or local
directory. The real presets' architecture configs ship with the launcher (`PRESET_CONFIGS`), so planning
and dry runs work without the hub. Also here: image resolution (dynamic-resolution processors) and the
attention kernel a job loads with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor, Qwen2VLProcessor
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

from launcher.core.errors import LauncherError, one_line
from launcher.model.logps import install_answer_logps


def load_model_and_processor(
    path_or_hub_id: str,
    *,
    torch_dtype: torch.dtype | None = None,
    attn_implementation: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    **model_kwargs: Any,
):
    """Load `(model, processor)` from a local directory or a hub id, the way a real preset loads.

    `attn_implementation`: eager | sdpa | flash_attention_2, as `resolve_attn_implementation` resolves
    model.attn_implementation (None: transformers' default). `min_pixels` / `max_pixels`: the pixels per
    image of a dynamic-resolution processor (Qwen2-VL family; None: the processor's own), refused for
    models that resize to one fixed size (LLaVA). `model_kwargs` go to `from_pretrained` as they are
    (e.g. `quantization_config`). Raises LauncherError with a one-line message when the path is neither
    a local model nor fetchable, or when it holds a model that is not an image-text-to-text model.
    """
    config = read_config(path_or_hub_id)
    if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        raise LauncherError(
            f"model.path={path_or_hub_id} is a {config.model_type} model, not an image-text-to-text model"
        )
    tiny = is_tiny_build(Path(path_or_hub_id).expanduser())
    check_pixel_limits(config, min_pixels=min_pixels, max_pixels=max_pixels, tiny=tiny)
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    try:
        if (random := random_build(path_or_hub_id)) is not None:
            model = _random_model(config, random, torch_dtype, model_kwargs)
        else:
            model = AutoModelForImageTextToText.from_pretrained(path_or_hub_id, dtype=torch_dtype, **model_kwargs)
    except (OSError, SafetensorError) as error:
        # No weight files, a truncated or corrupt file, a download that failed.
        raise LauncherError(
            f"model.path={path_or_hub_id}: cannot load its weights ({one_line(error, limit=200)}); copy the complete "
            "model directory again, or save it with save_pretrained"
        ) from error
    install_answer_logps(model)  # the losses' path that never builds the whole logits (launcher.model.logps)
    processor = _load_processor(path_or_hub_id, config)
    set_pixel_limits(processor, min_pixels=min_pixels, max_pixels=max_pixels)
    return model, processor


def _random_model(config: Any, build: dict[str, Any], dtype: torch.dtype | None, kwargs: dict[str, Any]):
    """A random build's model (launcher.model.tiny.build_random_model_dir): its architecture with weights
    drawn from its seed, in `dtype` (default: the released checkpoint's, as from_pretrained gives), made
    on `device_map`'s device when one is given (the GPU initialises 7B weights in a second, the CPU in a
    minute). Under ZeRO-3 (HfDeepSpeedConfig alive) transformers makes them partitioned."""
    if "quantization_config" in kwargs:
        raise LauncherError(
            "model.source=random builds full-precision weights: method=qlora needs a checkpoint to quantise; "
            "use method=lora or method=full"
        )
    device = (kwargs.pop("device_map", None) or {}).get("")
    with torch.random.fork_rng(devices=[]), torch.device(device) if device else contextlib.nullcontext():
        torch.manual_seed(int(build["seed"]))
        return AutoModelForImageTextToText.from_config(config, dtype=dtype or config.dtype, **kwargs)


def without_video_processor(processor_class: type) -> type:
    """The same processor class with no video processor, for images-only use without torchvision.

    In transformers 5.24 every video processor needs torchvision, and processors such as Qwen2-VL's
    refuse to construct without one (even `video_processor=None` fails the class check). The subclass
    keeps the class name, so what it saves is an ordinary directory for that processor; it lives in
    this module under its own qualified name, so it pickles (DataLoader workers that spawn).
    """
    qualname = f"ImagesOnly{processor_class.__name__}"
    if isinstance(existing := globals().get(qualname), type):
        return existing

    class ImagesOnly(processor_class):
        # Not a sub-processor (not in __init__'s signature, so never saved), but present: the processor's call
        # then hands videos to `_process_videos` below instead of dropping them.
        video_processor = None

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # The parent passes video_processor on positionally; ProcessorMixin pairs positional
            # arguments with this class's attributes (image_processor, tokenizer) and drops the extra.
            processor_class.__init__(
                self,
                image_processor=image_processor,
                tokenizer=tokenizer,
                video_processor=None,
                chat_template=chat_template,
                **kwargs,
            )

        def _process_videos(self, videos, **kwargs):
            # Without a video processor the launcher's own makes the pixels (the image processor's resize and
            # normalisation, frames paired into temporal patches): the processor still expands the tokens.
            from launcher.data.video import SECONDS_PER_PATCH, VideoSampling, seconds_per_patch, video_inputs

            processed = video_inputs(self.image_processor, videos)
            # The Qwen2.5-VL family's seconds per temporal patch, from each video's rate (as its own
            # processor computes them from the same metadata).
            metadata = kwargs.get("video_metadata") or [{"fps": VideoSampling.fps}] * len(videos)
            seconds = seconds_per_patch(self, [float(entry["fps"]) for entry in metadata])
            if seconds is not None:
                processed[SECONDS_PER_PATCH] = seconds
            return processed, [self.replace_video_token(processed, video_idx=i) for i in range(len(videos))]

        def replace_video_token(self, video_inputs: dict, video_idx: int, **kwargs) -> str:
            merge = self.image_processor.merge_size
            return self.video_token * int(video_inputs["video_grid_thw"][video_idx].prod() // merge**2)

    ImagesOnly.__name__ = processor_class.__name__  # written to processor_config.json
    ImagesOnly.__qualname__ = qualname
    ImagesOnly.__doc__ = f"{processor_class.__name__} for images only (no video processor, no torchvision)."
    globals()[qualname] = ImagesOnly
    return ImagesOnly


ImagesOnlyQwen2VLProcessor = without_video_processor(Qwen2VLProcessor)


# ----------------------------------------------------------------------------- image resolution
def has_dynamic_resolution(config) -> bool:
    """Whether the model takes images at any size (Qwen2-VL family: patches merged m x m into tokens),
    rather than resizing every image to its vision tower's image_size (LLaVA)."""
    return bool(getattr(getattr(config, "vision_config", None), "spatial_merge_size", None))


def check_pixel_limits(config, *, min_pixels: int | None, max_pixels: int | None, tiny: bool) -> None:
    """Refuse model.min_pixels / model.max_pixels for a model whose image size is fixed (LLaVA)."""
    given = [
        f"model.{key}={value}"
        for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels))
        if value is not None
    ]
    if not given or has_dynamic_resolution(config):
        return
    size = getattr(getattr(config, "vision_config", None), "image_size", "?")
    fix = "leave model.min_pixels and model.max_pixels unset"
    if tiny:
        fix = f"set model.image_size instead, and {fix}"
    raise LauncherError(
        f"{' '.join(given)}: only dynamic-resolution models (the Qwen2-VL family) resize images to a pixel count; "
        f"a {config.model_type} model's image size is its vision tower's image_size ({size} px): {fix}"
    )


def set_pixel_limits(processor, *, min_pixels: int | None, max_pixels: int | None) -> None:
    """Set the pixels per image of a Qwen2-VL-family image processor (None keeps the processor's own).

    transformers 5.24 keeps them as `size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}`;
    each image is resized (smart_resize) to whole merged patches with a pixel count in that range, so
    the number of image tokens follows. Whichever limit is given wins when it crosses the other one."""
    if min_pixels is None and max_pixels is None:
        return
    limits = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    limits = {key: int(value) for key, value in limits.items() if value is not None}
    # A video's frames too: without torchvision the image processor makes them (launcher.data.video.video_inputs),
    # with it the processor's own video processor, which keeps a size of its own.
    for part in (processor.image_processor, getattr(processor, "video_processor", None)):
        if part is None:
            continue
        size = part.size
        part.size = dataclasses.replace(size, **limits) if dataclasses.is_dataclass(size) else {**size, **limits}


# ----------------------------------------------------------------------------- attention and checkpointing
def resolve_attn_implementation(requested: str, *, device_kind: str, precision: str) -> str:
    """The attention kernel to load the model with (model.attn_implementation).

    auto: flash_attention_2 where it can run (a CUDA device, the flash-attn package, bf16 or fp16),
    else sdpa. eager and sdpa run anywhere. flash_attention_2 asked for where it cannot run is refused
    in one line, before any rank starts."""
    requested = str(requested)
    flash_problem = None
    if device_kind != "cuda":
        flash_problem = f"needs a CUDA device (this job runs on {device_kind})"
    elif importlib.util.find_spec("flash_attn") is None:
        flash_problem = "needs the flash-attn package, which is not installed (pip install flash-attn)"
    elif precision not in ("bf16", "fp16"):
        flash_problem = f"runs in bf16 or fp16 only (this job trains in {precision}; precision=bf16 fixes that)"
    if requested == "auto":
        return "sdpa" if flash_problem else "flash_attention_2"
    if requested == "flash_attention_2" and flash_problem:
        raise LauncherError(
            f"model.attn_implementation=flash_attention_2 {flash_problem}: use model.attn_implementation=sdpa "
            "(or auto, which picks flash_attention_2 where it can run)"
        )
    if requested not in ("eager", "sdpa", "flash_attention_2"):
        raise LauncherError(
            f"model.attn_implementation={requested} is unknown: use auto, eager, sdpa or flash_attention_2"
        )
    return requested


# Architecture facts (config.json only, no weights) of the real presets, shipped with the launcher so
# that planning, dry runs and the memory preflight work without the hub. Weights still load by hub id.
PRESET_CONFIGS = Path(__file__).resolve().parent / "presets"


def shipped_config_dir(path_or_hub_id: str) -> Path | None:
    """The shipped config directory of a hub id (None for local paths and other ids)."""
    if Path(path_or_hub_id).expanduser().exists() or not is_hub_id(path_or_hub_id):
        return None
    shipped = PRESET_CONFIGS / path_or_hub_id.replace("/", "--")
    return shipped if (shipped / "config.json").is_file() else None


def is_hub_id(path: str) -> bool:
    """ "org/name", as the hub spells ids (a path like /models/x or ./x is a local directory)."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~"))


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached right now (None when it can): offline mode, or no connection.

    Checked before asking the hub, because huggingface_hub retries an unreachable hub for about 30 s
    before it gives up."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE=1"
    from urllib.parse import urlparse

    endpoint = urlparse(constants.ENDPOINT)
    host, port = endpoint.hostname or "", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    if os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return None  # only the proxy knows; let the request try
    import socket

    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as error:
        return f"{host} is not reachable ({error.strerror or error})"
    return None


def check_hub_model(hub_id: str) -> str | None:
    """Before any rank asks the hub for a model's weights: None when the hub is reachable; when it is not and
    the model is in the local hub cache, the line saying it loads from there (the ranks get HF_HUB_OFFLINE=1:
    no minute of retries first); else LauncherError naming the fix. Asking an unreachable hub costs about a
    minute of retries per file, then advice about copying directories (issue 44)."""
    from huggingface_hub import constants, try_to_load_from_cache

    offline = hub_unreachable()
    if offline is None:
        return None
    cached = try_to_load_from_cache(hub_id, "config.json", cache_dir=constants.HF_HUB_CACHE)
    if isinstance(cached, str):
        os.environ["HF_HUB_OFFLINE"] = "1"  # the ranks inherit it
        return f"model.path={hub_id}: the hub cannot be reached ({offline}); loading it from the local hub cache"
    raise LauncherError(
        f"model.path={hub_id} is a hub id, but the hub cannot be reached ({offline}) and the model is not in the "
        f"local hub cache ({constants.HF_HUB_CACHE}): download it where the hub is reachable (huggingface-cli "
        f"download {hub_id} --local-dir DIR) and give model.path=DIR, or train its shape with random weights "
        "and no download (model.source=random)"
    )


def read_config(path_or_hub_id: str):
    """A model's config: a local directory's, a shipped preset's, or the hub's (one line when it cannot)."""
    local = Path(path_or_hub_id).expanduser()
    source = shipped_config_dir(path_or_hub_id) or local
    if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        # A LoRA run's model/ (peft's adapter directory): transformers would say "Unrecognized model".
        run_dir = local.parent if local.name == "model" else local
        raise LauncherError(
            f"model.path={path_or_hub_id} is a LoRA adapter (adapter_config.json), not a model: fold it into its "
            f"base first (python -m launcher.export {run_dir} --merge) and give the merged folder"
        )
    if not source.exists() and not is_hub_id(path_or_hub_id):
        raise LauncherError(
            f"model.path={path_or_hub_id}: cannot read its config: not found locally and could not be fetched "
            "from the hub (no such directory); give a local directory holding config.json or a reachable hub id"
        )
    if not source.exists():
        offline = hub_unreachable()
        if offline:
            raise LauncherError(
                f"model.path={path_or_hub_id}: cannot read its config: not a local directory, and the hub cannot "
                f"be asked ({offline}); give a local directory holding the model, or run where the hub is reachable"
            )
        source = path_or_hub_id
    try:
        return AutoConfig.from_pretrained(str(source))
    except (OSError, ValueError) as error:
        reason = one_line(error, limit=200)
        where = "there" if local.is_dir() else "from the hub"
        raise LauncherError(
            f"model.path={path_or_hub_id}: cannot read its config {where} ({reason}); give a local directory "
            "holding config.json or a reachable hub id"
        ) from error


def load_processor(path_or_hub_id: str, *, min_pixels: int | None = None, max_pixels: int | None = None):
    """The processor alone, as `load_model_and_processor` loads it (what preparing a job's data needs)."""
    processor = _load_processor(path_or_hub_id, read_config(path_or_hub_id))
    set_pixel_limits(processor, min_pixels=min_pixels, max_pixels=max_pixels)
    return processor


def _load_processor(path_or_hub_id: str, config):
    try:
        return AutoProcessor.from_pretrained(path_or_hub_id)
    except (ImportError, OSError) as error:
        # Qwen2-VL and relatives ask for a video processor, which needs torchvision, and which a directory saved
        # without it lacks (a random build, a run's model/ trained where torchvision was missing): AutoProcessor
        # then fails even where torchvision is installed. Load the same processor without its video half (the
        # launcher makes a video's pixels with the image processor: launcher.data.video.video_inputs).
        processor_class = PROCESSOR_MAPPING.get(type(config), None)
        if processor_class is not None and "video_processor" in processor_class.get_attributes():
            with contextlib.suppress(ImportError, OSError):
                return without_video_processor(processor_class).from_pretrained(path_or_hub_id)
        raise LauncherError(
            f"model.path={path_or_hub_id}: cannot load its processor ({one_line(error, limit=200)}); the directory "
            "needs the processor's files too (tokenizer, processor_config.json: processor.save_pretrained)"
        ) from error


def text_hidden_size(config) -> int:
    """Hidden size of the language model, which for multimodal configs lives in `text_config`."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.hidden_size)


def is_tiny_build(path: Path) -> bool:
    """Whether `path` holds a tiny model built by launcher.model.tiny (its build record is there)."""
    return (path / TINY_BUILD_RECORD).is_file()


def random_build(path_or_hub_id: str) -> dict[str, Any] | None:
    """The build record of a random build (model.source=random: a real architecture without weights), or None."""
    record = Path(path_or_hub_id).expanduser() / RANDOM_BUILD_RECORD
    if not record.is_file():
        return None
    return json.loads(record.read_text())


def made_where_it_trains(path_or_hub_id: str, device: Any, *, zero3: bool) -> dict[str, Any]:
    """The loading keywords that make a random build's weights on the device they train on (outside ZeRO-3,
    which places them itself): a GPU draws them in a second where a CPU takes a minute for 7B, and the two
    draw different weights from one seed, so every copy of a model (a live DPO reference) is made there."""
    if zero3 or random_build(path_or_hub_id) is None:
        return {}
    return {"device_map": {"": device}}


# Written last into a tiny build (launcher.model.tiny); its presence with the same arguments marks it complete.
TINY_BUILD_RECORD = "tiny_build.json"
RANDOM_BUILD_RECORD = "random_build.json"  # the same, for a random build of a real architecture
