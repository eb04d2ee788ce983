"""The sweep the tests of launcher.compare read (tests/unit/compare/sweeps.py writes it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.compare.sweeps import make_sweep


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A 5-job sweep over zero x offload x precision: 3 completed, 1 failed, 1 killed hard."""
    return make_sweep(tmp_path / "multirun" / "2026-11-29" / "15-30-00")
