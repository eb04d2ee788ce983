"""launcher.core.json_files: files written whole or not at all, and JSON without NaN or Infinity."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from launcher.core.json_files import finite, read_json, read_json_or_none, write_json_atomic, write_text_atomic


def strict(text: str):
    """json.loads that fails on NaN/Infinity (which Python's json would accept)."""
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))


def test_every_non_finite_number_becomes_null_at_any_depth():
    data = {"loss": math.nan, "norms": [1.0, math.inf, (-math.inf, 2)], "nested": {"x": {"y": math.nan}}, "n": 3}
    assert finite(data) == {"loss": None, "norms": [1.0, None, [None, 2]], "nested": {"x": {"y": None}}, "n": 3}
    assert finite(2.5) == 2.5 and finite("nan") == "nan"  # a string is not a number


def test_json_is_written_without_nan_and_with_paths_as_text(tmp_path):
    path = tmp_path / "deep" / "er" / "file.json"  # parents are made
    write_json_atomic(path, {"grad_norms": [1.0, math.nan], "objective": -math.inf, "where": Path("/x")})
    assert strict(path.read_text()) == {"grad_norms": [1.0, None], "objective": None, "where": "/x"}
    assert read_json(path) == read_json_or_none(path)
    assert [p.name for p in path.parent.iterdir()] == ["file.json"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "summary.json"
    write_text_atomic(path, "old\n")
    with pytest.raises(TypeError):
        write_text_atomic(path, 42)  # type: ignore[arg-type]  # fails inside the write
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_missing_or_half_written_file_reads_as_none(tmp_path):
    assert read_json_or_none(tmp_path / "missing.json") is None
    (tmp_path / "half.json").write_text('{"status": "runn')
    assert read_json_or_none(tmp_path / "half.json") is None
    with pytest.raises(ValueError):
        read_json(tmp_path / "half.json")
