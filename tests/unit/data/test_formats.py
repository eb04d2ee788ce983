"""launcher.data.formats: the three record formats, JSON and `datasets` files, images, and every kind of bad
record (one line naming file, record and reason; skipped and logged under data.on_bad_record=skip)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from launcher.config.schema import DataFormat
from launcher.core.errors import LauncherError
from launcher.data.formats import FORMATS, ReadOptions, looks_like_hub_id, read_records, record_texts
from launcher.data.records import ConversationDataset, load_records
from tests.unit.data.samples import MULTI_TURN, write_image


def png_bytes(colour: str = "red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def llava(image="a.png", answer="blue square", **extra) -> dict:
    """A one-image record; image=None: a text-only one."""
    question = "what is it?" if image is None else "<image>\nwhat is it?"
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return {"conversations": turns, **extra} if image is None else {"image": image, "conversations": turns, **extra}


ASSISTANT = {"role": "assistant", "content": [{"type": "text", "text": "yes"}]}


def read(path: Path, **options) -> tuple[list[dict], int, str]:
    return read_records(path, ReadOptions(**options))


def write_json(path: Path, records: list, *, lines: bool = False) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n" if lines else json.dumps(records, indent=1))
    return path


# ----------------------------------------------------------------------------- the formats
def test_llava_list_and_lines_multi_turn(tmp_path):
    write_image(tmp_path / "img" / "a.png")
    for path in (
        write_json(tmp_path / "list.json", [llava(id="one"), MULTI_TURN]),
        write_json(tmp_path / "lines.jsonl", [llava(id="one"), MULTI_TURN], lines=True),
    ):
        records, skipped, fmt = read(path, image_root=tmp_path / "img")
        assert (skipped, fmt, [r["id"] for r in records]) == (0, "llava", ["one", "multi"])
        assert records[1]["images"] == [str(tmp_path / "img" / "a.png")]
        assert [m["role"] for m in records[1]["messages"]] == ["user", "assistant", "user", "assistant"]
        assert records[1]["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "what colour?"}]
        assert records[1]["messages"][2]["content"] == [{"type": "text", "text": "and the shape?"}]


def test_llava_image_placement_and_several_images(tmp_path):
    for name in ("a.png", "b.png", "c.png"):
        write_image(tmp_path / name)
    turns = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    no_marker = {"images": ["a.png", "b.png"], "conversations": turns}
    between = {
        "image": ["a.png", "b.png", "c.png"],
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "first <image> then <image>"},
            {"from": "gpt", "value": "ok"},
            {"from": "human", "value": "<image>\nand this?"},
            {"from": "gpt", "value": "fine"},
        ],
    }
    records, _, _ = read(write_json(tmp_path / "d.json", [no_marker, between]))
    # No marker: every image before the first user text, as LLaVA does.
    assert records[0]["messages"][0]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "hi"},
    ]
    system, first, _, second, _ = records[1]["messages"]
    assert system == {"role": "system", "content": [{"type": "text", "text": "be brief"}]}
    assert first["content"] == [
        {"type": "text", "text": "first"},
        {"type": "image"},
        {"type": "text", "text": "then"},
        {"type": "image"},
    ]
    assert second["content"][0] == {"type": "image"} and len(records[1]["images"]) == 3
    assert record_texts(records[1])[1] == "first\n<image>\nthen\n<image>"


def test_sharegpt_messages_with_images_and_a_system_prompt(tmp_path):
    """LLaMA-Factory's sharegpt layout with OpenAI role names: string contents, an `images` list."""
    write_image(tmp_path / "x.png")
    write_image(tmp_path / "y.png")
    rows = [
        {
            "system": "You look at pictures.",
            "messages": [
                {"role": "user", "content": "<image><image>Which is larger?"},
                {"role": "assistant", "content": "The first."},
            ],
            "images": ["x.png", "y.png"],
        },
        {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
    ]
    records, _, fmt = read(write_json(tmp_path / "sg.jsonl", rows, lines=True))
    assert fmt == "sharegpt"
    assert [m["role"] for m in records[0]["messages"]] == ["system", "user", "assistant"]
    assert records[0]["messages"][1]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "Which is larger?"},
    ]
    assert records[1]["images"] == [] and records[1]["messages"][0]["content"] == [{"type": "text", "text": "Say hi."}]


