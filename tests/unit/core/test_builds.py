"""A directory built once and reused (launcher.core.builds): reused only while every file is the one written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from launcher.core.builds import FILES, build_once, built_arguments

ARGUMENTS = {"seed": 0, "size": 3}


def _write(where: Path) -> None:
    (where / "weights.bin").write_bytes(bytes(range(256)) * 4)
    (where / "sub").mkdir()
    (where / "sub" / "config.json").write_text('{"a": 1}')


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "a byte flipped": (lambda out: _flip(out / "weights.bin"), "weights.bin: its checksum differs"),
    "cut short": (lambda out: (out / "weights.bin").write_bytes(bytes(10)), "weights.bin: 10 bytes, the manifest says"),
    "a file missing": (lambda out: (out / "sub" / "config.json").unlink(), "sub/config.json: missing"),
    "the record broken": (lambda out: (out / "build.json").write_text("{"), None),
    "the record missing": (lambda out: (out / "build.json").unlink(), None),
}


def test_a_build_is_written_once_with_every_files_fingerprint_and_reused(tmp_path):
    calls = []
    out = build_once(tmp_path / "b", ARGUMENTS, "build.json", lambda where: (calls.append(1), _write(where)))
    record = json.loads((out / "build.json").read_text())
    assert set(record[FILES]) == {"weights.bin", "sub/config.json"}
    assert record[FILES]["weights.bin"]["bytes"] == 1024 and len(record[FILES]["weights.bin"]["xxh3_128"]) == 32
    assert built_arguments(out, "build.json") == ARGUMENTS
    assert build_once(out, ARGUMENTS, "build.json", lambda where: (calls.append(1), _write(where))) == out
    assert len(calls) == 1
    build_once(out, {**ARGUMENTS, "size": 4}, "build.json", lambda where: (calls.append(1), _write(where)))
    assert len(calls) == 2 and built_arguments(out, "build.json")["size"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no temporary directory left


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_build_is_named_and_built_again_never_used(tmp_path, caplog, kind):
    out = build_once(tmp_path / "b", ARGUMENTS, "build.json", _write)
    intact = (out / "weights.bin").read_bytes()
    harm, named = DAMAGE[kind]
    harm(out)
    with caplog.at_level(logging.WARNING, logger="launcher"):
        assert build_once(out, ARGUMENTS, "build.json", _write) == out
    assert (out / "weights.bin").read_bytes() == intact and (out / "sub" / "config.json").is_file()
    assert built_arguments(out, "build.json") == ARGUMENTS
    if named is not None:  # a damaged file is named; a build without its record is simply not complete
        assert len(caplog.messages) == 1 and f"{out} is damaged ({out}/{named}" in caplog.messages[0]
        assert caplog.messages[0].endswith(": building it again")


def test_a_record_without_fingerprints_is_trusted(tmp_path):
    """A build made before the fingerprints existed is kept, not rebuilt at every start."""
    out = tmp_path / "old"
    out.mkdir()
    _write(out)
    (out / "build.json").write_text(json.dumps(ARGUMENTS))
    assert build_once(out, ARGUMENTS, "build.json", lambda where: pytest.fail("rebuilt")) == out
