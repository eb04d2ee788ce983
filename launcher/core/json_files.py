"""JSON and text files written atomically (a temporary file and a rename: a reader sees the old file or the
new one, never half of one), and JSON without NaN or Infinity (not JSON): a non-finite number is null."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {key: finite(value) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(value) for value in obj]
    return obj


def write_text_atomic(path: Path, text: str) -> None:
    """Write a file through a temporary file and a rename: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        if err.filename is None:  # a failed write names no file: this one (a full disk says which)
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON atomically (`write_text_atomic`), non-finite numbers as null."""
    write_text_atomic(path, json.dumps(finite(obj), indent=2, default=str, allow_nan=False) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def read_json_or_none(path: Path) -> Any | None:
    """A JSON file's content, or None when it is missing or unreadable (being written by another node)."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None
