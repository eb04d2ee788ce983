"""launcher.plan.data: the plan's lines about the job's data: the built-in set, a stream, and a data file whose
record index and data cache are first estimated, then (once `launcher.prepare` built them) described as built;
and the records' tokens and images read from a built cache, which the plan then takes instead of data.max_length."""

from __future__ import annotations

import json

from PIL import Image

from launcher.data.cache import CachedDataset, Part
from launcher.data.packing import pack_rows
from launcher.data.shapes import generate_shapes
from launcher.job.data import prepare
from launcher.job.planning import plan_job
from launcher.job.spec import HydraJob
from launcher.model.stats import model_dir, model_stats, sequence
from launcher.plan.data import data_lines, record_shapes
from launcher.plan.report import preflight_plan, report
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


def test_once_the_data_cache_is_built_the_plan_is_of_the_records_real_tokens_and_images(tmp_path):
    """Records of 0-2 images and answers of 1 to 40 words, under a data.max_length far above them: before the
    cache exists the plan pads every sample to data.max_length; once it is built (`launcher.prepare`, or an
    earlier job) the preflight and the plan take the longest record's tokens and the most images one record
    holds (a padded or grouped micro batch is padded to its longest record), and a packed row the most images
    a row of the first epoch's packing plan holds."""
    colours = ("red", "green")
    for colour in colours:
        Image.new("RGB", (32, 32), colour).save(tmp_path / f"{colour}.png")
    rows = []
    for index in range(40):
        images = [f"{colours[(index + k) % 2]}.png" for k in range(index % 3)]
        answer = " ".join(["red square"] * (1 + index % 20))
        turns = [{"from": "human", "value": "<image>" * len(images) + "what is in the image?"},
                 {"from": "gpt", "value": answer}]  # fmt: skip
        rows.append({"id": str(index), "images": images, "conversations": turns})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = ["data=llava_json", f"data.path={tmp_path / 'train.jsonl'}", f"data.image_root={tmp_path}",
                 f"cache_dir={tmp_path / 'cache'}", "data.max_length=512", "data.eval_accuracy=false",
                 "plan.gpu_memory_gb=80"]  # fmt: skip
    cfg = compose_typed(overrides)
    path = model_dir(cfg)  # a tiny model: built from the data, which indexes it
    stats = model_stats(cfg, path=path)
    job = plan_job(cfg, HydraJob(run_dir=tmp_path, overrides=tuple(overrides)), validate=False)
    assert record_shapes(cfg, path) is None
    assert sequence(cfg, stats, None) == (512, 1)
    padded_plan = preflight_plan(cfg, job.replace(model_path=path))[1]

    _, caches = prepare(cfg, Part())
    shapes = record_shapes(cfg, path)
    cached = CachedDataset(caches["train"].path)
    assert shapes is not None and shapes.where == str(caches["train"].path)
    assert shapes.lengths.tolist() == cached.lengths().tolist() and 20 < shapes.lengths.max() < 200
    assert shapes.images.tolist() == [len(rows[i]["images"]) for i in cached.indices] and shapes.patches is None
    assert sequence(cfg, stats, shapes) == (int(shapes.lengths.max()), 2)
    assert preflight_plan(cfg, job.replace(model_path=path))[1] < padded_plan
    line = next(line for line in report(cfg, overrides).splitlines() if line.startswith("job:"))
    assert f"{shapes.lengths.max()} tokens per sample (the longest of the 40 records of the built data cache" in line

    packed = compose_typed([*overrides, "data.packing=true", "data.pack_length=256"])
    rows_of_256 = pack_rows(shapes.lengths, 256, seed=int(packed.train.seed), epoch=0)
    most = max(sum(len(rows[cached.indices[i]]["images"]) for i in row) for row in rows_of_256)
    assert sequence(packed, stats, shapes) == (256, most) and most > 3
    capped = compose_typed([*overrides, "data.packing=true", "data.pack_length=256", "data.pack_max_images=3"])
    assert sequence(capped, stats, shapes) == sequence(capped, stats, None) == (256, 3)  # data.pack_max_images
    assert sequence(compose_typed([*overrides, "plan.text_tokens=300"]), stats, shapes) == (300 + 16, 1)  # as given
