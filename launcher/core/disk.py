"""How much room a disk has left, as the one-line errors of a failed write say it."""

from __future__ import annotations

import shutil
from pathlib import Path

GiB, MiB = 2**30, 2**20


def free_space(path: Path) -> str | None:
    """ "75.9 GiB free" (under 1 GiB: "0.4 MiB free") on the disk holding `path` (or the nearest folder above
    it that exists); None where it cannot be read."""
    free = free_bytes(path)
    return None if free is None else said(free)


def free_bytes(path: Path) -> int | None:
    """The bytes free on the disk holding `path` (or the nearest folder above it that exists); None where
    they cannot be read."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def said(free: int) -> str:
    """`free` bytes as the errors say it: "75.9 GiB free", under 1 GiB "0.4 MiB free"."""
    return f"{free / GiB:.1f} GiB free" if free >= GiB else f"{free / MiB:.1f} MiB free"
