"""What a cache's manifest records of each file it holds, and what a reader checks before trusting a file.

A cache writes its files first and its manifest last (atomically): the manifest's presence says the cache is
complete, and each file's size and SHA-256 in it say the bytes are the ones written. A file that differs
(truncated, bytes flipped, missing) is named with why, so that the cache computes it again, or the user is
told, instead of training on it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK = 1 << 20


def fingerprint(path: Path) -> dict[str, int | str]:
    """{"bytes": size, "sha256": hex digest} of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def damage(path: Path, recorded: dict | None) -> str | None:
    """Why `path` is not the file its manifest `recorded` (None: it is); a manifest without a record of it
    (an older cache) checks only that the file exists."""
    if not path.is_file():
        return "missing"
    if not recorded:
        return None
    size = path.stat().st_size
    if size != recorded.get("bytes"):
        return f"{size} bytes, the manifest says {recorded.get('bytes')}"
    if fingerprint(path)["sha256"] != recorded.get("sha256"):
        return "its checksum differs from the manifest's (bytes changed)"
    return None
