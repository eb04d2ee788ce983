"""launcher.data.splits: a split's records reach their loader through one interface whichever kind of
source they are. The decoded split and the cached split of the same records keep, cut, skip and count the
same records and collate to the same batches; the modality guard's blank video is asked for only where
a model takes videos as videos and the data may hold one. Streams: tests/unit/data/test_stream.py and
tests/unit/train/test_loaders.py."""

from __future__ import annotations

import pytest
import torch

from launcher.data.cache import RecordEncoder, ensure_cache
from launcher.data.formats import SkipTally
from launcher.data.index import Records
from launcher.data.length import LengthLimit
from launcher.data.records import ConversationDataset
from launcher.data.splits import ModalityGuard, cached_split, decoded_split
from launcher.data.video import takes_videos
from tests.helpers import compose_typed
from tests.unit.data.samples import long_records


@pytest.mark.parametrize("guard", [ModalityGuard(False), ModalityGuard(True)], ids=["unguarded", "guarded"])
def test_the_decoded_and_the_cached_split_of_the_same_records_are_the_same_split(tmp_path, model_and_processor, guard):
    _, processor = model_and_processor
    records = Records([long_records(tmp_path)])  # short, long answer (cut), two images (cut), long prompt (skipped)
    data = compose_typed(["data.max_length=64", "data.num_workers=0"]).data
    info = ensure_cache(
        tmp_path / "data_cache", records, processor, "tiny", RecordEncoder(processor, LengthLimit.of(data)),
        ConversationDataset(records).__getitem__, on_bad_record="error", num_workers=0,
    )  # fmt: skip
    decoded = decoded_split(data, processor, records, guard, "eval")
    cached = cached_split(info, processor, guard, "eval")

    assert list(decoded.kept) == list(cached.kept) == [0, 1, 2] and len(decoded.dataset) == len(cached.dataset) == 3
    assert decoded.cache is None and cached.cache is info
    for split in (decoded, cached):
        assert (split.skips.bad, split.skips.too_long, split.skips.truncated) == (0, 1, 2)
        [entry] = split.skips.entries
        assert (entry["split"], entry["record"]) == ("eval", 3) and "data.max_length=64" in entry["reason"]
    for rows in ([0, 1, 2], [2, 0], [1]):
        made = decoded.collate([decoded.dataset[i] for i in rows])
        read = cached.collate([cached.dataset[i] for i in rows])
        assert sorted(made) == sorted(read)
        for key in made:
            assert made[key].dtype == read[key].dtype and torch.equal(made[key], read[key]), key

    run = SkipTally(bad=2, entries=[{"split": "train"}])  # the run's count takes in each split's
    run.merge(decoded.skips)
    assert (run.bad, run.too_long, run.truncated, len(run.entries)) == (2, 1, 2, 2)


def test_the_guard_gives_a_blank_video_only_to_a_model_of_videos_whose_data_may_hold_one(model_and_processor):
    _, processor = model_and_processor
    images, videos = Records([[{"videos": []}]]), Records([[{"videos": ["clip.mp4"]}]])
    video_model = takes_videos(processor)  # the Qwen2-VL family; LLaVA takes a video's frames as images
    assert ModalityGuard.of(True, processor, [images, Records([])], streaming=False) == ModalityGuard(True, False)
    assert ModalityGuard.of(True, processor, [images, videos], streaming=False) == ModalityGuard(True, video_model)
    assert ModalityGuard.of(True, processor, [images], streaming=True) == ModalityGuard(True, video_model)
    assert ModalityGuard.of(False, processor, [videos], streaming=True) == ModalityGuard(False, False)
    assert ModalityGuard(True, True).args() == {"image_every_batch": True, "video_every_batch": True}
