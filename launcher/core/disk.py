"""How much room a disk has left, as the one-line errors of a failed write say it."""

from __future__ import annotations

import shutil
from pathlib import Path

GiB, MiB = 2**30, 2**20


def free_space(path: Path) -> str | None:
    """ "75.9 GiB free" (under 1 GiB: "0.4 MiB free") on the disk holding `path` (or the nearest folder above
    it that exists); None where it cannot be read."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return None
    return f"{free / GiB:.1f} GiB free" if free >= GiB else f"{free / MiB:.1f} MiB free"
