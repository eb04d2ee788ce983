"""launcher.data.records: a job's sources (one file, a weighted mixture, the built-in set) read from the
typed data config, their records in one form, the dataset over them, and one global batch at least."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from launcher.config.schema import DataConfig, SourceConfig
from launcher.core.errors import LauncherError
from launcher.data.records import ConversationDataset, data_sources, read_data, require_one_global_batch
from tests.helpers import compose_typed
from tests.unit.data.samples import MULTI_TURN, record, write_image

SMALL_SHAPES = ("data=shapes", "data.n_train=8", "data.n_eval=4")


def user_data(**fields) -> DataConfig:
    """data=llava_json as composed, with `fields` set on the typed config."""
    return dataclasses.replace(compose_typed(["data=llava_json"]).data, **fields)


def write_records(path: Path, rows: list[dict]) -> str:
    path.write_text(json.dumps(rows))
    return str(path)


def test_the_built_in_set_is_generated_and_read_without_header_checks(tmp_path):
    """The built-in set's images are the project's own: read without opening each header; a user's file
    is read with the check."""
    data = compose_typed(list(SMALL_SHAPES)).data
    sources, eval_source = data_sources(data, tmp_path / "cache")
    assert [source.name for source in sources] == ["shapes"] and eval_source.name == "eval"
    assert not sources[0].options.check_headers and not eval_source.options.check_headers
    loaded = read_data(data, tmp_path / "cache")
    assert (len(loaded.train), len(loaded.eval), loaded.skipped, loaded.formats) == (8, 4, 0, ["llava"])
    assert not loaded.mixture and {r["source"] for r in loaded.train} == {0}

    write_image(tmp_path / "a.png")
    user = user_data(path=write_records(tmp_path / "d.json", [record()]))
    assert data_sources(user, tmp_path / "cache")[0][0].options.check_headers


def test_a_mixture_reads_each_source_with_its_own_options_and_marks_its_records(tmp_path):
    write_image(tmp_path / "one" / "a.png")
    write_image(tmp_path / "two" / "pictures" / "a.png", colour="red")
    first = write_records(tmp_path / "one" / "first.json", [record(id="x"), MULTI_TURN])
    messages = [{"role": "user", "content": "<image>colour?"}, {"role": "assistant", "content": "red"}]
    second = write_records(tmp_path / "two" / "second.json", [{"messages": messages, "images": ["a.png"]}])
    held_out = write_records(tmp_path / "one" / "eval.json", [record(id="e")])
    data = user_data(
        sources=[
            SourceConfig(path=first, weight=3),
            SourceConfig(path=second, weight=1, name="reds", image_root=str(tmp_path / "two" / "pictures")),
        ],
        eval_path=held_out,
        image_root=str(tmp_path / "one"),
    )
    sources, eval_source = data_sources(data, tmp_path / "cache")
    assert [(s.name, s.weight) for s in sources] == [("first", 3.0), ("reds", 1.0)]
    assert sources[1].options.image_root == tmp_path / "two" / "pictures"
    assert sources[0].options.image_root == eval_source.options.image_root == tmp_path / "one"

    loaded = read_data(data, tmp_path / "cache")
    assert loaded.mixture and loaded.formats == ["llava", "sharegpt"]
    assert [(r["id"], r["source"]) for r in loaded.train] == [("x", 0), ("multi", 0), (loaded.train[2]["id"], 1)]
    assert loaded.train[2]["images"] == [str(tmp_path / "two" / "pictures" / "a.png")]
    assert [r["id"] for r in loaded.eval] == ["e"]


def test_records_skipped_are_logged_by_split(tmp_path):
    write_image(tmp_path / "a.png")
    train = write_records(tmp_path / "train.json", [record(), record(image="gone.png"), record()])
    held_out = write_records(tmp_path / "eval.json", [record(image="lost.png"), record()])
    loaded = read_data(user_data(path=train, eval_path=held_out, on_bad_record="skip"), tmp_path / "cache")
    assert (len(loaded.train), len(loaded.eval), loaded.skipped) == (2, 1, 2)
    assert [(e["split"], e["file"], e["record"]) for e in loaded.skip_log] == [
        ("train", train, 1),
        ("eval", held_out, 0),
    ]
    assert "gone.png does not exist" in loaded.skip_log[0]["reason"]
    with pytest.raises(LauncherError, match=r"record 1: image file .*gone.png does not exist"):
        read_data(user_data(path=train, eval_path=held_out), tmp_path / "cache")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param(
            {}, r"^data.path is not set for data=llava_json: give the training file, folder or hub id$", id="no path"
        ),
        pytest.param(
            {"path": "{tmp}/absent.json"}, r"^data.path={tmp}/absent.json: no such file or folder$", id="absent"
        ),
        pytest.param(
            {"path": "{tmp}/d.json", "sources": [SourceConfig(path="{tmp}/d.json")]},
            r"^data.path and data.sources are both set",
            id="path and sources",
        ),
        pytest.param(
            {"sources": [SourceConfig(path="{tmp}/d.json", weight=0)]},
            r"^data.sources\[0\].weight=0: a mixture weight must be a positive number$",
            id="zero weight",
        ),
        pytest.param(
            {"sources": [SourceConfig(path="{tmp}/d.json", weight=-2.5)]},
            r"^data.sources\[0\].weight=-2.5",
            id="negative weight",
        ),
        pytest.param(
            {"sources": [SourceConfig(path="{tmp}/d.json"), SourceConfig(path="{tmp}/d.json")]},
            r"^data.sources: names \['d', 'd'\] repeat; give each source a distinct name$",
            id="names repeat",
        ),
        pytest.param({"sources": [SourceConfig(path="")]}, r"^data.sources\[0\].path is not set", id="empty source"),
        pytest.param(
            {"path": "{tmp}/d.json", "image_root": "{tmp}/nowhere"},
            r"^data.image_root={tmp}/nowhere: no such directory$",
            id="no image root",
        ),
        pytest.param(
            {"path": "{tmp}/d.json", "eval_path": "{tmp}/no_eval.json"},
            r"^data.eval_path={tmp}/no_eval.json: no such file or folder$",
            id="no eval file",
        ),
    ],
)
def test_sources_that_cannot_be_read_are_one_line_naming_the_key(tmp_path, fields, message):
    write_image(tmp_path / "a.png")
    write_records(tmp_path / "d.json", [record()])

    def placed(value):
        if isinstance(value, str):
            return value.replace("{tmp}", str(tmp_path))
        if isinstance(value, list):
            return [dataclasses.replace(s, path=placed(s.path)) for s in value]
        return value

    with pytest.raises(LauncherError, match=message.replace("{tmp}", re.escape(str(tmp_path)))):
        data_sources(user_data(**{key: placed(value) for key, value in fields.items()}), tmp_path / "cache")


def test_the_dataset_decodes_each_records_images_to_rgb(tmp_path):
    Image.new("L", (20, 10), 128).save(tmp_path / "grey.png")
    write_image(tmp_path / "a.png")
    turns = [{"from": "human", "value": "<image><image>\nsame?"}, {"from": "gpt", "value": "no"}]
    text_only = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    path = write_records(
        tmp_path / "d.json",
        [
            {"id": "two", "image": ["grey.png", "a.png"], "conversations": turns},
            {"id": "text", "conversations": text_only},
        ],
    )
    loaded = read_data(user_data(path=path), tmp_path / "cache")
    dataset = ConversationDataset(loaded.train)
    assert len(dataset) == 2
    sample = dataset[0]
    assert (sample["id"], sample["source"], sample["where"]) == ("two", 0, f"{path} record 0")
    assert [(image.mode, image.size) for image in sample["images"]] == [("RGB", (20, 10)), ("RGB", (32, 32))]
    assert sample["messages"] == loaded.train[0]["messages"]
    assert dataset[1]["images"] == [] and ConversationDataset([{**loaded.train[1], "source": 3}])[0]["source"] == 3


def test_training_needs_one_global_micro_batch():
    require_one_global_batch(8, 4, 2)
    with pytest.raises(
        LauncherError, match=r"^data: 7 usable training records, fewer than one global micro-batch \(4 x 2 ranks\)$"
    ):
        require_one_global_batch(7, 4, 2)
