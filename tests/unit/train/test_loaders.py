"""One rank's data (launcher.train.loaders) as people have it, trained in this process: each format,
`datasets` files, multi-image, multi-turn and text-only records on both model families, mixtures that
resume bitwise, and records over data.max_length or bad, cut or skipped and listed.

Ranks whose batches differ in modality (ZeRO-3's guard, the watchdog) need two ranks:
tests/e2e/test_train.py. The data writers are tests/helpers.py's.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from launcher.core.rundir import RunDir
from launcher.data.sampling import MixtureSampler
from launcher.train.faults import FAULT_ENV
from tests.helpers import conversation, losses, read_metrics, read_summary, write_images

pytestmark = pytest.mark.slow

QUICK = ("logger=none", "train.eval_every=0", "data.eval_accuracy=false", "train.micro_batch_size=4")


# ----------------------------------------------------------------------------- data as people have it
def sample_images(index: int, names: list[str]) -> list[str]:
    count = [0, 1, 2, 3][index % 4]  # text-only, one, two and three images
    return [names[(index * 5 + k) % len(names)] for k in range(count)]


def llava_records(names: list[str], n: int) -> list[dict]:
    records = []
    for index in range(n):
        images = sample_images(index, names)
        question, answer = conversation(index, images)
        markers = "".join("<image>\n" for _ in images)
        turns = [{"from": "human", "value": markers + question}, {"from": "gpt", "value": answer}]
        records.append({"id": f"l{index}", "image": images, "conversations": turns})
    return records


def sharegpt_records(names: list[str], n: int) -> list[dict]:
    records = []
    for index in range(n):
        images = sample_images(index, names)
        question, answer = conversation(index, images)
        records.append(
            {
                "system": "Answer briefly.",
                "messages": [
                    {"role": "user", "content": "<image>" * len(images) + question},
                    {"role": "assistant", "content": answer},
                ],
                "images": images,
            }
        )
    return records


def messages_records(names: list[str], n: int) -> list[dict]:
    records = []
    for index in range(n):
        images = sample_images(index, names)
        question, answer = conversation(index, images)
        parts = [{"type": "image", "image": name} for name in images] + [{"type": "text", "text": question}]
        records.append(
            {
                "messages": [
                    {"role": "user", "content": parts},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ]
            }
        )
    return records


def parquet_records(root: Path, names: list[str], n: int) -> Path:
    """sharegpt rows with the images embedded as bytes, written with `datasets`."""
    import datasets

    rows = sharegpt_records(names, n)
    features = datasets.Features(
        {
            "system": datasets.Value("string"),
            "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
            "images": datasets.List(datasets.Image()),
        }
    )
    for row in rows:
        row["images"] = [{"bytes": (root / "img" / name).read_bytes(), "path": None} for name in row["images"]]
    path = root / "train.parquet"
    datasets.Dataset.from_list(rows, features=features).to_parquet(path)
    return path


def write_data(root: Path, fmt: str, n: int = 24) -> Path:
    names = write_images(root / "img")
    if fmt == "parquet":
        return parquet_records(root, names, n)
    writers = {"llava": llava_records, "sharegpt": sharegpt_records, "messages": messages_records}
    path = root / f"train_{fmt}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in writers[fmt](names, n)))
    return path


def write_multiturn_llava_json(root: Path) -> Path:
    """A small user data set in LLaVA format with multi-turn records and images in a subfolder."""
    images = root / "images"
    images.mkdir(parents=True)
    colours = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
    records = []
    for index in range(24):
        name, rgb = list(colours.items())[index % 3]
        Image.new("RGB", (32, 32), rgb).save(images / f"{index}.png")
        records.append(
            {
                "id": str(index),
                "image": f"images/{index}.png",
                "conversations": [
                    {"from": "human", "value": "<image>\nwhat colour is this?"},
                    {"from": "gpt", "value": name},
                    {"from": "human", "value": "and is it dark?"},
                    {"from": "gpt", "value": "no"},
                ],
            }
        )
    path = root / "train.json"
    path.write_text(json.dumps(records))
    return path


# ----------------------------------------------------------------------------- formats
@pytest.mark.parametrize(
    ("fmt", "arch", "extra"),
    [
        ("llava", "tiny_llava", []),
        ("sharegpt", "tiny_qwen2_vl", ["data.group_by_length=true"]),
        ("messages", "tiny_llava", ["data.cache=false", "data.on_bad_record=skip"]),
        ("parquet", "tiny_qwen2_vl", []),
    ],
)
def test_each_format_trains_with_multi_image_and_text_only_records(
    train_in_process, tmp_path, caplog, fmt, arch, extra
):
    """Records of 0, 1, 2 and 3 images, each format read from its own file; both model families; the
    data cache (or not), length-grouped batches. 6 steps of 4: every one of the 24 records once."""
    path = write_data(tmp_path, fmt)
    data = ["data=llava_json", f"data.path={path}", f"data.image_root={tmp_path / 'img'}"]
    ran = train_in_process(*QUICK, f"model={arch}", *data, "train.max_steps=6", *extra, run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed", ran.outcome.error
    done = read_summary(ran.run_dir)
    assert (done["status"], done["steps"], done["records_skipped"]) == ("completed", 6, 0)
    if "data.cache=false" in extra:
        assert "data_cache" not in done
    else:
        assert done["data_cache"]["built"] is True
    expected = "sharegpt" if fmt == "parquet" else fmt
    # train.log's lines (in this process the launcher's records go to pytest's handlers instead)
    assert any(re.search(rf"format {path.stem}={expected}\b", line) for line in caplog.messages), caplog.messages
    curve = losses(ran.run_dir)
    assert len(curve) == 6 and all(loss == loss for loss in curve)  # finite (not NaN)


@pytest.mark.parametrize("model", ["tiny_qwen2_vl", "tiny_llava"])
def test_user_llava_json_multiturn_data_trains(train_in_process, tmp_path, model):
    data = write_multiturn_llava_json(tmp_path / "data")
    job = (f"model={model}", "data=llava_json", f"data.path={data}", *QUICK, "train.seed=1", "train.max_steps=6")
    ran = train_in_process(*job, run_dir=tmp_path / "run")
    assert ran.outcome.status == "completed", ran.outcome.error
    curve = losses(ran.run_dir)
    assert len(curve) == 6 and curve[-1] < curve[0]
    assert read_summary(ran.run_dir)["eval_loss"] is None  # no eval file given


# ----------------------------------------------------------------------------- mixtures
def test_a_weighted_mixture_draws_by_weight_and_resumes_bitwise(train_in_process, tmp_path, monkeypatch):
    """Two sources 3:1 (a llava file and a parquet set): per-source counts follow the weights, and a run
    that stopped after its checkpoint resumes with the same losses and the same position in each source."""
    names = write_images(tmp_path / "img")
    first = tmp_path / "first.json"
    first.write_text(json.dumps(llava_records(names, 40)))
    second = parquet_records(tmp_path, names, 12)
    sources = f"data.sources=[{{path: {first}, weight: 3, name: main}}, {{path: {second}, weight: 1, name: extra}}]"
    job = (*QUICK, "data=llava_json", f"data.image_root={tmp_path / 'img'}", sources, "train.max_steps=8")
    reference = train_in_process(*job, run_dir=tmp_path / "reference")
    assert reference.outcome.status == "completed", reference.outcome.error
    counts = read_summary(reference.run_dir)["samples_per_source"]
    # 8 steps x 4 samples: in the first block of 1000 draws (exactly 3:1 per block), as the sampler deals them.
    dealt = MixtureSampler([40, 12], [3, 1], num_replicas=1, rank=0, seed=0).source_counts(32)
    assert counts == {"main": dealt[0], "extra": dealt[1]} and sum(dealt) == 32
    assert read_metrics(reference.run_dir)[-1]["data/samples_main"] == dealt[0]

    run_dir = RunDir(tmp_path / "run")
    monkeypatch.setenv(FAULT_ENV, "0:6")  # a crash in step 6, after the checkpoint of step 4
    crashed = train_in_process(*job, "train.save_every=4", run_dir=run_dir.path)
    assert crashed.outcome.exit_code == 1 and [row["step"] for row in read_metrics(run_dir.path)] == [1, 2, 3, 4, 5]
    assert read_summary(run_dir.path)["status"] == "failed" and read_summary(run_dir.path)["steps"] == 5
    monkeypatch.delenv(FAULT_ENV)
    resumed = train_in_process(f"resume={run_dir.path}", run_dir=run_dir.path)
    assert resumed.outcome.status == "completed", resumed.outcome.error
    assert read_summary(run_dir.path)["resumed_from_step"] == 4
    assert losses(run_dir.path) == losses(reference.run_dir)  # bitwise
    assert read_summary(run_dir.path)["samples_per_source"] == counts
    saved = torch.load(run_dir.checkpoint("step4") / "launcher_rank0.pt", weights_only=False)
    halfway = MixtureSampler([40, 12], [3, 1], num_replicas=1, rank=0, seed=0).source_counts(16)
    assert saved["sources"] == {
        "drawn": {"main": halfway[0], "extra": halfway[1]},
        "records": {"main": 40, "extra": 12},
    }


# ----------------------------------------------------------------------------- long and bad records
def long_and_bad_records(root: Path) -> Path:
    """JSON lines: 16 good records, one with a long answer (cut), one with a 100,000-character question
    (skipped: no room for its answer), one whose image is missing and one malformed line (bad)."""
    names = write_images(root / "img")
    rows = [json.dumps(record) for record in llava_records(names, 16)]
    long_answer = " ".join(["red green blue"] * 100)  # 300 words: about 300 tokens
    rows[3] = json.dumps(
        {
            "image": names[0],
            "conversations": [
                {"from": "human", "value": "<image>\nwhich colours?"},
                {"from": "gpt", "value": long_answer},
            ],
        }
    )
    question = ("which colours? " * 7000)[:100_000]
    rows[5] = json.dumps(
        {
            "image": names[1],
            "conversations": [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": "red"}],
        }
    )
    rows[8] = json.dumps({"image": "gone.png", "conversations": json.loads(rows[8])["conversations"]})
    rows[11] = '{"image": "red_24.png", "conversations": ['  # cut off
    path = root / "train.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("cache", ["true", "false"])
def test_max_length_cuts_and_skips_and_every_skipped_record_is_listed(train_in_process, tmp_path, caplog, cache):
    """data.max_length=128 trains with a long answer cut and a 100,000-character question skipped;
    data.on_bad_record=skip skips the bad records; each skipped record has a line in
    RUN/skipped_records.jsonl (file, record, the one-line reason) that train.log names, the same with the
    data cache and without it; a resume rewrites the file rather than adding to it."""
    path = long_and_bad_records(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    job = [
        *QUICK,
        "data=llava_json",
        f"data.path={path}",
        f"data.image_root={tmp_path / 'img'}",
        "data.max_length=128",
        "data.on_bad_record=skip",
        f"data.cache={cache}",
        "train.max_steps=2",
    ]
    ran = train_in_process(*job, run_dir=run_dir.path)
    assert ran.outcome.status == "completed", ran.outcome.error
    done = read_summary(run_dir.path)
    counts = ("records_skipped", "records_too_long", "records_truncated")
    assert (done["status"], *(done[key] for key in counts)) == ("completed", 2, 1, 1)
    assert all(loss == loss for loss in losses(run_dir.path))  # finite
    lines = [json.loads(line) for line in run_dir.skipped_records.read_text().splitlines()]
    assert [(line["file"], line["record"], line["split"]) for line in lines] == [
        (str(path), 8, "train"),
        (str(path), 11, "train"),
        (str(path), 5, "train"),
    ]
    image_root = tmp_path / "img"
    assert lines[0]["reason"] == f"{path}:9 (record 8): image file {image_root / 'gone.png'} does not exist"
    assert lines[1]["reason"].startswith(f"{path}:12: malformed JSON in record 11 (")
    assert re.fullmatch(
        rf"{path}:6 \(record 5\): [\d,]+ tokens, over data.max_length=128, and [\d,]+ of them \(prompt and images\) "
        r"come before the answer: no room for \d+ answer tokens; raise data.max_length or shorten the prompt",
        lines[2]["reason"],
    )
    assert (
        "data: 2 bad record(s) skipped, 1 record(s) over data.max_length=128 skipped, 1 record(s) truncated to "
        f"data.max_length=128: see {run_dir.skipped_records}"
    ) in caplog.messages  # train.log's line
    if cache == "true":
        more = train_in_process(f"resume={run_dir.path}", "train.max_steps=3", run_dir=run_dir.path)
        assert more.outcome.status == "completed", more.outcome.error
        again = [json.loads(line) for line in run_dir.skipped_records.read_text().splitlines()]
        assert again == lines and read_summary(run_dir.path)["steps"] == 3


# ----------------------------------------------------------------------------- videos
def write_video_data(root: Path, n: int = 24) -> Path:
    """A sharegpt set mixing image, video and text-only records (a third each), and one video cut short of the
    frames its header lists, which only decoding finds."""
    from launcher.data.video import write_video

    names = write_images(root / "img")
    for direction, step in (("right", 3), ("left", -3)):
        frames = []
        for index in range(8):
            pixels = np.zeros((32, 32, 3), dtype=np.uint8)
            x = 16 + step * (index - 4)
            pixels[12:20, x - 2 : x + 2] = 255
            frames.append(pixels)
        write_video(root / "img" / f"{direction}.mp4", frames, fps=4)
    whole = (root / "img" / "right.mp4").read_bytes()
    (root / "img" / "cut.mp4").write_bytes(whole[: int(len(whole) * 0.8)])
    rows = []
    for index in range(n):
        if index % 3 == 0:
            media, question, answer = {"images": [names[index % len(names)]]}, "<image>what colour?", "red"
        elif index % 3 == 1:
            direction = "right" if index % 2 else "left"
            media, question, answer = {"videos": [f"{direction}.mp4"]}, "<video>which way?", direction
        else:
            media, question, answer = {}, "say hi", "hi"
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({**media, "messages": messages})
    rows.append({"videos": ["cut.mp4"], "messages": [{"role": "user", "content": "<video>which way?"},
                                                     {"role": "assistant", "content": "right"}]})  # fmt: skip
    path = root / "videos.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_image_video_and_text_records_train_alike_with_the_data_cache_or_without(train_in_process, tmp_path, arch):
    """Each video trains as a video (tiny_qwen2_vl) or as its sampled frames (tiny_llava); the cache (which keeps
    the video files) and the records decoded each step give the same losses; the video cut short is skipped
    and listed, both ways."""
    path = write_video_data(tmp_path)
    job = (*QUICK, f"model={arch}", "data=llava_json", f"data.path={path}", f"data.image_root={tmp_path / 'img'}")
    job = (*job, "train.max_steps=6")
    job = (*job, "data.on_bad_record=skip", "data.video.min_frames=2", "data.video.max_frames=4")
    curves = {}
    for cache in ("true", "false"):
        ran = train_in_process(*job, f"data.cache={cache}", run_dir=tmp_path / f"cache-{cache}")
        assert ran.outcome.status == "completed", ran.outcome.error
        assert read_summary(ran.run_dir)["records_skipped"] == 1
        (listed,) = [json.loads(line) for line in (ran.run_dir / "skipped_records.jsonl").read_text().splitlines()]
        assert listed["record"] == 24 and re.search(r"cut.mp4 (ends after|fails to decode at frame)", listed["reason"])
        curves[cache] = losses(ran.run_dir)
    assert len(curves["true"]) == 6 and all(loss == loss for loss in curves["true"])
    assert curves["true"] == pytest.approx(curves["false"], rel=1e-6)


@pytest.mark.parametrize("arch", ["tiny_llava", "tiny_qwen2_vl"])
def test_a_preference_pair_with_a_video_trains_from_log_2(train_in_process, tmp_path, arch):
    """DPO on LLaMA-Factory pairs whose prompts hold a video, an image or nothing: the loss starts at log 2
    (the policy is the reference) and falls."""
    write_video_data(tmp_path)
    rows = []
    for index in range(16):
        direction, other = ("right", "left") if index % 2 else ("left", "right")
        media = {"videos": [f"{direction}.mp4"]} if index % 4 < 2 else {"images": ["red_24.png"]}
        prompt = "<video>which way?" if "videos" in media else "<image>what colour?"
        chosen, rejected = (direction, other) if "videos" in media else ("red", "blue")
        rows.append({**media, "messages": [{"role": "user", "content": prompt}],
                     "chosen": {"role": "assistant", "content": chosen},
                     "rejected": {"role": "assistant", "content": rejected}})  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    job = (*QUICK, "loss=dpo", f"model={arch}", "data=llava_json", f"data.path={path}")
    job = (*job, f"data.image_root={tmp_path / 'img'}")
    ran = train_in_process(*job, "train.max_steps=4", "data.video.min_frames=2", "data.video.max_frames=4")
    assert ran.outcome.status == "completed", ran.outcome.error
    curve = losses(ran.run_dir)
    assert curve[0] == pytest.approx(math.log(2.0), abs=1e-6) and curve[-1] < curve[0]