def test_openai_style_content_parts(tmp_path):
    """Typed parts: images inline (path, image_url, data URL) or taken in order from `images`."""
    write_image(tmp_path / "p.png")
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    rows = [
        {
            "id": "inline",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": "p.png"},
                        {"type": "text", "text": "and"},
                        {"type": "image_url", "image_url": {"url": data_url}},
                        {"type": "text", "text": "colours?"},
                    ],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "blue red"}]},
            ],
        },
        {
            "id": "listed",
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": "blue"},
            ],
            "images": ["p.png"],
        },
    ]
    records, _, fmt = read(write_json(tmp_path / "oa.json", rows))
    assert fmt == "messages"
    inline, listed = records
    assert inline["images"][0] == str(tmp_path / "p.png") and inline["images"][1] == png_bytes()
    assert [p["type"] for p in inline["messages"][1]["content"]] == ["image", "text", "image", "text"]
    assert listed["images"] == [str(tmp_path / "p.png")]
    assert listed["messages"][1]["content"] == [{"type": "text", "text": "blue"}]
    sample = ConversationDataset(records)[0]
    assert [image.size for image in sample["images"]] == [(32, 32), (16, 16)]


def test_one_messages_file_may_mix_string_and_typed_contents(tmp_path):
    """OpenAI-style files often give text-only turns as strings: such a first record must not make the
    file "sharegpt" and its later typed records bad."""
    write_image(tmp_path / "a.png")
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "colour?"}]},
                {"role": "assistant", "content": "blue"},
            ]
        },
        {
            "messages": [{"role": "user", "content": "<image>and this?"}, {"role": "assistant", "content": "blue"}],
            "images": ["a.png"],
        },
    ]
    records, skipped, fmt = read(write_json(tmp_path / "mixed.jsonl", rows, lines=True))
    assert (fmt, skipped) == ("sharegpt", 0)
    assert [len(r["images"]) for r in records] == [0, 1, 1]
    assert records[2]["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "and this?"}]


def test_llama_factory_v1_files_name_parts_by_value(tmp_path):
    """LLaMA-Factory's v1 data files (data/v1_multimodal_demo.jsonl): every part is {"type", "value"}, an
    image part "image_url" with a path relative to the image root, an image repeated in a later turn."""
    write_image(tmp_path / "mllm" / "1.jpg")

    def text(value: str) -> dict:
        return {"type": "text", "value": value}

    picture = {"type": "image_url", "value": "mllm/1.jpg"}
    row = {
        "messages": [
            {"role": "user", "content": [picture, text("Who are they?")]},
            {"role": "assistant", "content": [text("Two players.")]},
            {"role": "user", "content": [text("What are they doing?"), picture]},
            {"role": "assistant", "content": [text("Celebrating.")]},
        ]
    }
    audio = {"messages": [{"role": "user", "content": [{"type": "audio_url", "value": "a.wav"}]}, ASSISTANT]}
    path = write_json(tmp_path / "v1.jsonl", [row, audio], lines=True)
    records, skipped, fmt = read(path, on_bad_record="skip")
    assert (fmt, skipped, len(records)) == ("messages", 1, 1)
    (record,) = records
    assert record["images"] == [str(tmp_path / "mllm" / "1.jpg")] * 2
    assert record["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "Who are they?"}]
    assert record["messages"][2]["content"] == [{"type": "text", "text": "What are they doing?"}, {"type": "image"}]
    assert record["messages"][3] == {"role": "assistant", "content": [{"type": "text", "text": "Celebrating."}]}
    with pytest.raises(LauncherError, match=r"record 1\): a audio_url part: only text, image and video parts train"):
        read(path)


def test_typed_records_with_bad_content_are_bad_records(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "<image> what?"}]}, ASSISTANT]},
        {"messages": [{"role": "user", "content": 5}, ASSISTANT]},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}, ASSISTANT]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "fine"}]}, ASSISTANT]},
    ]
    path = write_json(tmp_path / "typed.jsonl", rows, lines=True)
    with pytest.raises(
        LauncherError, match=r"record 0\): '<image>' in a text part; .* give each image as an image part"
    ):
        read(path)
    records, skipped, fmt = read(path, on_bad_record="skip")
    assert (len(records), skipped, fmt) == (1, 3, "messages")
    with pytest.raises(LauncherError, match=r"record 1\): a message's 'content' must be a string or a list of parts"):
        read(write_json(tmp_path / "five.jsonl", rows[3:] + rows[1:2], lines=True))


