"""The tiny models the model tests build: their words and their dimensions (fixtures: conftest.py)."""

from __future__ import annotations

from pathlib import Path

from launcher.model.tiny import build_tiny_model_dir

VOCABULARY = ["<image>\nwhat is in the image?", "red circle", "blue square", "green triangle"]
SIZES = {
    "hidden_size": 64,
    "num_layers": 1,
    "vision_hidden_size": 32,
    "vision_layers": 1,
    "image_size": 32,
    "patch_size": 8,
}


def build(arch: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    return build_tiny_model_dir(arch, out_dir, VOCABULARY, seed=seed, **{**SIZES, **overrides})
