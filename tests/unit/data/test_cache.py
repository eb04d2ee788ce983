"""launcher.data.cache: the data cache gives the batches the processor gives, bitwise; it is keyed by what
its tensors depend on, cuts and skips what data.max_length does, and skips (or stops at) undecodable images.

Records here mix one, two and three images with text-only ones (the `mixed_records` fixture), on both tiny
model families. The guard's dummy image itself: tests/unit/data/test_collate.py.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from launcher.core.errors import Interrupted, LauncherError
from launcher.data import cache as cache_module
from launcher.data.cache import CachedCollator, CachedDataset, Part, RecordEncoder, cache_key, ensure_cache
from launcher.data.collate import Collator, fit_records
from launcher.data.formats import BadRecordError, skipped_entry
from launcher.data.length import LengthLimit
from launcher.data.records import ConversationDataset
from launcher.model.loading import load_model_and_processor
from tests.unit.data.samples import long_records, vision_inputs_alone


def build(
    tmp_path: Path,
    records: list[dict],
    processor,
    *,
    model: str = "tiny",
    on_bad_record: str = "error",
    images: str = "encoded",
    load=None,
    part: Part | None = None,
    shard_records: int = 5,  # several shards of the 12 records
    check: str = "checksums",
):
    return ensure_cache(
        tmp_path / "data_cache",
        records,
        processor,
        model,
        RecordEncoder(processor, images=images),
        load or ConversationDataset(records).__getitem__,
        on_bad_record=on_bad_record,
        num_workers=0,
        part=part or Part(),
        shard_records=shard_records,
        check=check,
    )


def assert_same_batch(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("images", ["encoded", "pixels"])
def test_cached_batches_equal_the_processors_bitwise(tmp_path, mixed_records, model_and_processor, images):
    """Either way the cache keeps images (their files' bytes, decoded and processed as a batch is read; or
    the processor's pixel values), in shards of 5 records."""
    _, processor = model_and_processor
    info = build(tmp_path, mixed_records, processor, images=images)
    assert info.built and (info.records, info.skipped) == (12, 0)
    assert len(list((info.path / "shards").iterdir())) == 3
    cached = CachedDataset(info.path, processor)
    live = ConversationDataset(mixed_records)
    for guard in (False, True):
        collate, cached_collate = (
            Collator(processor, image_every_batch=guard),
            CachedCollator(processor, image_every_batch=guard),
        )
        for rows in ([0, 1, 2, 3], [2, 3], [5, 10], [0, 4, 8], [0], [3, 7, 11, 1]):
            expected = collate([live[i] for i in rows])
            assert_same_batch(cached_collate([cached[i] for i in rows]), expected)
    assert cached.lengths().tolist() == [len(Collator(processor)([live[i]])["input_ids"][0]) for i in range(12)]
    # What the memory planner reads of each record without its pixels: its images (0 to 3), and for Qwen2-VL
    # their vision-tower patches, as the processor makes them.
    images, patches = cached.vision_inputs()
    expected_images, expected_patches = vision_inputs_alone(processor, live, 12)
    assert images.tolist() == expected_images and sorted(set(expected_images)) == [0, 1, 2, 3]
    assert (patches if patches is None else patches.tolist()) == expected_patches
    # Token ids and labels are stored in 32 bits (read back as the processor's int64, as compared above).
    for name in ("input_ids", "labels"):
        assert (info.path / "shards" / "00000" / f"{name}.bin").stat().st_size == 4 * sum(cached.lengths()[:5])


def test_the_cache_is_reused_and_rebuilt_when_its_inputs_change(tmp_path, mixed_records, model_and_processor):
    _, processor = model_and_processor
    first = build(tmp_path, mixed_records, processor)
    again = build(tmp_path, mixed_records, processor)
    assert not again.built and again.path == first.path
    assert build(tmp_path, mixed_records, processor, model="another").path != first.path
    second_source = [{**r, "source": 1} for r in mixed_records]  # the same records, another mixture position
    assert build(tmp_path, second_source, processor).path != first.path
    edited = [dict(r) for r in mixed_records]
    edited[0] = {**edited[0], "messages": [*edited[0]["messages"][:-1], {"role": "assistant", "content": []}]}
    assert build(tmp_path, edited, processor).path != first.path
    image = next(r["images"][0] for r in mixed_records if r["images"])
    stat = os.stat(image)
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the image file changed
    try:
        assert build(tmp_path, mixed_records, processor).path != first.path
    finally:
        os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    mean = processor.image_processor.image_mean
    processor.image_processor.image_mean = [0.1, 0.2, 0.3]  # another processor setting
    try:
        assert build(tmp_path, mixed_records, processor).path != first.path
    finally:
        processor.image_processor.image_mean = mean
    assert not [p for p in (tmp_path / "data_cache").iterdir() if p.name.startswith(".")]  # no leftovers


def test_the_cache_cuts_and_skips_records_over_max_length_as_the_collator_does(tmp_path, model_and_processor):
    """data.max_length: the cached path and the uncached path cut and skip the same records the same way."""
    _, processor = model_and_processor
    records = long_records(tmp_path)  # short, long answer, long answer before a second image, long prompt
    limit = LengthLimit(64)

    def build_limited(limit: LengthLimit):
        return ensure_cache(
            tmp_path / "data_cache",
            records,
            processor,
            "tiny",
            RecordEncoder(processor, limit),
            ConversationDataset(records).__getitem__,
            on_bad_record="error",  # a record too long is skipped whatever this says
            num_workers=0,
        )

    info = build_limited(limit)
    assert (info.records, info.skipped, info.truncated, info.too_long) == (3, 0, 2, 1)
    uncached = fit_records(records, processor, limit, num_workers=0)
    assert info.skip_log == [skipped_entry(str(tmp_path / "long.json"), 3, uncached.skipped[0][1])]
    cached = CachedDataset(info.path, processor)
    assert cached.indices.tolist() == uncached.kept == [0, 1, 2] and max(cached.lengths()) == 64
    live = ConversationDataset(records)
    for rows in ([0, 1, 2], [1], [0], [2, 0]):
        expected = Collator(processor, limit=limit)([live[i] for i in rows])
        assert_same_batch(CachedCollator(processor)([cached[i] for i in rows]), expected)
    again = build_limited(limit)  # reused: it still says what it cut and skipped
    assert not again.built and (again.truncated, again.too_long, again.skip_log) == (2, 1, info.skip_log)
    assert build_limited(LengthLimit(64, "skip")).path != info.path  # the limit is part of the key
    assert build_limited(LengthLimit(None)).records == 4
    records = records[3:]  # the long prompt alone: nothing to train on, one line saying why
    with pytest.raises(LauncherError, match=r"^data: none of the 1 records fits data.max_length=64 \(1 too long"):
        build_limited(limit)


def test_undecodable_images_are_skipped_while_building_or_stop_it(tmp_path, mixed_records, model_and_processor):
    _, processor = model_and_processor
    whole = Path(next(r["images"][0] for r in mixed_records if r["images"]))
    cut = tmp_path / "cut.png"
    Image.new("RGB", (64, 64), "red").save(cut)
    cut.write_bytes(cut.read_bytes()[:60])  # the header survives, the pixels do not
    records = [dict(r) for r in mixed_records]
    records[5] = {**records[5], "images": [str(cut)]}
    assert records[5]["messages"][0]["content"][0] == {"type": "image"} and whole.is_file()

    info = build(tmp_path, records, processor, on_bad_record="skip")
    assert (info.records, info.skipped) == (11, 1)
    [entry] = info.skip_log  # for RUN/skipped_records.jsonl: the line data.on_bad_record=error stops with
    assert (entry["file"], entry["record"]) == (records[5]["file"], 5)
    assert entry["reason"].startswith(f"{records[5]['where']}: cannot decode image {cut}")
    cached = CachedDataset(info.path, processor)
    assert [cached[i]["id"] for i in range(len(cached))] == [r["id"] for r in records if r["id"] != "5"]
    assert cached.indices.tolist() == [i for i in range(12) if i != 5]
    with pytest.raises(BadRecordError, match=r"record 5: cannot decode image .*cut.png"):
        build(tmp_path / "strict", records, processor)
    # Nothing that looks complete: the build's directory keeps the shard done before the bad record
    # (records 0-4) for the next attempt, and no cache is named by its key.
    (building,) = (tmp_path / "strict" / "data_cache").iterdir()
    assert building.name.startswith(".") and building.name.endswith(".building")
    assert sorted(path.name for path in (building / "shards").iterdir()) == ["00000"]
    with pytest.raises(LauncherError, match="none of the 1 records could be decoded"):
        build(tmp_path / "none", records[5:6], processor, on_bad_record="skip")


def test_building_the_cache_leaves_the_global_random_state_as_it_was(tmp_path, mixed_records, model_and_processor):
    """A run that builds the cache must go on with the random state of one that found it built: a resumed
    run (which finds it) ends bitwise where the uninterrupted one (which built it) does."""
    _, processor = model_and_processor
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert build(tmp_path, mixed_records, processor).built
    assert torch.equal(torch.get_rng_state(), before)


def test_the_key_of_a_processor_does_not_change_when_it_encodes(mixed_records, model_and_processor):
    """A processor that has padded a batch (rank 0's, after building the train split's cache) must give the
    key a fresh one gives, or every other rank would build its own cache."""
    _, processor = model_and_processor
    _, fresh = load_model_and_processor(processor.tokenizer.name_or_path)
    Collator(processor)(list(ConversationDataset(mixed_records[:4])))
    assert processor.tokenizer.backend_tokenizer.padding != fresh.tokenizer.backend_tokenizer.padding
    assert cache_key(mixed_records, processor, "tiny") == cache_key(mixed_records, fresh, "tiny")
    assert cache_key(mixed_records, processor, "tiny", LengthLimit(64)) != cache_key(mixed_records, processor, "tiny")


def test_a_cached_dataset_pickles_without_its_memory_maps(tmp_path, mixed_records, model_and_processor):
    """DataLoader workers get the dataset pickled and open their own maps; an incomplete cache is refused."""
    _, processor = model_and_processor
    info = build(tmp_path, mixed_records, processor)
    cached = CachedDataset(info.path, processor)
    first = cached[3]
    assert cached._maps is not None and cached._ids is not None
    clone = pickle.loads(pickle.dumps(cached))
    assert clone._maps is None and clone._ids is None and clone.indices.tolist() == cached.indices.tolist()
    assert clone[3]["id"] == first["id"] and clone.sources.tolist() == cached.sources.tolist()
    # Which records it holds are arrays (records.npz, ids.arrow): meta.json, which every rank parses, holds
    # no list as long as the records.
    meta = json.loads((info.path / "meta.json").read_text())
    assert not [key for key, value in meta.items() if isinstance(value, list) and len(value) >= len(cached)]
    assert all(torch.equal(clone[3]["tensors"][name], tensor) for name, tensor in first["tensors"].items())
    (info.path / "meta.json").unlink()  # what a crash before the last write leaves
    with pytest.raises(LauncherError, match=r"not a complete data cache; delete it to have it built again"):
        CachedDataset(info.path, processor)


def _tensors(dataset: CachedDataset) -> list[dict[str, torch.Tensor]]:
    return [dataset[i]["tensors"] for i in range(len(dataset))]


def test_two_ranks_build_disjoint_shards_at_once_into_the_cache_one_would(tmp_path, mixed_records, model_and_processor):
    """Each rank (a thread here, with its own processor) loads only the records of its shards; rank 0 writes
    meta.json once both are done; the cache is the one a single process builds."""
    _, processor = model_and_processor
    barrier = threading.Barrier(2, timeout=120)
    loaded: dict[int, list[int]] = {0: [], 1: []}
    infos: dict[int, Any] = {}

    def rank(number: int) -> None:
        own = copy.deepcopy(processor)
        records = ConversationDataset(mixed_records)

        def load(index: int) -> dict:
            loaded[number].append(index)
            return records[index]

        part = Part(number, 2, barrier.wait)
        infos[number] = build(tmp_path / "two", mixed_records, own, load=load, part=part, shard_records=3)

    threads = [threading.Thread(target=rank, args=(number,)) for number in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Shards of 3 records: rank 0 builds shards 0 and 2, rank 1 shards 1 and 3.
    assert (sorted(loaded[0]), sorted(loaded[1])) == ([0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11])
    assert infos[0].path == infos[1].path and infos[0].built and infos[0].records == 12
    alone = build(tmp_path / "one", mixed_records, processor, shard_records=3)
    assert alone.path.name == infos[0].path.name
    for ours, theirs in zip(
        _tensors(CachedDataset(infos[0].path, processor)), _tensors(CachedDataset(alone.path, processor)), strict=True
    ):
        assert_same_batch(ours, theirs)


def test_a_killed_build_resumes_from_its_complete_shards(tmp_path, mixed_records, model_and_processor):
    _, processor = model_and_processor
    records = ConversationDataset(mixed_records)
    loaded: list[int] = []

    def killed_at_7(index: int) -> dict:
        if index == 7:
            raise KeyboardInterrupt  # what a signal's handler raises in the middle of shard 1
        loaded.append(index)
        return records[index]

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path, mixed_records, processor, load=killed_at_7)
    assert loaded == [0, 1, 2, 3, 4, 5, 6]
    loaded.clear()
    info = build(tmp_path, mixed_records, processor, load=lambda index: (loaded.append(index), records[index])[1])
    assert loaded == list(range(5, 12))  # shard 0 (records 0-4) was complete
    assert info.built and info.records == 12
    assert [p.name for p in (tmp_path / "data_cache").iterdir()] == [info.path.name]  # no leftovers


@pytest.mark.parametrize(
    "damage_to",
    ["flip a byte of shard 1's tokens", "cut shard 2's tokens short", "delete shard 0's offsets", "flip the ids"],
)
def test_a_damaged_cache_is_named_and_only_its_damaged_shards_are_built_again(
    tmp_path, mixed_records, model_and_processor, caplog, damage_to
):
    """Nothing trains on damaged bytes (issue 42): every start checks the files against meta.json's sizes and
    checksums; a damaged shard is built again, the intact ones kept, and the cache reads as it was built."""
    _, processor = model_and_processor
    records = ConversationDataset(mixed_records)
    first = build(tmp_path, mixed_records, processor)
    expected = _tensors(CachedDataset(first.path, processor))
    shards = first.path / "shards"
    if damage_to.startswith("flip a byte"):
        target, rebuilt = shards / "00001" / "input_ids.bin", [5, 6, 7, 8, 9]
        data = bytearray(target.read_bytes())
        data[3] ^= 0x01  # the same size: only the checksum can tell
        target.write_bytes(bytes(data))
    elif damage_to.startswith("cut"):
        target, rebuilt = shards / "00002" / "input_ids.bin", [10, 11]
        target.write_bytes(target.read_bytes()[:-4])
    elif damage_to.startswith("delete"):
        target, rebuilt = shards / "00000" / "index.npz", [0, 1, 2, 3, 4]
        target.unlink()
    else:
        target, rebuilt = first.path / "ids.arrow", []
        data = bytearray(target.read_bytes())
        data[-20] ^= 0xFF
        target.write_bytes(bytes(data))
    loaded: list[int] = []
    with caplog.at_level("WARNING", logger="launcher"):
        again = build(tmp_path, mixed_records, processor, load=lambda i: (loaded.append(i), records[i])[1])
    damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(damaged) == 1 and str(target) in damaged[0], damaged
    assert loaded == rebuilt
    assert again.path == first.path and again.built and again.records == 12
    assert_same_tensors(_tensors(CachedDataset(again.path, processor)), expected)
    assert cache_module.cache_damage(again.path) == {}
    assert [p.name for p in (tmp_path / "data_cache").iterdir()] == [first.path.name]  # no leftovers
    caplog.clear()
    build(tmp_path, mixed_records, processor, load=lambda i: (loaded.append(i), records[i])[1])
    assert loaded == rebuilt and not caplog.records  # intact now: reused as it is


def test_two_jobs_starting_on_one_damaged_cache_check_it_in_turn_and_both_train_on_the_repaired_one(
    tmp_path, mixed_records, model_and_processor, monkeypatch
):
    """Two jobs of a sweep start on a cache with a flipped byte. Without a turn each, both found the damage;
    the second reopened the cache and was rebuilding it when the first, done checking, tried to reopen a
    cache no longer there, and failed. The first job's check is held for 1 s; the second waits for it,
    finds the cache being rebuilt, and builds with it (as two jobs on a missing cache do)."""
    _, processor = model_and_processor
    first = build(tmp_path, mixed_records, processor)
    expected = _tensors(CachedDataset(first.path, processor))
    target = first.path / "shards" / "00001" / "input_ids.bin"
    data = bytearray(target.read_bytes())
    data[3] ^= 0x01
    target.write_bytes(bytes(data))
    checked = cache_module.cache_damage
    in_check = threading.Event()

    def slow_check(*args, **kwargs):  # the first job's check: long enough for the second to arrive
        found = checked(*args, **kwargs)
        if not in_check.is_set():
            in_check.set()
            time.sleep(1.0)
        return found

    monkeypatch.setattr(cache_module, "cache_damage", slow_check)
    results: dict[str, Any] = {}
    records = ConversationDataset(mixed_records)

    def slow_load(index: int) -> dict:  # the second job's shard is still being written when the first wakes
        time.sleep(0.4)
        return records[index]

    def job(name: str) -> None:
        try:
            results[name] = build(tmp_path, mixed_records, processor, load=None if name == "first" else slow_load)
        except BaseException as error:
            results[name] = error

    first_job = threading.Thread(target=job, args=("first",))
    first_job.start()
    assert in_check.wait(60)
    second_job = threading.Thread(target=job, args=("second",))
    second_job.start()
    first_job.join(120)
    second_job.join(120)
    for name in ("first", "second"):
        assert not isinstance(results[name], BaseException), (name, results[name])
        assert results[name].path == first.path
    assert cache_module.cache_damage(first.path) == {}
    assert_same_tensors(_tensors(CachedDataset(first.path, processor)), expected)
    assert [p.name for p in (tmp_path / "data_cache").iterdir()] == [first.path.name]


def test_auto_keeps_pixels_while_a_splits_pixel_values_surely_fit_and_encoded_images_otherwise(
    mixed_records, model_and_processor
):
    """data.cache_images=auto (the default): the built-in set's 32 x 32 images as pixel values (decoding them
    each step cost the default job 1.36x the CPU, issue 44), LLaVA-665K's as their files' bytes."""
    _, processor = model_and_processor
    image_processor = processor.image_processor
    side = 32  # the tiny families' image size (tests' SIZES)
    per_image = side * side * 3 * 4 * getattr(image_processor, "temporal_patch_size", 1)  # Qwen2-VL: its frames
    assert cache_module.pixel_bytes_bound(image_processor) == per_image
    images_per_record = sum(len(r["images"]) for r in mixed_records) / len(mixed_records)
    fits = int(cache_module.PIXELS_BUDGET_BYTES / (per_image * images_per_record))
    assert cache_module.image_storage("auto", processor, mixed_records, fits, videos=False) == "pixels"
    assert cache_module.image_storage("auto", processor, mixed_records, fits + 1, videos=False) == "encoded"
    assert cache_module.image_storage("encoded", processor, mixed_records, 1, videos=False) == "encoded"  # as given
    assert cache_module.image_storage("pixels", processor, mixed_records, 10**9, videos=False) == "pixels"
    text_only = [r for r in mixed_records if not r["images"]]
    assert cache_module.image_storage("auto", processor, text_only, 10**9, videos=False) == "pixels"  # no image to keep

    unbounded = type("Unbounded", (), {"size": {"shortest_edge": 224}})()  # nothing in its config bounds it
    assert cache_module.pixel_bytes_bound(unbounded) is None


def test_data_cache_check_sizes_finds_a_file_cut_short_but_not_a_byte_changed(
    tmp_path, mixed_records, model_and_processor
):
    """data.cache_check=sizes: a stat per file, for starts that cannot afford reading the cache through."""
    _, processor = model_and_processor
    records = ConversationDataset(mixed_records)
    first = build(tmp_path, mixed_records, processor)
    target = first.path / "shards" / "00001" / "labels.bin"
    data = bytearray(target.read_bytes())
    data[0] ^= 0x01
    target.write_bytes(bytes(data))
    loaded: list[int] = []
    load = lambda i: (loaded.append(i), records[i])[1]  # noqa: E731
    assert not build(tmp_path, mixed_records, processor, load=load, check="sizes").built and loaded == []
    target.write_bytes(bytes(data[:-4]))
    assert build(tmp_path, mixed_records, processor, load=load, check="sizes").built and loaded == [5, 6, 7, 8, 9]


def test_a_cache_whose_meta_json_cannot_be_read_is_built_again(tmp_path, mixed_records, model_and_processor, caplog):
    _, processor = model_and_processor
    first = build(tmp_path, mixed_records, processor)
    expected = _tensors(CachedDataset(first.path, processor))
    (first.path / "meta.json").write_text('{"version": 7, "key": "cut sho')
    with caplog.at_level("WARNING", logger="launcher"):
        again = build(tmp_path, mixed_records, processor)
    assert again.built and again.path == first.path
    assert any("meta.json cannot be read (damaged)" in r.getMessage() for r in caplog.records)
    assert_same_tensors(_tensors(CachedDataset(again.path, processor)), expected)
    assert [p.name for p in (tmp_path / "data_cache").iterdir()] == [first.path.name]


def test_a_cache_from_before_the_checksums_is_trusted_as_it_is(tmp_path, mixed_records, model_and_processor):
    _, processor = model_and_processor
    first = build(tmp_path, mixed_records, processor)
    meta_file = first.path / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["files"]
    meta_file.write_text(json.dumps(meta))
    assert cache_module.cache_damage(first.path) == {}
    assert not build(tmp_path, mixed_records, processor, load=lambda i: pytest.fail(f"record {i} built again")).built


def assert_same_tensors(got: list[dict[str, torch.Tensor]], expected: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_stop_request_ends_the_build_between_shards_and_the_next_start_builds_the_rest(
    tmp_path, mixed_records, model_and_processor
):
    """A stop signal during a build (here its flag, set while shard 1 is written) ends the build after that
    shard, in one line that says what is kept; no cache looks complete, and the next build writes only the
    shards still missing, into the cache an uninterrupted build makes."""
    _, processor = model_and_processor
    records = ConversationDataset(mixed_records)
    loaded: list[int] = []

    def load(index: int) -> dict:
        loaded.append(index)
        return records[index]

    stop = Part(stop_wanted=lambda: 7 in loaded)  # asked to stop during shard 1 (records 5-9)
    with pytest.raises(Interrupted, match=r"while building the data cache .*: 2 of its 3 shards are written and kept"):
        build(tmp_path, mixed_records, processor, load=load, part=stop)
    assert loaded == list(range(10))  # shard 1 was finished, shard 2 not begun
    assert not [path for path in (tmp_path / "data_cache").iterdir() if not path.name.startswith(".")]
    loaded.clear()
    info = build(tmp_path, mixed_records, processor, load=load)
    assert loaded == [10, 11] and info.built and info.records == 12
    alone = build(tmp_path / "alone", mixed_records, processor)
    assert info.path.name == alone.path.name
    for ours, theirs in zip(
        _tensors(CachedDataset(info.path, processor)), _tensors(CachedDataset(alone.path, processor)), strict=True
    ):
        assert_same_batch(ours, theirs)


def test_ranks_stop_a_build_together_when_one_of_them_is_asked_to(tmp_path, mixed_records, model_and_processor):
    """Only rank 1 is asked to stop (a signal to one process): both ranks agree at the build's barrier and
    stop, so neither waits for the other's shards or writes meta.json."""
    _, processor = model_and_processor
    barrier = threading.Barrier(2, timeout=120)
    votes: list[bool] = [False, False]

    def any_rank(number: int, flag: bool) -> bool:
        votes[number] = flag
        barrier.wait()
        agreed = any(votes)
        barrier.wait()
        return agreed

    errors: dict[int, BaseException] = {}

    def rank(number: int) -> None:
        part = Part(number, 2, barrier.wait, stop_wanted=lambda: number == 1, any_rank=partial(any_rank, number))
        try:
            build(tmp_path, mixed_records, copy.deepcopy(processor), part=part, shard_records=3)
        except Interrupted as err:
            errors[number] = err

    threads = [threading.Thread(target=rank, args=(number,)) for number in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(errors) == [0, 1]
    assert "2 of its 4 shards are written and kept" in str(errors[0])  # rank 0's shards 0 and 2; rank 1 none
    assert not [path for path in (tmp_path / "data_cache").iterdir() if not path.name.startswith(".")]


def test_an_encoded_cache_stores_each_images_file_and_a_fraction_of_the_pixels(
    tmp_path, mixed_records, model_and_processor
):
    _, processor = model_and_processor
    encoded = build(tmp_path / "encoded", mixed_records, processor)
    pixels = build(tmp_path / "pixels", mixed_records, processor, images="pixels")
    stored = sum((shard / "image_bytes.bin").stat().st_size for shard in (encoded.path / "shards").iterdir())
    assert stored == sum(os.path.getsize(image) for record in mixed_records for image in record["images"])
    assert not list(pixels.path.rglob("image_bytes.bin")) and not list(encoded.path.rglob("pixel_values.bin"))
    assert encoded.bytes < pixels.bytes


def test_a_build_whose_shard_a_finishing_job_removed_waits_for_that_jobs_cache(
    tmp_path, mixed_records, model_and_processor, monkeypatch
):
    """Two jobs build one cache at once (a parallel sweep): the one that finishes removes the temporary
    shards it finds, this job's in-progress one among them, before it renames the build into place. This
    job's write then fails (the shard's folder is gone); it waits for the other's cache and uses it."""
    _, processor = model_and_processor
    write_records = cache_module._write_records

    def slow_write_records(out, shards):  # widen the window between the removal and the rename to 1 s
        time.sleep(1.0)
        write_records(out, shards)

    monkeypatch.setattr(cache_module, "_write_records", slow_write_records)
    other: dict = {}
    records = ConversationDataset(mixed_records)

    def load(index: int) -> dict:
        if not other:  # this job's first record: the other job builds the whole cache meanwhile
            other["thread"] = threading.Thread(
                target=lambda: other.setdefault("info", build(tmp_path, mixed_records, processor))
            )
            other["thread"].start()
            deadline = time.monotonic() + 60
            temporary = tmp_path / "data_cache"
            while list(temporary.glob(".*.building/shards/.*")) and time.monotonic() < deadline:
                time.sleep(0.01)  # until the other job has removed this job's temporary shard (and its own)
        return records[index]

    info = build(tmp_path, mixed_records, processor, load=load)
    other["thread"].join()
    assert info.path == other["info"].path and info.records == 12