def test_only_plausible_hub_ids_go_to_the_network(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert looks_like_hub_id("liuhaotian/LLaVA-Instruct-150K")
    assert looks_like_hub_id("lmms-lab/LLaVA-OneVision-1.5-Data")  # dots are fine in hub names
    for local in ("data/vqa_saved", "org/train.json", "org/train.parquet", "./org/name", "a/b/c", "name"):
        assert not looks_like_hub_id(local), local  # "data" is a local folder: a typo, not a hub id
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not looks_like_hub_id("liuhaotian/LLaVA-Instruct-150K")
    with pytest.raises(LauncherError, match="cannot read the data file"):
        read("liuhaotian/LLaVA-Instruct-150K")


def test_format_is_detected_per_file_and_can_be_named(tmp_path):
    write_image(tmp_path / "a.png")
    path = write_json(tmp_path / "d.json", [llava()])
    assert read(path)[2] == "llava"
    with pytest.raises(LauncherError, match=r"'messages' must be a non-empty list \(sharegpt format\)"):
        read(path, format="sharegpt")
    with pytest.raises(LauncherError, match=r"data\.format=jpeg: choose auto, llava, sharegpt, messages"):
        read(path, format="jpeg")
    unknown = write_json(tmp_path / "u.json", [{"question": "q", "answer": "a"}])
    with pytest.raises(LauncherError, match=r"not a record of a known format \(found 'question', 'answer'\)"):
        read(unknown)


def test_text_only_records_mix_with_image_records(tmp_path):
    write_image(tmp_path / "a.png")
    records, _, _ = read(write_json(tmp_path / "d.json", [llava(), llava(image=None, answer="just text")]))
    assert [len(r["images"]) for r in records] == [1, 0]
    assert ConversationDataset(records)[1]["images"] == []


# ----------------------------------------------------------------------------- `datasets` files
@pytest.fixture(scope="module")
def hf_rows(tmp_path_factory):
    """Rows in the sharegpt layout, images embedded as bytes (the `datasets` Image feature) or as paths."""
    import datasets

    root = tmp_path_factory.mktemp("hf")
    write_image(root / "img" / "a.png")
    embedded = datasets.Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": "<image>colour?"}, {"role": "assistant", "content": "red"}],
                [{"role": "user", "content": "no picture"}, {"role": "assistant", "content": "fine"}],
            ],
            "images": [[{"bytes": png_bytes("red"), "path": None}], []],
        },
        features=datasets.Features(
            {
                "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
                "images": datasets.List(datasets.Image()),
            }
        ),
    )
    by_path = datasets.Dataset.from_list(
        [{"image": "a.png", "conversations": [{"from": "human", "value": "<image>hi"}, {"from": "gpt", "value": "yo"}]}]
    )
    return root, embedded, by_path


