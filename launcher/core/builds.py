"""A directory the launcher builds once and reuses: a tiny model, a random build of a real architecture, the
built-in data set.

It is written whole into a temporary directory beside its place, its record written last (the arguments it
was built from, and every file's size and XXH3-128), then renamed into place, so a crash never leaves a
directory that looks complete. It is reused when its record names the same arguments and every file still
matches; a file cut short, changed or missing is named in one warning line and the directory built again,
never used as it is (a tiny model's weights with a flipped byte would train from other weights, silently).
A record without file fingerprints (written before they existed) is trusted as it is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.core.manifest import damage, fingerprint

log = logging.getLogger("launcher")

FILES = "files"  # the record's key holding {relative path: {"bytes", "xxh3_128"}}


def build_once(out_dir: Path, arguments: dict[str, Any], record: str, write: Callable[[Path], None]) -> Path:
    """`out_dir` as `write(directory)` builds it for `arguments`: reused when intact, built otherwise (the
    module docstring). Several processes may build one directory at once: whoever renames first wins, and
    the others keep the winner's (identical) build."""
    out_dir = Path(out_dir)
    if reusable(out_dir, arguments, record, say=True):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp_dir.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
    try:
        write(tmp_dir)
        files = {
            str(path.relative_to(tmp_dir)): fingerprint(path, "xxh3_128")
            for path in sorted(tmp_dir.rglob("*"))
            if path.is_file()
        }
        (tmp_dir / record).write_text(json.dumps({**arguments, FILES: files}, indent=2) + "\n")
        if out_dir.exists() and not reusable(out_dir, arguments, record):
            shutil.rmtree(out_dir, ignore_errors=True)  # stale, half-written or damaged
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:  # another process renamed its build first
            if not reusable(out_dir, arguments, record):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def built_arguments(out_dir: Path, record: str) -> dict[str, Any] | None:
    """The arguments `out_dir`'s record says it was built from (None: no readable record)."""
    try:
        recorded = json.loads((Path(out_dir) / record).read_text())
    except (OSError, ValueError):
        return None
    return {key: value for key, value in recorded.items() if key != FILES} if isinstance(recorded, dict) else None


def reusable(out_dir: Path, arguments: dict[str, Any], record: str, *, say: bool = False) -> bool:
    """Whether `out_dir` is a complete build of `arguments` whose files are the ones written; `say`: name
    a damaged file in a warning line."""
    if built_arguments(out_dir, record) != arguments:
        return False
    recorded = json.loads((out_dir / record).read_text()).get(FILES) or {}
    for name, written in recorded.items():
        if (why := damage(out_dir / name, written)) is not None:
            if say:
                log.warning("%s is damaged (%s: %s): building it again", out_dir, out_dir / name, why)
            return False
    return True
