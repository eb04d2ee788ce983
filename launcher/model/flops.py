"""The FLOPs a training step's useful work costs on a vision-language model, for model FLOPs utilisation.

Text-only formulas (6 x parameters x tokens) misstate a VLM: its vision tower sees every image patch
(576 rows per LLaVA-1.5 image, several patches per image token for Qwen2-VL) and is often frozen, and its
projector runs on image rows only. So each part is counted on its own rows:

    a matmul weight W (linear, lm_head) on r rows: 2 W r forward; as much again for the gradient of its
    input where gradients flow through it (something trains at or before it in vision -> projector ->
    language model), and again for its own gradient where W trains; the patch embedding (a convolution
    on the pixels) on the patches: forward, and its own gradient where it trains;
    attention over s rows of width d (heads x head dim), per layer: 4 s^2 d forward (QK^T and AV), and
    twice that backward where gradients flow.

Rows: the language model's and lm_head's are the real (non-padding) tokens of each sample, attention per
sample; the vision tower's are each image's patches (plus CLIP's class token, for LLaVA), attention per
image; the projector's are the rows it maps (LLaVA: the patches the feature strategy keeps; Qwen2-VL's
merger: the patches over merge_size^2). Normalisations, activations, softmax and the loss are left out,
as FLOP counters leave them (tests/unit/model/test_flops.py checks the count against
torch.utils.flop_counter within 5% on both tiny families). Padding is not useful work: a padded batch
executes more than this counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from launcher.model.components import base_model, model_components

ORDER = ("vision", "projector", "language")  # the order activations flow in


@dataclass(frozen=True)
class PartWork:
    """One part's matmul weights, counted per row, and its attention."""

    weights: int  # elements of its matmul weights (the patch embedding's apart)
    trained: int  # of them, those that train
    layers: int = 0  # attention layers
    width: int = 0  # attention width: heads x head dim
    flows: bool = True  # gradients flow back through it


@dataclass(frozen=True)
class ImageRows:
    """The rows one image gives each part."""

    vision: int  # rows through the tower: its patches (and a class token)
    projector: int
    patches: int  # rows of the patch embedding


