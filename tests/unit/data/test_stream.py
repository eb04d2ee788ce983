"""launcher.data.stream: which rows each rank reads, in which order, from any position on; streamed batches
equal the processor's batches of the same records bit for bit, with or without DataLoader workers; rows
that cannot train are skipped and listed (or stop the run) as they are met."""

from __future__ import annotations

import io
import json
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from launcher.core.errors import LauncherError
from launcher.data.cache import CachedCollator, RecordEncoder
from launcher.data.collate import Collator
from launcher.data.formats import BadRecordError, ReadOptions, SkipTally
from launcher.data.length import LengthLimit, unchanged
from launcher.data.records import ConversationDataset
from launcher.data.stream import (
    RecordStream,
    StreamOrder,
    file_length,
    file_rows,
    stream_files,
    stream_head,
    streamed_batches,
)
from launcher.train.checkpoint import DataPosition
from tests.unit.data.samples import long_records


def write_shards(root: Path, sizes: list[int]) -> list[str]:
    """JSON lines shards of rows {"id": "FILE-ROW"}."""
    root.mkdir(parents=True, exist_ok=True)
    for number, size in enumerate(sizes):
        rows = [json.dumps({"id": f"{number}-{row}"}) for row in range(size)]
        (root / f"part-{number}.jsonl").write_text("\n".join(rows) + "\n")
    return stream_files(str(root))


def ids(order: StreamOrder, epoch: int = 0, start: int = 0) -> list[str]:
    return [json.loads(raw)["id"] for _, _, _, raw in order.rows(epoch, start)]


