"""Vision-language models built from code: random init, a tokenizer trained on the data's words.

For CPU jobs and tests (model.source=tiny): a tiny LLaVA (CLIP-style vision tower, Llama-style language
model) or Qwen2-VL, built once per (architecture, dimensions, seed, vocabulary) into cache_dir/models and
reused. The build is saved with `save_pretrained`, so it loads through the same door as a real preset
(launcher.model.loading) and nothing downstream knows it is tiny.

For benches, the planner's checks and GPU rows at the shapes users train (model.source=random): a real
preset's architecture (model.path's config: every width, head, key-value group, vocabulary and the
vision tower, so the parameter count is the released checkpoint's) with random weights and a local
tokenizer, without a download. The build directory holds the config, tokenizer and processor and no
weights: the ranks initialise the weights from train.seed as they load it (from_config; under ZeRO-3
partitioned as they are made). The tokenizer is small, the model's vocabulary keeps its real width.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLProcessor,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLProcessor,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from launcher.config.schema import ModelConfig
from launcher.core.builds import build_once
from launcher.core.errors import LauncherError
from launcher.data.formats import record_texts
from launcher.model.loading import TINY_BUILD_RECORD, ImagesOnlyQwen2VLProcessor, without_video_processor

TINY_ARCHITECTURES = ("tiny_llava", "tiny_qwen2_vl")


# Written last into a tiny build; its presence with the same arguments marks the build complete.
_MARKER = TINY_BUILD_RECORD


# Bump when the build recipe changes, so cached builds from an older recipe are rebuilt. 2: tiny_qwen2_vl
# pairs frames in its patches (temporal_patch_size 2) and its chat template renders videos.
_RECIPE_VERSION = 2


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
    "{%- elif part['type'] == 'video' -%}<|vision_start|><|video_pad|><|vision_end|>"
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


def resolve_model_path(model: ModelConfig, seed: int, cache: Path, records: Iterable[dict[str, Any]]) -> str:
    """The hub id or directory a job loads (a local directory absolute: adapters and checkpoints name it as
    their base); a tiny model, or a random one of model.path's architecture, is built (once, then cached)
    from the words of `records`, with weights initialised from `seed` (train.seed)."""
    if str(model.source) == "pretrained":
        local = Path(str(model.path)).expanduser()
        return str(local.resolve()) if local.is_dir() else str(model.path)
    texts = sorted({text for record in records for text in record_texts(record)})
    if str(model.source) == "random":
        preset = str(model.path)
        key = hashlib.sha256(json.dumps([preset, seed, texts]).encode()).hexdigest()[:12]
        out = cache / "models" / f"{preset.strip('/').replace('/', '--')}-random-{key}"
        return str(build_random_model_dir(preset, out, texts, seed=seed))
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
    return build_once(out_dir, arguments, _MARKER, lambda where: _write_build(where, vocabulary_texts, arguments))


def _write_build(out_dir: Path, vocabulary_texts: list[str], arguments: dict[str, Any]) -> None:
    """The model and processor of `arguments` (their weights from its seed), saved into `out_dir` (build_once
    writes the record of what was built, and of every file, last)."""
    arch = arguments["arch"]
    build = _build_tiny_llava if arch == "tiny_llava" else _build_tiny_qwen2_vl
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(arguments["seed"])
        model, processor = build(vocabulary_texts, **{k: arguments[k] for k in _SIZE_KEYS})
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    if arch == "tiny_qwen2_vl":
        _write_qwen2_vl_video_config(out_dir, image_size=arguments["image_size"], patch_size=arguments["patch_size"])


_SIZE_KEYS = (
    "hidden_size",
    "num_layers",
    "vision_hidden_size",
    "vision_layers",
    "image_size",
    "patch_size",
)


# Longer runs of non-space characters are cut to this before the tokenizer trains: no such word becomes one
# token of a 2,048-merge vocabulary anyway, and the trainer's cost grows with a word's length times its
# merges, in Rust, where no stop signal is seen (issue 42: one 200,000-character answer took 26 s).
MAX_WORD_CHARS = 64
_LONG_WORD = re.compile(rf"\S{{{MAX_WORD_CHARS + 1},}}")


def tokenizer_corpus(vocabulary_texts: list[str], extra_words: list[str]) -> list[str]:
    """What the tokenizer trains on: every text and word, each at the start of a turn and after a space (so
    that "red" and " red" both become single tokens whichever template puts them where), words capped."""
    texts = [
        _LONG_WORD.sub(lambda m: m.group(0)[:MAX_WORD_CHARS], text.replace("<image>", " ")) for text in vocabulary_texts
    ]
    texts += extra_words
    words = sorted({word for text in texts for word in text.split()})
    return [form for piece in texts + words for form in (piece, " " + piece)]


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
    tokenizer.train_from_iterator(tokenizer_corpus(vocabulary_texts, extra_words) * 2, trainer)
    return tokenizer


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
    vision_config = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=4 * vision_hidden_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=max(1, vision_hidden_size // 32),
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden_size,
    )
    model = LlavaForConditionalGeneration(_llava_config(tokenizer, vision_config, hidden_size, num_layers))
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


def _llava_config(
    tokenizer: PreTrainedTokenizerFast, vision_config: CLIPVisionConfig, hidden_size: int, num_layers: int
) -> LlavaConfig:
    token_id = tokenizer.convert_tokens_to_ids
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
    return LlavaConfig(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=token_id("<image>"),
        image_seq_length=(vision_config.image_size // vision_config.patch_size) ** 2,
        # The last layer's features: with a 2-layer tower the usual -2 would leave a layer unused.
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )


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
    vision_config = {
        "depth": vision_layers,
        "embed_dim": vision_hidden_size,
        "hidden_size": hidden_size,
        "num_heads": max(1, vision_hidden_size // 32),
        "mlp_ratio": 4,
        "patch_size": patch_size,
        "spatial_merge_size": 2,
        # Two frames per patch, as the released models: a video's frames are paired in each patch (motion is
        # then a local feature of one patch), and a still image is repeated to fill its two.
        "temporal_patch_size": 2,
    }
    model = Qwen2VLForConditionalGeneration(_qwen2_vl_config(tokenizer, vision_config, hidden_size, num_layers))
    _set_generation_tokens(model, tokenizer)
    # min = max pixels: every image is resized to image_size x image_size, i.e.
    # (image_size / patch_size)^2 patches, merged 2x2 into a handful of language tokens.
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=image_size * image_size,
        max_pixels=image_size * image_size,
        patch_size=patch_size,
        temporal_patch_size=2,
        merge_size=2,
    )
    processor = ImagesOnlyQwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=_QWEN2_VL_CHAT_TEMPLATE
    )
    return model, processor


def _qwen2_vl_config(
    tokenizer: PreTrainedTokenizerFast, vision_config: dict[str, Any], hidden_size: int, num_layers: int
) -> Qwen2VLConfig:
    token_id = tokenizer.convert_tokens_to_ids
    heads = max(1, hidden_size // 32)
    head_dim = hidden_size // heads
    # Multimodal RoPE splits each head's rotary half (head_dim / 2) into temporal/height/width sections.
    half = head_dim // 2
    mrope_section = [half - 2 * (half // 3), half // 3, half // 3]
    return Qwen2VLConfig(
        vision_config=vision_config,
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


def _write_qwen2_vl_video_config(out_dir: Path, *, image_size: int, patch_size: int) -> None:
    """Add the video half of a Qwen2-VL processor by hand (building a video processor needs torchvision).

    Nested in processor_config.json, as transformers 5 saves it, so that plain
    `AutoProcessor.from_pretrained` finds it where torchvision is installed. The launcher makes a video's
    pixels itself (launcher.data.video.video_inputs), with the image processor.
    """
    path = out_dir / "processor_config.json"
    processor_config = json.loads(path.read_text())
    processor_config["video_processor"] = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "size": {"shortest_edge": image_size * image_size, "longest_edge": image_size * image_size},
    }
    path.write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n")


def _set_generation_tokens(model: nn.Module, tokenizer: PreTrainedTokenizerFast) -> None:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id


# ----------------------------------------------------------------------------- real shapes, random weights
# The config keys that name a token, per family, and the local tokenizer's token each takes.
_QWEN_TOKEN_KEYS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|image_pad|>",
    "bos_token_id": None,
    "eos_token_id": "<|im_end|>",
    "pad_token_id": "<|endoftext|>",
}
_LLAVA_TOKEN_KEYS = {
    "image_token_index": "<image>",
    "bos_token_id": "<s>",
    "eos_token_id": "</s>",
    "pad_token_id": "<pad>",
}
# What the released Qwen2-VL processors resize an image to (preprocessor_config.json): 4 to 16,384 merged tokens.
_QWEN_MIN_PIXELS, _QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def build_random_model_dir(path_or_hub_id: str, out_dir: Path, vocabulary_texts: list[str], *, seed: int) -> Path:
    """A directory that loads as `path_or_hub_id`'s architecture with random weights (initialised from
    `seed` when loaded, launcher.model.loading) and a tokenizer trained on `vocabulary_texts`: config,
    tokenizer and processor, no weights. Cached like a tiny build (the same arguments reuse it)."""
    from launcher.model.loading import RANDOM_BUILD_RECORD, read_config

    config = read_config(path_or_hub_id)
    family = config.model_type
    if family not in ("llava", "qwen2_vl", "qwen2_5_vl"):
        raise LauncherError(
            f"model.source=random: model.path={path_or_hub_id} is a {family} model; random builds cover the "
            "llava, qwen2_vl and qwen2_5_vl families"
        )
    arguments = {
        "from": path_or_hub_id,
        "recipe_version": _RECIPE_VERSION,
        "transformers": transformers.__version__,
        "vocabulary_sha256": hashlib.sha256("\n".join(vocabulary_texts).encode()).hexdigest(),
        "seed": seed,
    }

    def write(where: Path) -> None:
        processor = _real_family_processor(config, vocabulary_texts)
        tokenizer = processor.tokenizer
        # The token ids name the local tokenizer's tokens; the vocabulary keeps its real width.
        keys = _LLAVA_TOKEN_KEYS if family == "llava" else _QWEN_TOKEN_KEYS
        text = config.get_text_config()
        for key, token in keys.items():
            value = None if token is None else tokenizer.convert_tokens_to_ids(token)
            if key in config.to_dict():
                setattr(config, key, value)
            if text is not config and key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                setattr(text, key, value)
        config.save_pretrained(where)
        processor.save_pretrained(where)

    return build_once(Path(out_dir), arguments, RANDOM_BUILD_RECORD, write)


def _real_family_processor(config: Any, vocabulary_texts: list[str]) -> Any:
    """The processor of a real family's architecture (its released image settings) over a local tokenizer."""
    vision = config.vision_config
    if config.model_type == "llava":
        bpe = _train_tokenizer(vocabulary_texts, _LLAVA_SPECIAL_TOKENS, ["USER:", "ASSISTANT:", "SYSTEM:"])
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
            extra_special_tokens={"image_token": "<image>"}, chat_template=_LLAVA_CHAT_TEMPLATE,
        )  # fmt: skip
        size = int(vision.image_size)
        image_processor = CLIPImageProcessorPil(
            size={"shortest_edge": size}, crop_size={"height": size, "width": size}, do_center_crop=True
        )
        return LlavaProcessor(
            image_processor=image_processor, tokenizer=tokenizer, patch_size=int(vision.patch_size),
            vision_feature_select_strategy=config.vision_feature_select_strategy, num_additional_image_tokens=1,
            chat_template=_LLAVA_CHAT_TEMPLATE,
        )  # fmt: skip
    bpe = _train_tokenizer(vocabulary_texts, _QWEN2_VL_SPECIAL_TOKENS, ["user", "assistant", "system"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>", chat_template=_QWEN2_VL_CHAT_TEMPLATE
    )
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=_QWEN_MIN_PIXELS, max_pixels=_QWEN_MAX_PIXELS, patch_size=int(vision.patch_size),
        temporal_patch_size=int(vision.temporal_patch_size), merge_size=int(vision.spatial_merge_size),
    )  # fmt: skip
    processor_class = Qwen2_5_VLProcessor if config.model_type == "qwen2_5_vl" else Qwen2VLProcessor
    return without_video_processor(processor_class)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=_QWEN2_VL_CHAT_TEMPLATE
    )
