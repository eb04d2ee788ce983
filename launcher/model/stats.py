"""What the memory estimates need to know about a model, read from its config without its weights.

The model is built on the meta device from its config (a shipped preset's, a local directory's, a
tiny build's), its parameters are counted per component with the configured freezing, and its
shapes (hidden sizes, layers, image tokens) are collected into a `ModelStats`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.config.compose import compose
from launcher.config.schema import Config, freeze_flags, typed
from launcher.config.stages import parts_by_stage, training_parts
from launcher.core.errors import LauncherError, one_line
from launcher.data.records import read_data
from launcher.data.stream import VOCABULARY_RECORDS, stream_head
from launcher.model.components import apply_freeze
from launcher.model.loading import check_pixel_limits, read_config
from launcher.model.method import apply_method, parameter_counts, tiny_base_task, trainable_components, uses_adapters
from launcher.model.tiny import resolve_model_path


@dataclass(frozen=True)
class TransformerDims:
    """The shapes activations depend on, for one stack of transformer layers."""

    hidden: int
    layers: int
    intermediate: int
    kv_width: int = 0  # key/value width (heads x head dim); 0: as wide as hidden
    gated: bool = False  # SwiGLU-style MLP (gate, up, down) rather than fc1, act, fc2


@dataclass(frozen=True)
class ModelStats:
    """What the estimates need to know about a model: counts and shapes, no weights."""

    name: str
    total: int  # unique parameters (tied weights once)
    trainable: int
    components: Mapping[str, int]  # vision / projector / language parameters
    frozen: tuple[str, ...]  # frozen components
    largest_layer: int  # the most parameters one module owns directly (DeepSpeed's "largest layer")
    param_sizes: tuple[int, ...]  # every parameter's element count (stage-3 persistence)
    text: TransformerDims
    vocab_size: int
    vision: TransformerDims
    vision_tokens: int  # vision-tower tokens per image
    image_tokens: int  # language-model tokens per image
    projector_width: int  # elements the projector keeps per language-model image token
    # Frames of a video per image's tokens and vision-tower work: the Qwen2-VL family takes a video as a video,
    # its frames paired in each patch (temporal_patch_size 2); a model of images takes them tiled
    # data.video.grid x grid into each image (launcher.data.video.tile_frames; grid 1: a frame each).
    frames_per_image: int = 1
    load_bytes: int = 4  # bytes per parameter of the checkpoint as it is loaded into CPU memory
    checkpointed: tuple[str, ...] = ()  # components whose layers are checkpointed: language, vision
    method: str = "full"  # what trains: full, lora, qlora (adapters: `trainable` counts them)
    loss_chunk: int = 0  # loss.chunk_tokens: answer tokens per pass through the output layer (0: whole logits)
    kernels: str = "torch"  # model.kernels: torch, or liger (its fused loss: launcher.model.kernels)

    def persistent(self, threshold: int) -> int:
        """Parameters stage 3 keeps whole on every rank: those of at most `threshold` elements."""
        return sum(size for size in self.param_sizes if size <= threshold)


def model_dir(cfg: Config) -> str:
    """The hub id or directory of the model a job trains (launcher.model.tiny.resolve_model_path).

    A tiny model is built here from the data's vocabulary (cached under cache_dir): the launcher builds
    it once, and the ranks and the memory planner read the same build."""
    model = cfg.model
    if str(model.source) == "pretrained":
        if not model.path:
            raise LauncherError(f"model.path is empty for model={model.name}: give a hub id or a local directory")
        return resolve_model_path(model, int(cfg.train.seed), Path(), [])
    cache = Path(cfg.cache_dir).expanduser().absolute()
    loaded = read_data(cfg.data, cache)
    train = loaded.train
    if cfg.data.streaming:  # not read before training: the vocabulary comes from the stream's first records
        train = stream_head(loaded.sources[0].path, loaded.sources[0].options, VOCABULARY_RECORDS)
    return resolve_model_path(
        model, int(cfg.train.seed), cache, itertools.chain(train, loaded.eval, _base_task_records(cfg, cache))
    )


def _base_task_records(cfg: Config, cache: Path) -> Iterable[dict[str, Any]]:
    """The records of the built-in question a tiny base is pretrained on (model.tiny_base, launcher.launch.base),
    whose words the tiny model's tokenizer must hold whole too: a word it splits comes back from generation
    spelt otherwise (a base pretrained on the shape question with the colour question's tokenizer scored 0.000
    exact match at a held-out loss of 0.008)."""
    task = tiny_base_task(cfg)
    if task is None or (cfg.data.synthetic and str(cfg.data.task) == task):
        return []
    if cfg.data.synthetic:
        data = dataclasses.replace(cfg.data, task=task)
    else:  # the built-in set as the base is pretrained on it: its defaults
        data = typed(compose(["data=shapes", f"data.task={task}"])).data
    loaded = read_data(data, cache)
    return itertools.chain(loaded.train, loaded.eval)


def meta_model(cfg: Config, path: str | None = None):
    """(config, model): the model `train.py` would train, built on the meta device from its config."""
    import torch
    from transformers import AutoModelForImageTextToText

    path = path or model_dir(cfg)
    config = read_config(path)
    try:
        with torch.device("meta"):
            return config, AutoModelForImageTextToText.from_config(config)
    except ValueError as err:
        raise LauncherError(f"model.path={path}: not an image-text-to-text model ({one_line(err)})") from None


def frozen_meta_model(cfg: Config):
    """The meta-device model with the freeze flags applied: what a method adapts."""

    _, model = meta_model(cfg)
    apply_freeze(model, **freeze_flags(cfg.model))
    return model


def heaviest_stage(cfg: Config, *, path: str | None = None) -> tuple[str, ...] | None:
    """What the stage of train.stages that trains the most parameters trains (a tie: the later stage);
    None without stages. The planner, preflight and the tuner plan that stage."""
    heaviest = _heaviest_stage(cfg, path)
    return None if heaviest is None else heaviest[0]


def _heaviest_stage(cfg: Config, path: str | None) -> tuple[tuple[str, ...], ModelStats] | None:
    """(what it trains, its stats) of the stage that trains the most parameters; None without stages."""
    stages = parts_by_stage(getattr(cfg.train, "stages", None))
    if not stages:
        return None
    each = [(parts, model_stats(training_parts(cfg, parts), path=path)) for parts in stages]
    return max(reversed(each), key=lambda stage: stage[1].trainable)


def model_stats(cfg: Config, *, path: str | None = None) -> ModelStats:
    """Build the model on the meta device from its config and count what the estimates need.

    With train.stages, the stage that trains the most parameters: the one that needs the most memory (its
    optimizer states and gradients; activations are kept for what trains)."""
    heaviest = _heaviest_stage(cfg, path)
    if heaviest is not None:
        return heaviest[1]

    path = path or model_dir(cfg)
    config, model = meta_model(cfg, path)
    freeze = freeze_flags(cfg.model)
    counts = apply_freeze(model, **freeze)
    if uses_adapters(cfg.method):  # LoRA on the meta model: adapters counted, nothing allocated
        model = apply_method(model, cfg.method, cfg.model).get_base_model()
        counts = parameter_counts(model, held=True)  # memory holds peft's frozen originals too
        trains = trainable_components(model)
        freeze = {name: name not in trains for name in freeze}
    try:
        return _stats(cfg, config, model, counts, freeze)
    except AttributeError as err:  # a config without the fields of the layouts known here
        raise LauncherError(
            f"model.path={path}: the memory planner does not know the layout of {type(config).__name__} ({err}); "
            "set preflight=off to train without the estimate"
        ) from None


def _stats(cfg: Config, config, model, counts: dict[str, int], freeze: dict[str, bool]) -> ModelStats:
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())
    names = [name for name, _ in model.named_modules()]

    def gated(*parts: str) -> bool:
        return any(name.endswith("gate_proj") and any(part in name for part in parts) for name in names)

    text_config = config.get_text_config()
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    text = TransformerDims(
        hidden=text_config.hidden_size,
        layers=text_config.num_hidden_layers,
        intermediate=text_config.intermediate_size,
        kv_width=(getattr(text_config, "num_key_value_heads", None) or heads) * head_dim,
        gated=gated("language_model"),
    )
    vision_config = config.vision_config
    vision_hidden = getattr(vision_config, "embed_dim", None) or vision_config.hidden_size
    vision = TransformerDims(
        hidden=vision_hidden,
        layers=getattr(vision_config, "num_hidden_layers", None) or vision_config.depth,
        intermediate=getattr(vision_config, "intermediate_size", None) or int(vision_config.mlp_ratio * vision_hidden),
        gated=gated("visual", "vision_tower"),
    )
    vision_tokens, image_tokens, merge = _image_tokens(cfg, config)
    return ModelStats(
        name=str(cfg.model.name),
        total=counts["total"],
        trainable=counts["trainable"],
        components={key: counts[key] for key in ("vision", "projector", "language")},
        frozen=tuple(name for name, frozen in freeze.items() if frozen),
        largest_layer=int(largest),
        param_sizes=tuple(int(p.numel()) for p in model.parameters()),
        text=text,
        vocab_size=int(text_config.vocab_size),
        vision=vision,
        vision_tokens=vision_tokens,
        image_tokens=image_tokens,
        projector_width=2 * (vision_hidden * merge * merge + text.hidden),
        frames_per_image=(
            int(getattr(vision_config, "temporal_patch_size", 1) or 1) if merge > 1 else int(cfg.data.video.grid) ** 2
        ),
        load_bytes=_dtype_bytes(getattr(config, "dtype", None)),
        method=str(cfg.method.name),
        loss_chunk=int(cfg.loss.chunk_tokens),
        kernels=str(cfg.model.kernels),
        checkpointed=tuple(
            name
            for name, key in (("language", "gradient_checkpointing"), ("vision", "vision_gradient_checkpointing"))
            if getattr(cfg.model, key)
        ),
    )


def _dtype_bytes(dtype: Any) -> int:
    name = str(dtype or "float32").removeprefix("torch.")
    return {"float16": 2, "bfloat16": 2, "half": 2}.get(name, 4)


def _image_tokens(cfg: Config, config) -> tuple[int, int, int]:
    """(vision-tower tokens, language-model tokens, patch merge) for one image.

    LLaVA: (image_size / patch)^2 patches, plus CLIP's class token in the tower; the "default"
    feature strategy drops it again. Qwen2-VL (dynamic resolution): a square image of plan.image_size
    pixels (default 448; a tiny model's own image size) rounded to whole merged patches; the merger
    turns m x m patches into one language-model token. With model.min_pixels / model.max_pixels set,
    the image is resized as the processor resizes it (Qwen2-VL's smart_resize): its pixel count is
    brought into [min_pixels, max_pixels] (an unset limit: the processor's own, a tiny model's
    image_size^2 or Qwen2-VL's 56^2 and 28^2 x 1280).
    """

    vision_config = config.vision_config
    patch = vision_config.patch_size
    merge = getattr(vision_config, "spatial_merge_size", None)
    tiny = str(cfg.model.source) == "tiny"
    min_pixels, max_pixels = cfg.model.min_pixels, cfg.model.max_pixels
    check_pixel_limits(config, min_pixels=min_pixels, max_pixels=max_pixels, tiny=tiny)
    if merge:
        side = cfg.plan.image_size or (cfg.model.image_size if tiny else 448)
        unit = patch * merge
        if min_pixels is None and max_pixels is None:
            patches = (max(1, round(side / unit)) * merge) ** 2
        else:
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            own = (cfg.model.image_size**2,) * 2 if tiny else (56 * 56, 28 * 28 * 1280)
            height, width = smart_resize(
                side,
                side,
                factor=unit,
                min_pixels=min_pixels if min_pixels is not None else own[0],
                max_pixels=max_pixels if max_pixels is not None else own[1],
            )
            patches = (height // patch) * (width // patch)
        return patches, patches // (merge * merge), merge
    patches = (vision_config.image_size // patch) ** 2
    cls = 1 if str(getattr(vision_config, "model_type", "")).startswith("clip") else 0
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    return patches + cls, patches + (cls if strategy == "full" else 0), 1


@dataclass(frozen=True)
class RecordShapes:
    """What each record of a job's train split holds, as its built data cache keeps it
    (launcher.plan.data.record_shapes): the tokens and images a micro batch really holds."""

    lengths: Any  # np.ndarray: language-model tokens per record (image tokens included), cut to data.max_length
    images: Any  # np.ndarray: images per record (a video as the images its frames make)
    patches: Any = None  # np.ndarray: vision-tower patches per record (the Qwen2-VL family), else None
    where: str = ""  # the cache read

    def image_load(self, stats: ModelStats) -> Any:
        """Per record, the vision tower's work in images of the planned size (stats.vision_tokens patches each):
        its patches over that where the cache knows them (a Qwen2-VL image's size is its own), else its images."""
        import numpy as np

        if self.patches is None:
            return np.asarray(self.images, dtype=np.float64)
        return np.asarray(self.patches, dtype=np.float64) / max(1, stats.vision_tokens)


def sequence(cfg: Config, stats: ModelStats, shapes: RecordShapes | None = None) -> tuple[int, int]:
    """(language-model tokens per sample, images per sample): a packed row is a sample here.

    plan.seq_len when set; else, with the records' shapes read from the job's built data cache (`shapes`)
    and no plan.text_tokens given, the worst micro batch they make: a packed row's length and the most
    images a row of the first epoch's packing plan holds (launcher.data.packing.pack_rows), or unpacked, the
    longest record's tokens and the most images one record holds (a padded or length-grouped micro batch is
    padded to its longest record: the peak is the micro batch that holds the longest; videos count as the
    images their frames make). Else, packing, the row's length (data.pack_length, else data.max_length) and
    the images of the records it holds (plan.text_tokens plus their image tokens each); else data.max_length
    when set: a batch is padded to its longest sample and no sample is longer, so a job's memory is bounded
    by it (a plan.text_tokens given as well is planned, up to data.max_length); else plan.text_tokens
    (default 512, or 32 for tiny models, whose built-in conversations are about 15 text tokens) plus the
    image tokens of plan.images_per_sample images. Each of plan.videos_per_sample videos counts as
    data.video.max_frames / data.video.grid^2 images where its frames train tiled into images (LLaVA:
    launcher.data.video.frames_as_images), as max_frames / temporal_patch_size images where the model takes
    videos (the Qwen2-VL family pairs frames in its patches: the tokens and the vision tower's work of one
    image per pair).
    """
    plan = cfg.plan
    per_video = -(-int(cfg.data.video.max_frames) // stats.frames_per_image)
    images = int(plan.images_per_sample) + int(plan.videos_per_sample) * per_video
    if plan.seq_len:
        return int(plan.seq_len), images
    if planned_from_records(cfg, shapes):
        return _worst_sample(cfg, stats, shapes)
    text = plan.text_tokens or (32 if str(cfg.model.source) == "tiny" else 512)
    typical = int(text) + images * stats.image_tokens
    if cfg.data.packing and pack_length(cfg.data) is not None:
        # A packed row is full, whatever its records, and holds the images of every record in it: at Qwen2-VL-2B's
        # 8,192 tokens of ~1,000-token records, 8 images, each ~1.7 GB of vision-tower activations in bf16.
        row = int(pack_length(cfg.data))
        held, most = images * max(1, row // typical), cfg.data.pack_max_images  # more than `most`: a row of its own
        return row, held if most is None else max(images, min(held, int(most)))
    longest = cfg.data.max_length
    if planned_at_max_length(cfg):
        return int(longest), images
    return (typical if longest is None else min(typical, int(longest))), images


def planned_from_records(cfg: Config, shapes: RecordShapes | None) -> bool:
    """Whether `sequence` plans the records' own shapes: they are known, and neither plan.seq_len nor
    plan.text_tokens says what to plan instead."""
    return shapes is not None and len(shapes.lengths) > 0 and not cfg.plan.seq_len and not cfg.plan.text_tokens


def _worst_sample(cfg: Config, stats: ModelStats, shapes: RecordShapes) -> tuple[int, int]:
    """`sequence` from the records themselves: (tokens, images) of the sample that needs the most."""
    load = shapes.image_load(stats)
    if cfg.data.packing and pack_length(cfg.data) is not None:
        from launcher.data.packing import pack_rows

        row, most = int(pack_length(cfg.data)), cfg.data.pack_max_images
        rows = pack_rows(shapes.lengths, row, seed=int(cfg.train.seed), epoch=0, images=shapes.images, max_images=most)
        most = max(float(load[indices].sum()) for indices in rows)
        return max(row, int(shapes.lengths.max())), math.ceil(most - 1e-9)
    return int(shapes.lengths.max()), math.ceil(float(load.max()) - 1e-9)


def pack_length(data: Any) -> int | None:
    """Tokens per packed row: data.pack_length, else data.max_length (None: neither is set)."""
    budget = data.pack_length if data.pack_length is not None else data.max_length
    return None if budget is None else int(budget)


def planned_at_max_length(cfg: Config) -> bool:
    """Whether `sequence` plans data.max_length tokens per sample (neither plan.seq_len nor
    plan.text_tokens given, and a limit set)."""
    return not cfg.plan.seq_len and not cfg.plan.text_tokens and cfg.data.max_length is not None


def fewest_image_tokens(cfg: Config) -> tuple[int, str] | None:
    """(the fewest language-model tokens one image takes with this model, what decides it); None when
    the model's config cannot be read here (training says why).

    LLaVA: every image the same, its vision tower's patches. Qwen2-VL: an image brought up to
    model.min_pixels (default the processor's 56 x 56). A tiny model: from model.image_size, read from
    the config group (nothing is built)."""
    model = cfg.model
    if str(model.source) == "tiny":
        side = int(model.image_size) // int(model.patch_size)
        merged = 4 if str(model.arch) == "tiny_qwen2_vl" else 1
        return side * side // merged, f"{model.arch} at model.image_size={model.image_size}"

    try:
        config = read_config(str(model.path))
    except LauncherError:
        return None
    vision_config = config.vision_config
    merge = getattr(vision_config, "spatial_merge_size", None)
    if not merge:
        return _image_tokens(cfg, config)[1], f"{config.model_type}, every image"
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    unit = vision_config.patch_size * merge
    low = int(model.min_pixels or 56 * 56)
    height, width = smart_resize(unit, unit, factor=unit, min_pixels=low, max_pixels=max(low, 28 * 28 * 1280))
    return (height // unit) * (width // unit), f"{config.model_type}, an image of model.min_pixels={low}"