def test_data_path_names_a_file_a_folder_a_glob_or_a_url(tmp_path):
    files = write_shards(tmp_path / "set", [2, 3, 4])
    assert [Path(f).name for f in files] == ["part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
    assert stream_files(str(tmp_path / "set" / "part-*.jsonl")) == files
    assert stream_files(f"file://{tmp_path}/set/part-1.jsonl") == [files[1]]
    assert stream_files(files[2]) == [files[2]]
    with pytest.raises(LauncherError, match=r"data.path=.*nothing-\*.jsonl: no data files there"):
        stream_files(str(tmp_path / "set" / "nothing-*.jsonl"))


@pytest.mark.parametrize(("world", "by_file"), [(1, True), (2, True), (3, True), (4, False), (5, False)])
def test_each_epoch_the_ranks_read_every_row_once_between_them(tmp_path, world, by_file):
    """Three files of 7, 8 and 9 rows: with as many files as ranks each reads files of its own, with fewer
    every rank reads all and keeps every world-th row; either way no row twice, none left out."""
    files = tuple(write_shards(tmp_path, [7, 8, 9]))
    everything = {f"{f}-{r}" for f, size in enumerate([7, 8, 9]) for r in range(size)}
    for epoch in (0, 1):
        shares = [ids(StreamOrder(files, seed=5, rank=r, world_size=world, block=4), epoch) for r in range(world)]
        assert StreamOrder(files, seed=5, world_size=world).by_file == by_file
        read = [row for share in shares for row in share]
        assert len(read) == len(set(read)) and set(read) == everything
        if not by_file:  # every rank the same number of rows, within one
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_the_order_is_the_seeds_shuffled_in_blocks_and_changes_each_epoch(tmp_path):
    files = tuple(write_shards(tmp_path, [10, 10, 10]))
    order = StreamOrder(files, seed=1, block=6)
    first = ids(order)
    assert first == ids(StreamOrder(files, seed=1, block=6))  # a function of its inputs
    assert first != ids(order, epoch=1) and sorted(first) == sorted(ids(order, epoch=1))
    assert first != ids(StreamOrder(files, seed=2, block=6))
    for number in range(5):  # each block of 6 is a permutation of 6 consecutive rows in the epoch's file order
        block = first[number * 6 : (number + 1) * 6]
        in_file_order = ids(StreamOrder(files, seed=1, block=1))[number * 6 : (number + 1) * 6]
        assert sorted(block) == sorted(in_file_order)
    assert first != ids(StreamOrder(files, seed=1, block=1))  # the blocks are shuffled, not kept in order


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_stream_resumes_at_every_position_with_the_rows_it_would_have_read(tmp_path, world):
    files = tuple(write_shards(tmp_path, [5, 0, 9, 6]))  # an empty file among them
    for rank in range(world):
        order = StreamOrder(files, seed=3, rank=rank, world_size=world, block=4)
        whole = ids(order)
        for start in range(len(whole) + 1):
            assert ids(order, start=start) == whole[start:], (rank, start)


def test_parquet_arrow_json_and_json_lines_shards_give_the_same_rows(tmp_path):
    rows = [{"id": str(i), "n": i} for i in range(23)]
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=5)  # 5 row groups: skipped by metadata
    with pa.OSFile(str(tmp_path / "a.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(row) + "\n\n" for row in rows))  # blank lines ignored
    for name in ("a.parquet", "a.arrow", "a.json", "a.jsonl"):
        file = str(tmp_path / name)
        assert file_length(file) == 23
        for start in (0, 4, 5, 11, 22, 23, 30):
            read = [json.loads(row) if isinstance(row, str) else row for row in file_rows(file, start)]
            assert read == rows[start:], (name, start)


# ----------------------------------------------------------------------------- batches
def stream_of(file: str, processor, *, block: int = 4, workers: int = 0, limit=None, start=(0, 0)):
    encode = RecordEncoder(processor, limit, "pixels")
    stream = RecordStream(
        StreamOrder((file,), seed=7, block=block), ReadOptions(), encode, epoch=start[0], start=start[1]
    )
    if not workers:
        return iter(stream)
    loader = DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=unchanged)
    return iter(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_batches_equal_the_processors_bitwise(mixed_records, model_and_processor, workers):
    """Records of 0-3 images, in the stream's order: the batches the processor makes of them; with workers
    encoding rows in turn, the same batches in the same order."""
    _, processor = model_and_processor
    file = mixed_records[0]["file"]
    order = [row for _, _, row, _ in StreamOrder((file,), seed=7, block=4).rows(0)]
    position, tally = DataPosition(), SkipTally()
    batches = streamed_batches(
        stream_of(file, processor, workers=workers), position, 3, CachedCollator(processor), "error", tally
    )
    live, collate = ConversationDataset(mixed_records), Collator(processor)
    for number in range(6):  # two epochs of 12 records
        batch = next(batches)
        epoch_rows = order if number < 4 else [r for _, _, r, _ in StreamOrder((file,), seed=7, block=4).rows(1)]
        expected = collate([live[i] for i in epoch_rows[(number % 4) * 3 : (number % 4) * 3 + 3]])
        assert sorted(batch) == sorted(expected)
        for key in batch:
            assert batch[key].dtype == expected[key].dtype and torch.equal(batch[key], expected[key]), key
        assert (position.epoch, position.records) == (number // 4, (number % 4) * 3 + 3)
    assert (tally.bad, tally.too_long) == (0, 0)


def test_a_resumed_stream_gives_the_batches_after_its_position(mixed_records, model_and_processor):
    _, processor = model_and_processor
    file = mixed_records[0]["file"]
    collate = CachedCollator(processor)

    def run(start: tuple[int, int], count: int) -> list[dict]:
        position = DataPosition(epoch=start[0], records=start[1])
        stream = streamed_batches(stream_of(file, processor, start=start), position, 2, collate, "error", SkipTally())
        return [next(stream) for _ in range(count)]

    whole = run((0, 0), 9)  # into the second epoch
    for batches_done in (1, 3, 6, 7):
        epoch, records = divmod(batches_done * 2, 12)
        for a, b in zip(run((epoch, records), 9 - batches_done), whole[batches_done:], strict=True):
            assert all(torch.equal(a[key], b[key]) for key in a)


def test_rows_that_cannot_train_are_skipped_counted_and_named_or_stop_the_run(tmp_path, model_and_processor):
    """A malformed line, a missing image, a row over data.max_length: under skip each is counted and listed
    with its file and row, and the batches hold the rows that train; under error the first bad row stops."""
    _, processor = model_and_processor
    long_records(tmp_path)  # a.png, b.png
    good = {
        "image": "a.png",
        "conversations": [{"from": "human", "value": "<image>\nsay hi"}, {"from": "gpt", "value": "hi"}],
    }
    missing = {**good, "image": "missing.png"}
    long = {**good, "conversations": [good["conversations"][0], {"from": "gpt", "value": "red circle " * 200}]}
    lines = [json.dumps(good), "{not json", json.dumps(missing), json.dumps(good), json.dumps(long), json.dumps(good)]
    file = tmp_path / "rows.jsonl"
    file.write_text("\n".join(lines) + "\n")
    limit = LengthLimit(64, "skip")
    position, tally = DataPosition(), SkipTally()
    heard: list[list[dict]] = []
    tally.watch(lambda _tally, new: heard.append(new))
    stream = streamed_batches(
        stream_of(str(file), processor, block=1, limit=limit), position, 3, CachedCollator(processor), "skip", tally
    )
    batch = next(stream)
    assert batch["input_ids"].shape[0] == 3 and position.records == 6  # rows 0, 3 and 5 train
    assert (tally.bad, tally.too_long) == (2, 1)
    assert [(e["file"], e["record"]) for e in tally.entries] == [(str(file), 1), (str(file), 2), (str(file), 4)]
    assert "malformed JSON" in tally.entries[0]["reason"] and "missing.png" in tally.entries[1]["reason"]
    assert heard == [tally.entries]  # told once, after the batch

    strict = streamed_batches(
        stream_of(str(file), processor, block=1), DataPosition(), 3, CachedCollator(processor), "error", SkipTally()
    )
    with pytest.raises(BadRecordError, match=rf"{file} record 1: malformed JSON"):
        next(strict)


def test_a_tiny_models_vocabulary_comes_from_the_streams_first_records(tmp_path, mixed_records):
    file = mixed_records[0]["file"]
    head = stream_head(file, ReadOptions(), 5)
    assert [record["id"] for record in head] == [record["id"] for record in mixed_records[:5]]
    assert [record["messages"] for record in head] == [record["messages"] for record in mixed_records[:5]]


def test_shards_behind_an_fsspec_url_stream_with_their_images_embedded(tmp_path, model_and_processor):
    """fsspec's in-memory file system stands in for object storage: the shards are listed and read through
    fsspec, images embedded as bytes train; an image given as a path, with no data.image_root, is a bad
    row that says where it looked."""
    _, processor = model_and_processor
    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")
    turns = [{"from": "human", "value": "<image>\nsay hi"}, {"from": "gpt", "value": "hi"}]
    rows = [{"id": str(i), "image": {"bytes": png.getvalue(), "path": None}, "conversations": turns} for i in range(5)]
    memory = fsspec.filesystem("memory")
    for number in range(2):
        with memory.open(f"/stream-test/part-{number}.parquet", "wb") as sink:
            pq.write_table(pa.Table.from_pylist(rows), sink)
    with memory.open("/stream-test/paths.jsonl", "wb") as sink:
        sink.write((json.dumps({"image": "a.png", "conversations": turns}) + "\n").encode())
    try:
        files = stream_files("memory://stream-test/*.parquet")
        assert files == ["memory:///stream-test/part-0.parquet", "memory:///stream-test/part-1.parquet"]
        encode = RecordEncoder(processor, None, "pixels")
        streamed = RecordStream(StreamOrder(tuple(files), seed=0), ReadOptions(), encode)
        first = [row for row, _ in zip(streamed, range(10), strict=False)]
        assert all(not isinstance(row.tensors, BadRecordError) for row in first)
        assert all("pixel_values" in row.tensors for row in first)
        by_path = RecordStream(StreamOrder(("memory://stream-test/paths.jsonl",), seed=0), ReadOptions(), encode)
        bad = next(iter(by_path)).tensors
        assert isinstance(bad, BadRecordError) and "data.image_root-not-set-for-a-remote-stream" in str(bad)
    finally:
        memory.rm("/stream-test", recursive=True)