def test_parquet_arrow_and_save_to_disk(tmp_path, hf_rows):
    import datasets

    root, embedded, by_path = hf_rows
    embedded.to_parquet(tmp_path / "train.parquet")
    embedded.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"validation": embedded}).save_to_disk(tmp_path / "splits")
    options = {"cache_dir": tmp_path / "hf_cache"}
    for source in (tmp_path / "train.parquet", tmp_path / "saved", next((tmp_path / "saved").glob("*.arrow"))):
        records, skipped, fmt = read(source, **options)
        assert (len(records), skipped, fmt) == (2, 0, "sharegpt"), source
        assert records[0]["images"] == [png_bytes("red")] and records[1]["images"] == []
        assert ConversationDataset(records)[0]["images"][0].getpixel((0, 0)) == (255, 0, 0)
    assert len(read(tmp_path / "splits", split="validation", **options)[0]) == 2
    with pytest.raises(LauncherError, match=r"no split 'train' \(data.split\); it has validation"):
        read(tmp_path / "splits", **options)

    by_path.to_parquet(tmp_path / "paths.parquet")
    records, _, fmt = read(tmp_path / "paths.parquet", image_root=root / "img", **options)
    assert fmt == "llava" and records[0]["images"] == [str(root / "img" / "a.png")]


# ----------------------------------------------------------------------------- bad records
def bad_record_cases(tmp_path: Path) -> dict[str, tuple[dict, str]]:
    (tmp_path / "img" / "empty.png").write_bytes(b"")
    (tmp_path / "img" / "text.png").write_bytes(b"not a png at all")
    write_image(tmp_path / "img" / "big.png", size=(300, 300))
    write_image(tmp_path / "outside.png")
    (tmp_path / "img" / "folder.png").mkdir()
    one_image = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]
    return {
        "no conversations": ({"image": "a.png"}, "'conversations' must be a non-empty list of turns"),
        "image file missing": (llava(image="nope.png"), "nope.png does not exist"),
        "image is a folder": (llava(image="folder.png"), "is a directory"),
        "zero-byte image": (llava(image="empty.png"), "empty.png is empty (0 bytes)"),
        "undecodable image": (llava(image="text.png"), "text.png cannot be decoded as an image"),
        "decompression bomb": (llava(image="big.png"), "300x300 = 90000 pixels, over data.max_image_pixels=10000"),
        "leaves the root": (llava(image="../outside.png"), "leaves the image root"),
        "absolute path elsewhere": (llava(image=str(tmp_path / "outside.png")), "leaves the image root"),
        "a URL": (llava(image="https://example.com/a.png"), "is a URL; images are not downloaded"),
        "no assistant turn": ({"image": "a.png", "conversations": one_image[:1]}, "no assistant turn"),
        "image in an answer": (
            {
                "image": "a.png",
                "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<image>"}],
            },
            "images may only be in user turns",
        ),
        "more markers than images": (
            {"image": "a.png", "conversations": [{"from": "human", "value": "<image><image>"}, one_image[1]]},
            "2 '<image>' marker(s) but 1 image(s)",
        ),
        "unknown speaker": ({"image": "a.png", "conversations": [{"from": "bot", "value": "x"}]}, "unknown from 'bot'"),
        "not an object": (["a", "b"], "a record must be a JSON object"),
        "a role that is not a string": (
            {"image": "a.png", "conversations": [{"from": ["human"], "value": "<image>"}, one_image[1]]},
            "unknown from ['human']",
        ),
        "a NUL byte in the image path": (llava(image="a\x00b.png"), "cannot be read (embedded null byte)"),
        "a data URL that is not base64": (llava(image="data:image/png;base64,ü"), "data URL is not valid base64"),
    }