@dataclass(frozen=True)
class FlopModel:
    """The parts of one model, read once; `step_flops` counts a batch."""

    vision: PartWork
    projector: PartWork
    language: PartWork
    family: str  # "llava" | "qwen2_vl"
    patch: int  # pixels per patch side
    # The vision tower's patch embedding (a convolution over the pixels, whose gradient is never needed):
    # its elements, and whether they train.
    patch_weights: int = 0
    patch_trains: bool = False
    merge: int = 1  # Qwen2-VL: patches merged per side into one image token
    temporal: int = 1  # Qwen2-VL: frames per temporal patch
    class_token: bool = True  # LLaVA's CLIP adds one; the projector drops it under the "default" strategy
    projector_keeps_class: bool = False
    image_token_id: int | None = None  # the placeholder token an image's rows replace in input_ids
    video_token_id: int | None = None  # a video's, where the model takes videos as videos (Qwen2-VL)

    @classmethod
    def of(cls, model: nn.Module) -> FlopModel:
        model = base_model(model)  # peft: the adapters sit inside the base model's layers
        config = model.config
        parts = model_components(model)
        vision_config, text_config = config.vision_config, config.text_config
        counted: set[int] = set()  # modules and parameters met in a part already
        embedding = _patch_embedding(parts["vision"])
        counted.add(id(embedding))
        weights, trains = {}, {}
        for name in ("projector", "vision", "language"):  # the projector first: Qwen2-VL's sits in `visual`
            weights[name], trains[name] = _matmul_weights(parts[name], counted)
        flows = {name: any(trains[earlier] for earlier in ORDER[: ORDER.index(name) + 1]) for name in ORDER}
        heads = int(text_config.num_attention_heads)
        head_dim = getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads
        qwen = hasattr(vision_config, "spatial_merge_size")
        vision_width = int(getattr(vision_config, "embed_dim", None) or vision_config.hidden_size)
        vision_layers = int(getattr(vision_config, "depth", None) or vision_config.num_hidden_layers)
        return cls(
            vision=PartWork(*weights["vision"], vision_layers, vision_width, flows["vision"]),
            projector=PartWork(*weights["projector"], flows=flows["projector"]),
            language=PartWork(
                *weights["language"], int(text_config.num_hidden_layers), heads * head_dim, flows["language"]
            ),
            family="qwen2_vl" if qwen else "llava",
            patch=int(vision_config.patch_size),
            patch_weights=int(embedding.weight.numel()),
            patch_trains=bool(embedding.weight.requires_grad),
            merge=int(getattr(vision_config, "spatial_merge_size", 1)),
            temporal=int(getattr(vision_config, "temporal_patch_size", 1)),
            class_token=not qwen,
            projector_keeps_class=getattr(config, "vision_feature_select_strategy", "default") == "full",
            image_token_id=getattr(config, "image_token_id", None),
            video_token_id=getattr(config, "video_token_id", None) if qwen else None,
        )

    def image_rows(self, batch: dict[str, Any]) -> list[ImageRows]:
        """Each image's rows in a model batch (pixel_values, and Qwen2-VL's image_grid_thw); a video taken as a
        video (Qwen2-VL's video_grid_thw) counts as one image per temporal patch, as its tower attends per
        temporal patch."""
        if self.family == "qwen2_vl":
            grids = [batch[key].tolist() for key in ("image_grid_thw", "video_grid_thw") if batch.get(key) is not None]
            frames = [int(h) * int(w) for grid in grids for t, h, w in grid for _ in range(int(t))]
            return [ImageRows(r, r // (self.merge * self.merge), r) for r in frames]
        pixels = batch.get("pixel_values")
        if pixels is None:
            return []
        patches = (int(pixels.shape[-2]) // self.patch) * (int(pixels.shape[-1]) // self.patch)
        vision = patches + int(self.class_token)
        projector = vision if self.projector_keeps_class else patches
        return [ImageRows(vision, projector, patches)] * int(pixels.shape[0])

    def step_flops(self, tokens: Sequence[int], images: Sequence[ImageRows]) -> float:
        """Forward and backward FLOPs of samples of `tokens` real tokens each, with `images`."""
        flops = 0.0
        for part, rows in (
            (self.language, tokens),
            (self.vision, [image.vision for image in images]),
            (self.projector, [image.projector for image in images]),
        ):
            total = sum(rows)
            flops += 2.0 * part.weights * total * (2 if part.flows else 1)  # forward, and the inputs' gradient
            flops += 2.0 * part.trained * total  # the weights' own gradient
            attention = sum(4.0 * r * r * part.width * part.layers for r in rows)
            flops += attention * (3 if part.flows else 1)
        patches = sum(image.patches for image in images)
        return flops + 2.0 * self.patch_weights * patches * (2 if self.patch_trains else 1)


def _patch_embedding(vision: list[nn.Module]) -> nn.Module:
    """The vision tower's first convolution: it maps pixel patches, whose gradient nothing needs."""
    return next(module for root in vision for module in root.modules() if isinstance(module, nn.Conv2d | nn.Conv3d))


def _matmul_weights(modules: list[nn.Module], counted: set[int]) -> tuple[tuple[int, int], bool]:
    """((elements, trained elements) of the matmul weights in `modules`, whether anything there trains),
    leaving out what an earlier part counted (a weight shared by two parts, such as tied embeddings used
    as lm_head, counts where it is first met) and the frozen originals that peft keeps beside the trained
    copies of modules_to_save (only the copy runs)."""
    total = trained = 0
    trains = False
    for root in modules:
        for name, module in root.named_modules():
            if "original_module" in name.split(".") or id(module) in counted:
                continue
            counted.add(id(module))
            own = [p for p in module.parameters(recurse=False) if id(p) not in counted]
            counted.update(id(p) for p in own)
            trains = trains or any(p.requires_grad for p in own)
            if isinstance(module, nn.Linear | nn.Conv2d | nn.Conv3d):
                size = int(getattr(module.weight, "ds_numel", module.weight.numel()))
                total += size
                trained += size if module.weight.requires_grad else 0
    return (total, trained), trains
