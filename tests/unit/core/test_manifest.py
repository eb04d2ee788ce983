"""launcher.core.manifest: a file's size and checksum, and why a file is not the one its manifest recorded."""

from __future__ import annotations

import hashlib

from launcher.core.manifest import damage, fingerprint


def test_a_fingerprint_is_the_files_size_and_sha256(tmp_path):
    file = tmp_path / "chunk.npy"
    file.write_bytes(b"x" * (3 << 20) + b"tail")  # more than one read block
    assert fingerprint(file) == {"bytes": (3 << 20) + 4, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}


def test_damage_names_what_differs_from_the_manifest(tmp_path):
    file = tmp_path / "chunk.npy"
    file.write_bytes(b"0123456789")
    recorded = fingerprint(file)
    assert damage(file, recorded) is None
    file.write_bytes(b"0123456789"[:4])
    assert damage(file, recorded) == "4 bytes, the manifest says 10"
    file.write_bytes(b"0123456780")  # the same size, one byte changed
    assert damage(file, recorded) == "its checksum differs from the manifest's (bytes changed)"
    assert damage(file, None) is None  # an older manifest without a record: its presence only
    file.unlink()
    assert damage(file, recorded) == "missing" and damage(file, None) == "missing"


def test_the_data_caches_fast_checksum_is_xxh3_and_damage_reads_whichever_was_recorded(tmp_path):
    import xxhash

    file = tmp_path / "input_ids.bin"
    file.write_bytes(bytes(range(256)) * 40_000)  # ~10 MiB: more than one read block
    recorded = fingerprint(file, "xxh3_128")
    assert recorded == {"bytes": 10_240_000, "xxh3_128": xxhash.xxh3_128(file.read_bytes()).hexdigest()}
    assert damage(file, recorded) is None
    data = bytearray(file.read_bytes())
    data[9_000_000] ^= 0x80
    file.write_bytes(bytes(data))
    assert damage(file, recorded) == "its checksum differs from the manifest's (bytes changed)"
