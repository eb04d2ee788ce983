"""launcher.data.index: each data file read and checked once into a memory-mapped Arrow file, whose records
equal the file's as read; a changed file or other read options make a new index; a half-written index is
not one. Memory and start-up at size: bench/data_scale.py."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
from PIL import Image

from launcher.data.formats import ReadOptions, read_records
from launcher.data.index import Records, RecordTable, indexed_records
from launcher.data.records import ConversationDataset
from tests.unit.data.samples import MULTI_TURN, record, write_image


def png_bytes(colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    write_image(tmp_path / "a.png")
    path = tmp_path / "data.json"
    text_only = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    path.write_text(json.dumps([record(id="one"), MULTI_TURN, text_only]))
    return path


def test_an_indexed_file_gives_the_records_it_reads_to_and_reads_them_once(tmp_path, data_file):
    options = ReadOptions()
    expected, _, _ = read_records(data_file, options)
    records, skipped, fmt = indexed_records(str(data_file), options, tmp_path / "index")
    assert isinstance(records, RecordTable) and (skipped, fmt) == (0, "llava")
    assert len(records) == 3 and list(records) == expected
    assert [records[i] for i in (0, 1, 2, -1)] == [*expected, expected[-1]]
    assert records[1:] == expected[1:] and Records([records])[:2] == [{**r, "source": 0} for r in expected[:2]]
    with pytest.raises(IndexError):
        records[3]
    (tmp_path / "a.png").unlink()  # read again from the index: no image header is opened
    again, _, _ = indexed_records(str(data_file), options, tmp_path / "index")
    assert again.path == records.path and list(again) == expected
    copy = pickle.loads(pickle.dumps(again))  # as a DataLoader worker gets it: the path, mapped anew
    assert copy._table is None and copy[1] == expected[1]


def test_images_embedded_as_bytes_come_back_as_bytes(tmp_path):
    import datasets

    rows = datasets.Dataset.from_dict(
        {
            "messages": [[{"role": "user", "content": "<image><image>two?"}, {"role": "assistant", "content": "x"}]],
            "images": [[{"bytes": png_bytes("red"), "path": None}, {"bytes": png_bytes("blue"), "path": None}]],
        },
        features=datasets.Features(
            {
                "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
                "images": datasets.List(datasets.Image()),
            }
        ),
    )
    rows.to_parquet(tmp_path / "train.parquet")
    options = ReadOptions(cache_dir=tmp_path / "hf")
    records, _, _ = indexed_records(str(tmp_path / "train.parquet"), options, tmp_path / "index")
    assert isinstance(records, RecordTable) and records[0]["images"] == [png_bytes("red"), png_bytes("blue")]
    assert ConversationDataset(records)[0]["images"][0].getpixel((0, 0)) == (255, 0, 0)


def test_a_changed_file_or_other_options_make_another_index(tmp_path, data_file):
    first, _, _ = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    other, _, _ = indexed_records(str(data_file), ReadOptions(check_headers=False), tmp_path / "index")
    assert other.path != first.path
    data_file.write_text(json.dumps([record(id="edited")]))
    stat = data_file.stat()
    os.utime(data_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    edited, _, _ = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    assert edited.path != first.path and [r["id"] for r in edited] == ["edited"]


def test_skipped_records_and_their_log_come_back_from_the_index(tmp_path, data_file):
    rows = json.loads(data_file.read_text())
    data_file.write_text(json.dumps([*rows, record(image="missing.png")]))
    options = ReadOptions(on_bad_record="skip")
    first_log: list[dict] = []
    records, skipped, _ = indexed_records(str(data_file), options, tmp_path / "index", first_log)
    assert (len(records), skipped) == (3, 1) and first_log[0]["record"] == 3
    again_log: list[dict] = []
    assert indexed_records(str(data_file), options, tmp_path / "index", again_log)[1] == 1
    assert again_log == first_log


def test_a_half_written_index_is_built_again(tmp_path, data_file):
    records, _, _ = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    records.path.with_suffix(".json").unlink()  # killed before the file that marks it complete
    records.path.write_bytes(b"cut short")
    again, _, _ = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    assert len(list(again)) == 3
    assert not [p for p in (tmp_path / "index").iterdir() if p.name.startswith(".")]  # no temporary left


def _flip_last_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for at in range(len(data) // 2, len(data) // 2 + 16):  # inside the record batches: the same size
        data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("harm", "why"),
    [
        (lambda table: table.write_bytes(table.read_bytes()[:100]), "bytes, the manifest says"),
        (_flip_last_bytes, "its checksum differs from the manifest's"),
        (lambda table: table.unlink(), "missing"),
        (lambda table: table.with_suffix(".json").write_text('{"version": '), "does not parse as JSON"),
    ],
    ids=["truncated", "bytes-flipped", "missing", "broken-meta"],
)
def test_a_damaged_index_is_named_and_built_again_never_read(tmp_path, data_file, caplog, harm, why):
    """Once: `pyarrow.lib.ArrowInvalid: Not an Arrow file` in every later job on that data (issue 42)."""
    expected, _, _ = read_records(data_file, ReadOptions())
    records, _, _ = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    assert set(json.loads(records.path.with_suffix(".json").read_text())["arrow"]) == {"bytes", "sha256"}
    harm(records.path)
    again, _, _ = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    assert list(again) == expected
    said = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(said) == 1 and why in said[0] and said[0].endswith("building it again"), said
    assert indexed_records(str(data_file), ReadOptions(), tmp_path / "index")[0].path == records.path  # whole again


def test_records_of_several_sources_carry_their_source(tmp_path, data_file):
    table, _, _ = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    listed = read_records(data_file, ReadOptions())[0][:2]
    mixed = Records([table, listed])
    assert len(mixed) == 5 and mixed.sources.tolist() == [0, 0, 0, 1, 1]
    assert [r["source"] for r in mixed] == [0, 0, 0, 1, 1] and mixed[3] == {**listed[0], "source": 1}
    assert mixed[-1]["source"] == 1
    assert mixed.fingerprint() is None  # a list is not indexed: the data cache hashes its records instead
    assert Records([table]).fingerprint() == json.dumps([[table.path.stem, 0]])


def test_a_large_file_is_indexed_in_a_child_process_with_the_same_records_and_errors(tmp_path, data_file, monkeypatch):
    """Above CHILD_BUILD_BYTES the parse runs in a spawned process (its memory goes with it): the index,
    the skip log and a bad record's one-line error are those of an index built in place."""
    from launcher.core.errors import LauncherError
    from launcher.data import index

    monkeypatch.setattr(index, "CHILD_BUILD_BYTES", 0)
    expected, _, _ = read_records(data_file, ReadOptions())
    records, _, fmt = indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    assert fmt == "llava" and list(records) == expected
    rows = json.loads(data_file.read_text())
    data_file.write_text(json.dumps([*rows, record(image="missing.png")]))
    log: list[dict] = []
    skipped = indexed_records(str(data_file), ReadOptions(on_bad_record="skip"), tmp_path / "index", log)[1]
    assert skipped == 1 and log[0]["record"] == 3
    with pytest.raises(LauncherError, match=r"data.json record 3: .*missing.png") as error:
        indexed_records(str(data_file), ReadOptions(), tmp_path / "index")
    assert "\n" not in str(error.value)
