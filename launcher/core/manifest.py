"""What a cache's manifest records of each file it holds, and what a reader checks before trusting a file.

A cache writes its files first and its manifest last (atomically): the manifest's presence says the cache is
complete, and each file's size and checksum in it say the bytes are the ones written. A file that differs
(truncated, bytes flipped, missing) is named with why, so that the cache computes it again, or the user is
told, instead of training on it.

Two checksums: SHA-256 for the small caches (the record index, the DPO reference), and XXH3-128 for the data
cache, whose files every start reads through: it hashes ~8 GB/s on one core of this machine against
SHA-256's ~1.25, so a check is bound by the disk, not the hash. Neither guards against an attacker (the
manifest sits beside the files); both catch a file cut short, a copy gone wrong, bytes that rotted.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import xxhash

_BLOCK = 8 << 20
Checksum = Literal["sha256", "xxh3_128"]


def fingerprint(path: Path, checksum: Checksum = "sha256") -> dict[str, int | str]:
    """{"bytes": size, checksum: hex digest} of a file."""
    digest = hashlib.sha256() if checksum == "sha256" else xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return {"bytes": path.stat().st_size, checksum: digest.hexdigest()}


def damage(path: Path, recorded: dict | None) -> str | None:
    """Why `path` is not the file its manifest `recorded` (None: it is); a manifest without a record of it
    (an older cache) checks only that the file exists, a record without a checksum only its size."""
    if not path.is_file():
        return "missing"
    if not recorded:
        return None
    size = path.stat().st_size
    if size != recorded.get("bytes"):
        return f"{size} bytes, the manifest says {recorded.get('bytes')}"
    checksum: Checksum | None = next((c for c in ("xxh3_128", "sha256") if c in recorded), None)  # type: ignore[misc]
    if checksum is not None and fingerprint(path, checksum)[checksum] != recorded[checksum]:
        return "its checksum differs from the manifest's (bytes changed)"
    return None
