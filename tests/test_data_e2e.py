"""Data as people have it, end to end through `python train.py`: each format, `datasets` files,
multi-image and text-only records on both model families, mixtures that resume bitwise, and ZeRO-3
with ranks whose batches differ in modality (the guard, and the watchdog when the guard is off)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.test_resume_e2e import kill_group, last_step, latest, start, wait_for
from tests.test_train_e2e import losses, metrics, summary

pytestmark = pytest.mark.slow

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220)}
QUICK = ["logger=none", "train.eval_every=0", "data.eval_accuracy=false", "train.micro_batch_size=4"]


def write_images(root: Path) -> list[str]:
    """Images of three colours in three sizes (the processors resize them)."""
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for colour, rgb in COLOURS.items():
        for size in (24, 40, 56):
            name = f"{colour}_{size}.png"
            Image.new("RGB", (size, size + 8), rgb).save(root / name)
            names.append(name)
    return names


def conversation(index: int, images: list[str]) -> tuple[str, str]:
    """A question about `images` and its answer (the colours, in order); text-only records chat."""
    if not images:
        return f"say the number {index % 7}", f"number {index % 7}"
    return "which colours?", " ".join(name.split("_")[0] for name in images)


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


@pytest.mark.parametrize(
    ("fmt", "arch", "extra"),
    [
        ("llava", "tiny_llava", []),
        ("sharegpt", "tiny_qwen2_vl", ["data.group_by_length=true"]),
        ("messages", "tiny_llava", ["data.cache=false", "data.on_bad_record=skip"]),
        ("parquet", "tiny_qwen2_vl", []),
    ],
)
def test_each_format_trains_with_multi_image_and_text_only_records(run_train, tmp_path, fmt, arch, extra):
    """Records of 0, 1, 2 and 3 images, each format read from its own file; both model families; the
    data cache (or not), length-grouped batches."""
    path = write_data(tmp_path, fmt)
    run_dir = tmp_path / "run"
    result = run_train(
        *QUICK,
        f"model={arch}",
        "data=llava_json",
        f"data.path={path}",
        f"data.image_root={tmp_path / 'img'}",
        "train.max_steps=10",
        *extra,
        f"hydra.run.dir={run_dir}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = summary(run_dir)
    assert (done["status"], done["steps"], done["records_skipped"]) == ("completed", 10, 0)
    if "data.cache=false" in extra:
        assert "data_cache" not in done
    else:
        assert done["data_cache"]["built"] is True
    expected = "sharegpt" if fmt == "parquet" else fmt
    assert re.search(rf"format {path.stem}={expected}\b", (run_dir / "train.log").read_text())
    curve = losses(run_dir)
    assert len(curve) == 10 and all(loss == loss for loss in curve)  # finite (not NaN)


def test_a_weighted_mixture_draws_by_weight_and_resumes_bitwise(run_train, isolated_env, tmp_path):
    """Two sources 3:1 (a llava file and a parquet set): per-source counts follow the weights, and a run
    killed after its checkpoint resumes with the same losses and the same position in each source."""
    names = write_images(tmp_path / "img")
    first = tmp_path / "first.json"
    first.write_text(json.dumps(llava_records(names, 40)))
    second = parquet_records(tmp_path, names, 12)
    sources = f"data.sources=[{{path: {first}, weight: 3, name: main}}, {{path: {second}, weight: 1, name: extra}}]"
    args = [*QUICK, "data=llava_json", f"data.image_root={tmp_path / 'img'}", sources, "train.max_steps=8"]
    reference = tmp_path / "reference"
    result = run_train(*args, f"hydra.run.dir={reference}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    from launcher.data.sampling import MixtureSampler

    counts = summary(reference)["samples_per_source"]
    # 8 steps x 4 samples: in the first block of 1000 draws (exactly 3:1 per block), as the sampler deals them.
    dealt = MixtureSampler([40, 12], [3, 1], num_replicas=1, rank=0, seed=0).source_counts(32)
    assert counts == {"main": dealt[0], "extra": dealt[1]} and sum(dealt) == 32
    assert metrics(reference)[-1]["data/samples_main"] == dealt[0]

    run_dir = tmp_path / "run"
    # Step 6 hangs (the test's fault hook), so the kill cannot come too late: these steps take
    # milliseconds, and the run could otherwise finish between two looks at its metrics.
    hang = {**isolated_env, "LAUNCHER_TEST_FAULT": "0:6:hang"}
    process = start(run_dir, [*args, "train.save_every=4"], hang)
    wait_for(process, lambda: last_step(run_dir) >= 5 and latest(run_dir) == "step4")
    kill_group(process)
    assert last_step(run_dir) == 5
    result = run_train(f"resume={run_dir}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 4
    assert losses(run_dir) == losses(reference)  # bitwise
    assert summary(run_dir)["samples_per_source"] == counts
    import torch

    saved = torch.load(run_dir / "checkpoints" / "step4" / "launcher_rank0.pt", weights_only=False)
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
def test_max_length_cuts_and_skips_and_every_skipped_record_is_listed(run_train, tmp_path, cache):
    """data.max_length=128 trains with a long answer cut and a 100,000-character question skipped;
    data.on_bad_record=skip skips the bad records; each skipped record has a line in
    RUN/skipped_records.jsonl (file, record, the one-line reason) that the log names, the same with the
    data cache and without it; a resume rewrites the file rather than adding to it."""
    path = long_and_bad_records(tmp_path)
    run_dir = tmp_path / "run"
    args = [
        *QUICK,
        "data=llava_json",
        f"data.path={path}",
        f"data.image_root={tmp_path / 'img'}",
        "data.max_length=128",
        "data.on_bad_record=skip",
        f"data.cache={cache}",
        "train.max_steps=4",
    ]
    result = run_train(*args, f"hydra.run.dir={run_dir}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    done = summary(run_dir)
    counts = ("records_skipped", "records_too_long", "records_truncated")
    assert (done["status"], *(done[key] for key in counts)) == ("completed", 2, 1, 1)
    assert all(loss == loss for loss in losses(run_dir))  # finite
    lines = [json.loads(line) for line in (run_dir / "skipped_records.jsonl").read_text().splitlines()]
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
    log = (run_dir / "train.log").read_text()
    assert (
        "data: 2 bad record(s) skipped, 1 record(s) over data.max_length=128 skipped, 1 record(s) truncated to "
        f"data.max_length=128: see {run_dir / 'skipped_records.jsonl'}"
    ) in log
    if cache == "true":
        result = run_train(f"resume={run_dir}", "train.max_steps=6", timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        again = [json.loads(line) for line in (run_dir / "skipped_records.jsonl").read_text().splitlines()]
        assert again == lines and summary(run_dir)["steps"] == 6


# ----------------------------------------------------------------------------- ZeRO-3, mixed modalities
MICRO, STEPS, SEED = 2, 6, 3


def modality_split_records(root: Path) -> Path:
    """Records placed so that, in the order the sampler deals them, rank 0's batches of steps 1-3 are
    text-only while rank 1's have images, and the reverse for steps 4-6."""
    from launcher.train.checkpoint import ResumableSampler

    names = write_images(root / "img")
    n = 2 * MICRO * STEPS
    dealt = {
        rank: list(ResumableSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=SEED)) for rank in (0, 1)
    }
    records: list[dict | None] = [None] * n
    for rank, order in dealt.items():
        for position, index in enumerate(order):
            step = position // MICRO  # 0-based
            text_only = (rank == 0) == (step < STEPS // 2)
            images = [] if text_only else [names[index % len(names)]] * (1 + index % 2)
            question, answer = conversation(index, images)
            turns = [{"from": "human", "value": "<image>" * len(images) + question}, {"from": "gpt", "value": answer}]
            records[index] = {"id": str(index), "images": images, "conversations": turns}
    path = root / "split.json"
    path.write_text(json.dumps(records))
    return path


def zero_args(root: Path, path: Path) -> list[str]:
    return [
        *QUICK,
        f"train.micro_batch_size={MICRO}",
        f"train.max_steps={STEPS}",
        f"train.seed={SEED}",
        "data=llava_json",
        f"data.path={path}",
        f"data.image_root={root / 'img'}",
        "dist.nproc_per_node=2",
        "precision=fp32",
        "train.save_every=0",
    ]


def test_zero3_with_ranks_of_different_modalities_matches_zero0(run_train, tmp_path):
    path = modality_split_records(tmp_path)
    curves = {}
    for stage in ("z0", "z3"):
        run_dir = tmp_path / stage
        result = run_train(*zero_args(tmp_path, path), f"deepspeed={stage}", f"hydra.run.dir={run_dir}", timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        assert summary(run_dir)["status"] == "completed"
        curves[stage] = losses(run_dir)
    assert len(curves["z3"]) == STEPS
    for z0, z3 in zip(curves["z0"], curves["z3"], strict=True):
        assert abs(z3 - z0) <= 1e-5 * abs(z0), curves


def assert_ended_within(run_dir: Path, seconds: float) -> None:
    """From rank 0's last line before step 1 (its data cache is ready) to the end of the job's files."""
    log = (run_dir / "train.log").read_text()
    ready = re.findall(r"^\[([\d-]+ [\d:]+),(\d+)\]\[launcher\]\[INFO\] - data cache", log, re.M)[-1]
    ready_at = time.mktime(time.strptime(ready[0], "%Y-%m-%d %H:%M:%S")) + int(ready[1]) / 1000
    ended_at = max(path.stat().st_mtime for path in (run_dir / "errors").iterdir())
    assert ended_at - ready_at < seconds, ended_at - ready_at


def test_without_the_guard_the_mixed_batches_fail_at_once_naming_the_step(run_train, tmp_path):
    """Rank 0's batch of step 1 is text-only, rank 1's has images: their ZeRO-3 gathers differ. gloo
    checks the sizes of what it receives, so here the job fails at once (NCCL would wait forever: the
    watchdog's case, below); either way one line names the step and the cause."""
    path = modality_split_records(tmp_path)
    run_dir = tmp_path / "mixed"
    args = [*zero_args(tmp_path, path), "deepspeed=z3", "data.modality_guard=false", "dist.step_timeout_s=20"]
    result = run_train(*args, f"hydra.run.dir={run_dir}", timeout=900)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert "step 1: " in errors[0] and "keep data.modality_guard on" in errors[0], errors[0]
    assert summary(run_dir)["status"] == "failed"
    assert_ended_within(run_dir, 20 + 30)


def test_a_hung_step_is_ended_by_the_watchdog_with_one_line(run_train, tmp_path):
    """Rank 1 stops answering in step 2 (the test hook), rank 0 waits in the step's all-reduce: each
    rank's watchdog dumps its stacks and the job ends with one line naming the step."""
    path = modality_split_records(tmp_path)
    run_dir = tmp_path / "hang"
    timeout = 15
    args = [*zero_args(tmp_path, path), "deepspeed=z3", f"dist.step_timeout_s={timeout}", "dist.timeout_s=600"]
    result = run_train(*args, f"hydra.run.dir={run_dir}", env={"LAUNCHER_TEST_FAULT": "1:2:hang"}, timeout=900)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.search(rf"rank \d: step 2 did not finish within dist.step_timeout_s={timeout} s", errors[0]), errors[0]
    stacks = {p.name: p.read_text() for p in (run_dir / "errors").glob("rank*_stacks.txt")}
    assert stacks and all("train_step" in text for text in stacks.values()), stacks
    assert summary(run_dir)["status"] == "failed" and [m["step"] for m in metrics(run_dir)] == [1]
    assert_ended_within(run_dir, timeout + 30)
