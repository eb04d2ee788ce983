"""Fixtures of the model tests: both tiny families built once per session (one layer each side)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.model.tiny import TINY_ARCHITECTURES, build_tiny_model_dir
from tests.unit.model.tiny_sizes import SIZES, VOCABULARY


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """{arch: directory} of each tiny family; tests load from it and must not write into it."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model_dir(arch, root / arch, VOCABULARY, seed=0, **SIZES) for arch in TINY_ARCHITECTURES}