@pytest.mark.parametrize("layout", ["list", "lines"])
def test_bad_records_name_file_record_and_reason_and_skip_counts_them(tmp_path, layout):
    write_image(tmp_path / "img" / "a.png")
    cases = bad_record_cases(tmp_path)
    for case, (bad, reason) in cases.items():
        records = [llava(), bad, llava()]
        path = tmp_path / ("data.json" if layout == "list" else "data.jsonl")
        write_json(path, records, lines=layout == "lines")
        where = f"{path} record 1" if layout == "list" else f"{path}:2 (record 1)"
        options = {"image_root": tmp_path / "img", "max_image_pixels": 10_000}
        with pytest.raises(LauncherError) as info:
            read(path, **options)
        message = str(info.value)
        assert message.startswith(where) and reason in message and "\n" not in message, (case, message)
        log: list[dict] = []
        kept, skipped, _ = read_records(path, ReadOptions(on_bad_record="skip", **options), log)
        assert (len(kept), skipped) == (2, 1), case
        # Listed for RUN/skipped_records.jsonl with the very line data.on_bad_record=error stops with.
        assert log == [{"file": str(path), "record": 1, "reason": message}], case
        assert [(record["file"], record["index"]) for record in kept] == [(str(path), 0), (str(path), 2)]


def test_a_symlinked_image_folder_inside_the_root_is_fine(tmp_path):
    write_image(tmp_path / "elsewhere" / "a.png")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "images").symlink_to(tmp_path / "elsewhere")
    path = write_json(tmp_path / "root" / "d.json", [llava(image="images/a.png")])
    assert read(path)[0][0]["images"] == [str(tmp_path / "root" / "images" / "a.png")]


def test_image_headers_are_opened_unless_told_not_to(tmp_path):
    """The built-in set's images are written by the project itself: its reads skip the header check
    (0.4 s of 4200 images per read); a user's file is always checked; decode=True always decodes."""
    (tmp_path / "text.png").write_text("not an image")
    path = write_json(tmp_path / "d.json", [llava(image="text.png")])
    with pytest.raises(LauncherError, match=r"text\.png cannot be decoded as an image"):
        read(path)
    assert read(path, check_headers=False)[0][0]["images"] == [str(tmp_path / "text.png")]
    with pytest.raises(LauncherError, match=r"text\.png cannot be decoded as an image"):
        read(path, check_headers=False, decode=True)
    # Which sources skip the check (the built-in set's): tests/unit/data/test_records.py.


def test_a_truncated_image_is_found_by_decoding(tmp_path):
    """The header reads fine; only decoding the pixels fails: `decode=True` finds it while reading."""
    write_image(tmp_path / "whole.png", size=(64, 64))
    data = (tmp_path / "whole.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    path = write_json(tmp_path / "d.json", [llava(image="whole.png"), llava(image="cut.png")])
    records, skipped, _ = read(path)  # the header is intact
    assert (len(records), skipped) == (2, 0)
    with pytest.raises(LauncherError, match=rf"^{path} record 1: cannot decode image .*cut.png"):
        ConversationDataset(records)[1]
    with pytest.raises(LauncherError, match=rf"^{path} record 1: image file .*cut.png cannot be decoded"):
        read(path, decode=True)
    kept, skipped, _ = read(path, decode=True, on_bad_record="skip")
    assert ([r["images"][0] for r in kept], skipped) == ([str(tmp_path / "whole.png")], 1)


def test_malformed_json_names_the_line(tmp_path):
    write_image(tmp_path / "a.png")
    as_list = tmp_path / "list.json"
    as_list.write_text('[\n  {"image": "a.png",\n   "conversations": [}\n]')
    with pytest.raises(LauncherError, match=rf"^{as_list}:3: malformed JSON"):
        load_records(as_list, tmp_path)
    as_lines = tmp_path / "lines.jsonl"
    as_lines.write_text(json.dumps(llava()) + "\n{not json\n" + json.dumps(llava()) + "\n")
    with pytest.raises(LauncherError, match=rf"^{as_lines}:2: malformed JSON in record 1") as info:
        load_records(as_lines, tmp_path)
    assert load_records(as_lines, tmp_path, on_bad_record="skip")[1] == 1
    log: list[dict] = []
    read_records(as_lines, ReadOptions(on_bad_record="skip", image_root=tmp_path), log)
    assert log == [{"file": str(as_lines), "record": 1, "reason": str(info.value)}]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [llava()]}))
    with pytest.raises(LauncherError, match=r"one JSON object \(keys 'data'\), not records"):
        load_records(wrapped, tmp_path)


