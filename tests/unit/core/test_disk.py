"""launcher.core.disk: the room a disk has left, as the write errors say it."""

from __future__ import annotations

import shutil

from launcher.core.disk import GiB, MiB, free_space
from tests.helpers import small_disk


def test_free_space_names_gib_and_reads_the_nearest_existing_folder(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    expected = f"{free / GiB:.1f} GiB free" if free >= GiB else f"{free / MiB:.1f} MiB free"
    assert free_space(tmp_path / "not" / "made" / "yet") == expected


def test_under_one_gib_free_space_is_in_mib(tmp_path):
    with small_disk(tmp_path / "disk", 4):
        (tmp_path / "disk" / "ballast").write_bytes(b"\0" * (3 * MiB))
        said = free_space(tmp_path / "disk" / "run")
        assert said.endswith(" MiB free") and float(said.split()[0]) < 1.1, said
