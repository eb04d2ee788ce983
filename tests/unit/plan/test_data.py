"""launcher.plan.data: the plan's lines about the job's data: the built-in set, a stream, and a data file whose
record index and data cache are first estimated, then (once `launcher.prepare` built them) described as built."""

from __future__ import annotations

import json

from launcher.data.cache import Part
from launcher.data.shapes import generate_shapes
from launcher.model.stats import model_dir
from launcher.plan.data import data_lines
from launcher.prepare.prepare import prepare
from tests.helpers import compose_typed


def test_the_built_in_set_and_a_stream_read_nothing_first(tmp_path):
    assert data_lines(compose_typed([]), "unused") == [
        "data: the built-in set (4000 train, 200 eval records), made at the first start"
    ]
    for number in range(3):
        (tmp_path / f"part-{number}.jsonl").write_text("{}\n")
    stream = compose_typed(["data=llava_json", f"data.path={tmp_path}/part-*.jsonl", "data.streaming=true"])
    assert data_lines(stream, "unused") == [
        "data: streamed from 3 file(s) as training goes; nothing is indexed or cached first"
    ]


def test_a_data_file_is_estimated_before_it_is_built_and_described_after(tmp_path):
    train, _, images = generate_shapes(tmp_path / "shapes", seed=0, n_train=600, n_eval=8, image_size=32)
    rows = json.loads(train.read_text())
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = compose_typed(
        ["data=llava_json", f"data.path={tmp_path / 'train.jsonl'}", f"data.image_root={images}",
         f"cache_dir={tmp_path / 'cache'}", "data.max_length=null"]
    )  # fmt: skip
    path = model_dir(cfg)  # a tiny model: built from the data, which indexes it
    (tmp_path / "cache" / "record_index").rename(tmp_path / "moved")  # as if the model had been built elsewhere
    before = data_lines(cfg, path)
    assert before[0].startswith(f"record index of {tmp_path / 'train.jsonl'}: not built yet; estimated 600 records, ")
    assert before[1].startswith("train data cache: not built yet; estimated 600 records, ") and " s (from" in before[1]
    prepare(cfg, Part())
    after = data_lines(cfg, path)
    assert after[0].startswith(f"record index of {tmp_path / 'train.jsonl'}: built (600 records, ")
    assert after[1].startswith("train data cache: built (600 records, ")