def test_empty_data_sets_are_errors(tmp_path):
    empty = write_json(tmp_path / "empty.json", [])
    with pytest.raises(LauncherError, match="empty data set"):
        load_records(empty, tmp_path)
    all_bad = write_json(tmp_path / "bad.jsonl", [llava(image="gone.png")], lines=True)
    with pytest.raises(LauncherError, match=r"empty data set \(all 1 records are bad"):
        load_records(all_bad, tmp_path, on_bad_record="skip")
    with pytest.raises(LauncherError, match="cannot read the data file"):
        load_records(tmp_path / "absent.json", tmp_path)


def test_an_answer_keeps_its_text_as_written_and_an_empty_one_is_a_bad_record(tmp_path):
    """Code answers keep their indentation and line ends (a prompt's text loses the spaces around it and
    its image markers); an answer of nothing or of spaces alone is refused, in every format."""
    code = "    def f():\n        return 1\n"
    path = write_json(tmp_path / "code.json", [llava(image=None, answer=code)])
    (record,), _, _ = read(path)
    assert record["messages"][1]["content"] == [{"type": "text", "text": code}]
    assert record["messages"][0]["content"] == [{"type": "text", "text": "what is it?"}]
    typed = {"messages": [{"role": "user", "content": "write f"}, {"role": "assistant", "content": code}]}
    (record,), _, _ = read(write_json(tmp_path / "messages.json", [typed]))
    assert record["messages"][1]["content"] == [{"type": "text", "text": code}]
    empty_typed = {"messages": [typed["messages"][0], {"role": "assistant", "content": ""}]}
    for number, (bad, good) in enumerate(
        [(llava(image=None, answer="   \n"), llava(image=None)), (empty_typed, typed)]
    ):
        path = write_json(tmp_path / f"empty{number}.json", [bad, good])
        with pytest.raises(LauncherError, match=r"record 0: turn 2 is an empty answer \(no text, or only spaces\)"):
            read(path)
        records, skipped, _ = read(path, on_bad_record="skip")
        assert (len(records), skipped) == (1, 1)


# ----------------------------------------------------------------------------- preference pairs
def _pair_texts(records: list[dict]) -> list[tuple[str, str]]:
    """(id, the last answer's text) of each record read."""
    return [(r["id"], r["messages"][-1]["content"][0]["text"]) for r in records]


