"""launcher.data.estimate: what the record index and the data cache will cost, estimated from a sample before
they are built, against what building them then costs; described as they are once built."""

from __future__ import annotations

import json
from pathlib import Path

from launcher.data.cache import RecordEncoder, ensure_cache
from launcher.data.estimate import SAMPLE_ROWS, cache_cost, index_cost
from launcher.data.formats import ReadOptions
from launcher.data.index import indexed_records
from launcher.data.records import ConversationDataset


def write_rows(shapes: tuple[Path, Path, Path], out: Path, copies: int, *, lines: bool) -> Path:
    """The built-in set's train records, `copies` times over, as JSON lines or a JSON list."""
    rows = json.loads(shapes[0].read_text()) * copies
    out.write_text("".join(json.dumps(row) + "\n" for row in rows) if lines else json.dumps(rows))
    return out


def test_an_index_is_estimated_from_its_first_rows_then_described_as_built(tmp_path, shapes):
    options = ReadOptions(image_root=shapes[2])
    for name, lines in (("data.jsonl", True), ("data.json", False)):
        path = write_rows(shapes, tmp_path / name, 20, lines=lines)  # 1,440 records: more than the sample
        estimate = index_cost(str(path), options, tmp_path / "index")
        assert not estimate.built and len(estimate.sample) == SAMPLE_ROWS
        if lines:
            assert estimate.records == 1440  # counted
        else:
            assert abs(estimate.records - 1440) / 1440 < 0.05  # the file's size over the sample's
        assert "not built yet; estimated" in estimate.line()
        indexed_records(str(path), options, tmp_path / "index")
        built = index_cost(str(path), options, tmp_path / "index")
        assert built.built and built.records == 1440 and built.seconds is not None
        assert abs(estimate.bytes - built.bytes) / built.bytes < 0.1
        assert built.line().startswith(f"record index of {path}: built (1,440 records, ")
    assert index_cost("org/name", options, tmp_path / "index") is None  # a hub id: read through `datasets`


def test_a_data_cache_is_estimated_from_eight_encoded_records(tmp_path, shapes, model_and_processor):
    """With the processor: the stored bytes of 8 records, times the records (within 10% of the cache then
    built); without: a bound, at data.max_length tokens per record."""
    _, processor = model_and_processor
    options = ReadOptions(image_root=shapes[2])
    records = list(indexed_records(str(shapes[0]), options, tmp_path / "index")[0])
    encode = RecordEncoder(processor, None, "encoded")
    estimate = cache_cost(len(records), records[:100], max_length=None, images="encoded", encode=encode, ranks=2)
    built = ensure_cache(
        tmp_path / "cache", records, processor, "m", encode, ConversationDataset(records).__getitem__,
        on_bad_record="error", num_workers=0,
    )  # fmt: skip
    assert estimate.records == built.records == 72 and not estimate.at_most and estimate.seconds > 0
    assert abs(estimate.bytes - built.bytes) / built.bytes < 0.1
    bound = cache_cost(len(records), records[:100], max_length=64, images="encoded")
    assert bound.at_most and bound.seconds is None and bound.bytes > built.bytes
    assert "at most" in bound.line()
