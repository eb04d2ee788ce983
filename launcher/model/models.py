"""Vision-language models: tiny random-init builds for CPU jobs, loading by path or hub id, freezing.

Every model goes through the same door as a real preset (llava-hf/llava-1.5-7b-hf,
Qwen/Qwen2-VL-2B-Instruct): `AutoModelForImageTextToText` + `AutoProcessor`. The tiny builds are
saved to a directory with `save_pretrained` so nothing downstream knows they are tiny.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from launcher.core.errors import LauncherError

TINY_ARCHITECTURES = ("tiny_llava", "tiny_qwen2_vl")

# Written last into a tiny build; its presence with the same arguments marks the build complete.
_MARKER = "tiny_build.json"
# Bump when the build recipe changes, so cached builds from an older recipe are rebuilt.
_RECIPE_VERSION = 1

# LLaVA-1.5 style: "USER: <image>\nwhat is in the image? ASSISTANT: red circle</s>". The generation
# prompt ("ASSISTANT:") is an exact prefix of the rendered assistant turn, and each assistant turn
# ends with eos, so a model trained on it learns to stop.
_LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | upper }}:"
    "{%- if message['content'] is string -%}{{ ' ' + message['content'] }}"
    "{%- else -%}{{ ' ' }}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<image>\\n' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- else -%}{{ ' ' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}ASSISTANT:{%- endif -%}"
)

# Qwen2-VL style (ChatML) without the default system prompt.
_QWEN2_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_start|>{{ message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "<|im_end|>{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>{{ 'assistant\\n' }}{%- endif -%}"
)

_LLAVA_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<image>"]
_QWEN2_VL_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


def build_tiny_model_dir(
    arch: str,
    out_dir: Path,
    vocabulary_texts: list[str],
    *,
    seed: int,
    hidden_size: int,
    num_layers: int,
    vision_hidden_size: int,
    vision_layers: int,
    image_size: int,
    patch_size: int,
) -> Path:
    """Build a random-init model + processor and save them to `out_dir`; return `out_dir`.

    The directory loads with plain `AutoModelForImageTextToText` / `AutoProcessor`. The tokenizer is a
    byte-level BPE trained in-process on `vocabulary_texts`, so every word of a small data set is one
    token (an answer like "red circle" is two tokens) while any text still encodes. Deterministic given
    the arguments. A complete build for the same arguments is reused (it is a cache); a build is written
    to a temporary directory and renamed into place, so a crash never leaves a directory that looks
    complete.
    """
    if arch not in TINY_ARCHITECTURES:
        raise LauncherError(f"model.arch={arch} is not a tiny architecture; choose one of {TINY_ARCHITECTURES}")
    if image_size % patch_size:
        raise LauncherError(f"model image_size={image_size} must be a multiple of patch_size={patch_size}")
    if arch == "tiny_qwen2_vl" and (image_size // patch_size) % 2:
        raise LauncherError(
            f"tiny_qwen2_vl merges 2x2 patches: image_size/patch_size={image_size // patch_size} must be even"
        )
    out_dir = Path(out_dir)
    arguments = {
        "arch": arch,
        "recipe_version": _RECIPE_VERSION,
        "transformers": transformers.__version__,
        "vocabulary_sha256": hashlib.sha256("\n".join(vocabulary_texts).encode()).hexdigest(),
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "vision_hidden_size": vision_hidden_size,
        "vision_layers": vision_layers,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    if _read_marker(out_dir) == arguments:
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        build = _build_tiny_llava if arch == "tiny_llava" else _build_tiny_qwen2_vl
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, processor = build(vocabulary_texts, **{k: arguments[k] for k in _SIZE_KEYS})
        model.save_pretrained(tmp_dir)
        processor.save_pretrained(tmp_dir)
        if arch == "tiny_qwen2_vl":
            _write_qwen2_vl_video_config(tmp_dir, image_size=image_size, patch_size=patch_size)
        (tmp_dir / _MARKER).write_text(json.dumps(arguments, indent=2) + "\n")
        _move_into_place(tmp_dir, out_dir, arguments)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


_SIZE_KEYS = (
    "hidden_size",
    "num_layers",
    "vision_hidden_size",
    "vision_layers",
    "image_size",
    "patch_size",
)


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / _MARKER).read_text())
    except (OSError, ValueError):
        return None


def _move_into_place(tmp_dir: Path, out_dir: Path, arguments: dict[str, Any]) -> None:
    """Rename the finished build onto `out_dir`, replacing a stale or half-written one.

    Several ranks may build the same directory at once: whoever renames first wins and the others
    keep the winner's (identical) build.
    """
    if out_dir.exists() and _read_marker(out_dir) != arguments:
        shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.rename(tmp_dir, out_dir)
    except OSError:
        if _read_marker(out_dir) != arguments:
            raise


def _train_tokenizer(vocabulary_texts: list[str], special_tokens: list[str], extra_words: list[str]) -> Tokenizer:
    """Byte-level BPE on the texts: frequent words become single tokens, anything else still encodes."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + len(special_tokens) + 2048,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=alphabet,
        show_progress=False,
    )
    texts = [text.replace("<image>", " ") for text in vocabulary_texts] + extra_words
    words = sorted({word for text in texts for word in text.split()})
    # Every text and word both at the start of a turn and after a space, so that "red" and " red"
    # both become single tokens whichever template puts them where.
    corpus = [form for piece in texts + words for form in (piece, " " + piece)]
    tokenizer.train_from_iterator(corpus * 2, trainer)
    return tokenizer