def test_llama_factory_and_trl_preference_records_read_as_adjacent_chosen_and_rejected(tmp_path):
    for name in ("a.png", "b.png"):
        write_image(tmp_path / name)
    records = [
        {  # LLaMA-Factory, sharegpt style, two images
            "id": "lf",
            "conversations": [{"from": "human", "value": "<image><image>which is red?"}],
            "chosen": {"from": "gpt", "value": "the first"},
            "rejected": {"from": "gpt", "value": "the second"},
            "images": ["a.png", "b.png"],
        },
        {  # LLaMA-Factory, OpenAI style, text only
            "id": "lf-text",
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
            "chosen": {"role": "assistant", "content": "4"},
            "rejected": {"role": "assistant", "content": "5"},
        },
        {"id": "trl", "prompt": "<image>what colour?", "chosen": "red", "rejected": "blue", "images": ["a.png"]},
        {  # LLaMA-Factory v1 (v1_dpo_demo.jsonl): each side a whole conversation, parts named by "value"
            "id": "lf-v1",
            "chosen_messages": [
                {"role": "user", "content": [{"type": "text", "value": "2+3?"}], "loss_weight": 0.0},
                {"role": "assistant", "content": [{"type": "text", "value": "5"}], "loss_weight": 1.0},
            ],
            "rejected_messages": [
                {"role": "user", "content": [{"type": "text", "value": "2+3?"}], "loss_weight": 0.0},
                {"role": "assistant", "content": [{"type": "text", "value": "6"}], "loss_weight": 1.0},
            ],
        },
        {  # TRL, conversational, the image as a part
            "id": "trl-chat",
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "shape?"}]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "circle"}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "square"}]}],
            "images": ["b.png"],
        },
    ]
    read_back, skipped, fmt = read(write_json(tmp_path / "prefs.jsonl", records, lines=True), pairs=True)
    assert skipped == 0 and fmt == "llava"
    assert _pair_texts(read_back) == [
        ("lf", "the first"), ("lf#rejected", "the second"), ("lf-text", "4"), ("lf-text#rejected", "5"),
        ("trl", "red"), ("trl#rejected", "blue"), ("lf-v1", "5"), ("lf-v1#rejected", "6"),
        ("trl-chat", "circle"), ("trl-chat#rejected", "square"),
    ]  # fmt: skip
    chosen, rejected = read_back[0], read_back[1]
    assert chosen["images"] == rejected["images"] == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    assert chosen["messages"][0] == rejected["messages"][0]  # the same prompt
    assert [r["index"] for r in read_back] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert read_back[2]["images"] == [] and read_back[2]["messages"][0]["role"] == "system"
    assert read_back[6]["messages"][0] == read_back[7]["messages"][0] and read_back[6]["images"] == []
    assert read_back[8]["messages"][0]["content"][0] == {"type": "image"}


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"prompt": "q?", "chosen": "a"}, "has no 'rejected': give both, or train it with loss=sft"),
        ({"prompt": "q?", "chosen": "a", "rejected": ""}, "has no 'rejected'"),
        ({"prompt": "q?", "chosen": "same", "rejected": "same"}, "chosen and rejected answers are the same"),
        ({"chosen": "a", "rejected": "b"}, "needs its prompt: 'conversations' or 'messages'"),
        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' must be a string or a list of messages"),
    ],
)
def test_a_bad_preference_record_is_one_line_naming_it(tmp_path, record, reason):
    path = write_json(tmp_path / "prefs.json", [record])
    with pytest.raises(LauncherError, match="prefs.json record 0: .*" + reason.replace("?", r"\?").replace("+", r"\+")):
        read(path, pairs=True)
    records, skipped, _ = read(write_json(tmp_path / "two.json", [record, record | {"rejected": "b", "chosen": "a",
                               "prompt": "q?"}]), pairs=True, on_bad_record="skip")  # fmt: skip
    assert skipped == 1 and len(records) == 2


def test_a_llama_factory_v1_pair_without_its_rejected_side_names_the_v1_keys(tmp_path):
    lone = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a"}]
    records = [{"chosen_messages": lone, "rejected_messages": [*lone[:1], {"role": "assistant", "content": "b"}]}]
    path = write_json(tmp_path / "v1.jsonl", [*records, {"chosen_messages": lone}], lines=True)
    with pytest.raises(LauncherError, match=r"\(record 1\): .* needs a 'chosen_messages' and a 'rejected_messages'"):
        read(path, pairs=True)
    with pytest.raises(LauncherError, match=r"\(record 0\): a preference record .* \(loss=dpo or loss=ipo\)"):
        read(path)  # under the supervised loss: the loss to use


def test_a_preference_record_under_a_supervised_loss_names_the_loss_to_use(tmp_path):
    path = write_json(tmp_path / "prefs.json", [{"prompt": "q?", "chosen": "a", "rejected": "b"}])
    with pytest.raises(LauncherError, match=r"record 0: a preference record .* \(loss=dpo or loss=ipo\)"):
        read(path)


def test_the_formats_data_format_names_are_the_ones_the_reader_has():
    """One registry of formats (launcher.data.formats.FORMATS): the config's closed choice names exactly them,
    and no two formats recognise one record."""
    assert [choice.value for choice in DataFormat] == ["auto", *FORMATS]
    records = [
        {"conversations": []},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ]
    for record, name in zip(records, FORMATS, strict=True):
        assert [fmt.name for fmt in FORMATS.values() if fmt.recognises(record)] == [name]