def _without_video_processor(processor_class: type) -> type:
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

    ImagesOnly.__name__ = processor_class.__name__  # written to processor_config.json
    ImagesOnly.__qualname__ = qualname
    ImagesOnly.__doc__ = f"{processor_class.__name__} for images only (no video processor, no torchvision)."
    globals()[qualname] = ImagesOnly
    return ImagesOnly


ImagesOnlyQwen2VLProcessor = _without_video_processor(Qwen2VLProcessor)


def _build_tiny_llava(
    vocabulary_texts: list[str],
    *,
    hidden_size: int,
    num_layers: int,
    vision_hidden_size: int,
    vision_layers: int,
    image_size: int,
    patch_size: int,
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    bpe = _train_tokenizer(vocabulary_texts, _LLAVA_SPECIAL_TOKENS, ["USER:", "ASSISTANT:", "SYSTEM:"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens={"image_token": "<image>"},
        chat_template=_LLAVA_CHAT_TEMPLATE,
    )
    token_id = tokenizer.convert_tokens_to_ids
    num_patches = (image_size // patch_size) ** 2
    vision_config = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=4 * vision_hidden_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=max(1, vision_hidden_size // 32),
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden_size,
    )
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=max(1, hidden_size // 32),
        num_key_value_heads=max(1, hidden_size // 32),
        max_position_embeddings=2048,
        pad_token_id=token_id("<pad>"),
        bos_token_id=token_id("<s>"),
        eos_token_id=token_id("</s>"),
    )
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=token_id("<image>"),
        image_seq_length=num_patches,
        # The last layer's features: with a 2-layer tower the usual -2 would leave a layer unused.
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(config)
    _set_generation_tokens(model, tokenizer)
    image_processor = CLIPImageProcessorPil(
        size={"height": image_size, "width": image_size},
        crop_size={"height": image_size, "width": image_size},
        do_center_crop=False,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        # The CLIP tower prepends a CLS token that "default" drops again: without this the processor
        # writes one image token fewer than the model has features.
        num_additional_image_tokens=1,
        chat_template=_LLAVA_CHAT_TEMPLATE,
    )
    return model, processor


def _build_tiny_qwen2_vl(
    vocabulary_texts: list[str],
    *,
    hidden_size: int,
    num_layers: int,
    vision_hidden_size: int,
    vision_layers: int,
    image_size: int,
    patch_size: int,
) -> tuple[Qwen2VLForConditionalGeneration, Qwen2VLProcessor]:
    bpe = _train_tokenizer(vocabulary_texts, _QWEN2_VL_SPECIAL_TOKENS, ["user", "assistant", "system"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=_QWEN2_VL_CHAT_TEMPLATE,
    )
    token_id = tokenizer.convert_tokens_to_ids
    heads = max(1, hidden_size // 32)
    head_dim = hidden_size // heads
    # Multimodal RoPE splits each head's rotary half (head_dim / 2) into temporal/height/width sections.
    half = head_dim // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    config = Qwen2VLConfig(
        vision_config={
            "depth": vision_layers,
            "embed_dim": vision_hidden_size,
            "hidden_size": hidden_size,
            "num_heads": max(1, vision_hidden_size // 32),
            "mlp_ratio": 4,
            "patch_size": patch_size,
            "spatial_merge_size": 2,
            # Still images only: one frame per patch, so pixel_values are not duplicated in time.
            "temporal_patch_size": 1,
        },
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": hidden_size,
            "intermediate_size": 4 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
            "bos_token_id": None,
            "eos_token_id": token_id("<|im_end|>"),
            "pad_token_id": token_id("<|endoftext|>"),
        },
        image_token_id=token_id("<|image_pad|>"),
        video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"),
        vision_end_token_id=token_id("<|vision_end|>"),
    )
    model = Qwen2VLForConditionalGeneration(config)
    _set_generation_tokens(model, tokenizer)
    # min = max pixels: every image is resized to image_size x image_size, i.e.
    # (image_size / patch_size)^2 patches, merged 2x2 into a handful of language tokens.
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=image_size * image_size,
        max_pixels=image_size * image_size,
        patch_size=patch_size,
        temporal_patch_size=1,
        merge_size=2,
    )
    processor = ImagesOnlyQwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=_QWEN2_VL_CHAT_TEMPLATE
    )
    return model, processor


def _write_qwen2_vl_video_config(out_dir: Path, *, image_size: int, patch_size: int) -> None:
    """Add the video half of a Qwen2-VL processor by hand (building a video processor needs torchvision).

    Nested in processor_config.json, as transformers 5 saves it, so that plain
    `AutoProcessor.from_pretrained` finds it where torchvision is installed; videos are never fed.
    """
    path = out_dir / "processor_config.json"
    processor_config = json.loads(path.read_text())
    processor_config["video_processor"] = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": patch_size,
        "temporal_patch_size": 1,
        "merge_size": 2,
        "size": {"shortest_edge": image_size * image_size, "longest_edge": image_size * image_size},
    }
    path.write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n")


def _set_generation_tokens(model: nn.Module, tokenizer: PreTrainedTokenizerFast) -> None:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id


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
    tiny = _read_marker(Path(path_or_hub_id).expanduser()) is not None
    check_pixel_limits(config, min_pixels=min_pixels, max_pixels=max_pixels, tiny=tiny)
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForImageTextToText.from_pretrained(path_or_hub_id, dtype=torch_dtype, **model_kwargs)
    except (OSError, SafetensorError) as error:
        # No weight files, a truncated or corrupt file, a download that failed.
        raise LauncherError(
            f"model.path={path_or_hub_id}: cannot load its weights ({_first_line(error)}); copy the complete "
            "model directory again, or save it with save_pretrained"
        ) from error
    processor = _load_processor(path_or_hub_id, config)
    set_pixel_limits(processor, min_pixels=min_pixels, max_pixels=max_pixels)
    return model, processor


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
    image_processor = processor.image_processor
    size = image_processor.size
    limits = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    limits = {key: int(value) for key, value in limits.items() if value is not None}
    if dataclasses.is_dataclass(size):
        image_processor.size = dataclasses.replace(size, **limits)
    else:
        image_processor.size = {**size, **limits}


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


def enable_gradient_checkpointing(model: nn.Module, *, language: bool, vision: bool) -> list[str]:
    """Checkpoint the layers of the language model and/or the vision tower; return the parts enabled.

    Non-reentrant (`use_reentrant=False`): a checkpointed layer keeps only its inputs and recomputes its
    activations in the backward pass. Unlike the reentrant kind, it passes gradients to parameters
    inside a layer whose inputs need none, so frozen embeddings, a frozen vision tower and LoRA
    adapters on a frozen base need no `enable_input_require_grads` hook (transformers adds one for
    the language model; it is removed again). Works on a peft model as on the model it wraps.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parts = model_components(base)
    enabled = []
    for name, wanted, key in (
        ("language", language, "model.gradient_checkpointing"),
        ("vision", vision, "model.vision_gradient_checkpointing"),
    ):
        if not wanted:
            continue
        module = parts[name][0]
        if not getattr(module, "supports_gradient_checkpointing", False):
            raise LauncherError(
                f"{key}=true: {type(module).__name__} ({name}) does not support gradient checkpointing; set {key}=false"
            )
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        module.disable_input_require_grads()
        enabled.append(name)
    return enabled


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


def read_config(path_or_hub_id: str):
    """A model's config: a local directory's, a shipped preset's, or the hub's (one line when it cannot)."""
    local = Path(path_or_hub_id).expanduser()
    source = shipped_config_dir(path_or_hub_id) or local
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
        reason = _first_line(error)
        where = "there" if local.is_dir() else "from the hub"
        raise LauncherError(
            f"model.path={path_or_hub_id}: cannot read its config {where} ({reason}); give a local directory "
            "holding config.json or a reachable hub id"
        ) from error


def _load_processor(path_or_hub_id: str, config):
    try:
        return AutoProcessor.from_pretrained(path_or_hub_id)
    except (ImportError, OSError) as error:
        # Qwen2-VL and relatives ask for a video processor, which needs torchvision. Images are all
        # this launcher feeds, so without torchvision load the same processor without its video half.
        processor_class = PROCESSOR_MAPPING.get(type(config), None)
        if (
            processor_class is None
            or "video_processor" not in processor_class.get_attributes()
            or importlib.util.find_spec("torchvision") is not None
        ):
            raise LauncherError(
                f"model.path={path_or_hub_id}: cannot load its processor ({_first_line(error)}); the directory "
                "needs the processor's files too (tokenizer, processor_config.json: processor.save_pretrained)"
            ) from error
        return _without_video_processor(processor_class).from_pretrained(path_or_hub_id)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def text_hidden_size(config) -> int:
    """Hidden size of the language model, which for multimodal configs lives in `text_config`."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.hidden_size)


def model_components(model: nn.Module) -> dict[str, list[nn.Module]]:
    """The model's vision encoder, projector and language model (decoder + lm_head), as module lists.

    LLaVA: model.vision_tower / model.multi_modal_projector / model.language_model + lm_head.
    Qwen2-VL: model.visual (whose `merger` is the projector) / model.language_model + lm_head.
    """
    inner = getattr(model, "model", model)
    vision = _first_attribute(inner, "vision_tower", "visual")
    projector = _first_attribute(inner, "multi_modal_projector") or _first_attribute(vision, "merger")
    language = _first_attribute(inner, "language_model")
    if vision is None or projector is None or language is None:
        raise LauncherError(
            f"{type(model).__name__}: cannot find its vision tower, projector and language model "
            "(known layouts: LLaVA, Qwen2-VL)"
        )
    language_modules = [language]
    if (head := model.get_output_embeddings()) is not None:
        language_modules.append(head)
    return {"vision": [vision], "projector": [projector], "language": language_modules}


def _first_attribute(module: nn.Module | None, *names: str) -> nn.Module | None:
    for name in names:
        if isinstance(found := getattr(module, name, None), nn.Module):
            return found
    return None


def _parameters(modules: list[nn.Module], exclude: set[int] = frozenset()) -> dict[int, nn.Parameter]:
    return {id(p): p for module in modules for p in module.parameters() if id(p) not in exclude}


def _numel(parameter: nn.Parameter) -> int:
    # Under ZeRO-3 a partitioned parameter is empty locally; DeepSpeed keeps the full size in ds_numel.
    return int(getattr(parameter, "ds_numel", parameter.numel()))


def apply_freeze(model: nn.Module, *, vision: bool, projector: bool, language: bool) -> dict[str, int]:
    """Freeze the chosen components (requires_grad=False) and return parameter counts.

    Returns {"vision", "projector", "language", "trainable", "total"}; a parameter shared between
    components (tied embeddings) is counted once, in the first component that holds it.
    """
    freeze = {"vision": vision, "projector": projector, "language": language}
    counts: dict[str, int] = {}
    seen: set[int] = set()
    # The projector first: for Qwen2-VL it sits inside the vision module and must not count as vision.
    for name, modules in sorted(model_components(model).items(), key=lambda item: item[0] != "projector"):
        parameters = _parameters(modules, exclude=seen)
        seen.update(parameters)
        counts[name] = sum(_numel(p) for p in parameters.values())
        if freeze[name]:
            for parameter in parameters.values():
                parameter.requires_grad_(False)
    unique = _parameters([model])
    counts["trainable"] = sum(_numel(p) for p in unique.values() if p.requires_grad)
    counts["total"] = sum(_numel(p) for p in unique.values())
    return {key: counts[key] for key in ("vision", "projector", "language", "trainable", "total")}


def component_parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameter counts per component, as `apply_freeze` returns them, without freezing anything."""
    return apply_freeze(model, vision=False, projector=False, language=False)


def resolve_model_path(model: Any, seed: int, cache: Path, records: list[dict[str, Any]]) -> str:
    """A hub id or directory to load; a tiny model is built (once, then cached) from the data's words.

    `model` is the model config; `seed` (train.seed) initialises a tiny model's weights."""
    if model.source == "pretrained":
        return str(model.path)
    from launcher.data.formats import record_texts

    texts = sorted({text for record in records for text in record_texts(record)})
    dims = {
        "hidden_size": model.hidden_size,
        "num_layers": model.num_layers,
        "vision_hidden_size": model.vision_hidden_size,
        "vision_layers": model.vision_layers,
        "image_size": model.image_size,
        "patch_size": model.patch_size,
    }
    key = hashlib.sha256(json.dumps([str(model.arch), seed, dims, texts]).encode()).hexdigest()[:12]
    out = cache / "models" / f"{model.arch}-{key}"
    return str(build_tiny_model_dir(str(model.arch), out, texts, seed=seed, **dims))
