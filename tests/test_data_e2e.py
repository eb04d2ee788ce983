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
    ("fmt", "arch"),
    [("llava", "tiny_llava"), ("sharegpt", "tiny_qwen2_vl"), ("messages", "tiny_llava"), ("parquet", "tiny_qwen2_vl")],
)
def test_each_format_trains_with_multi_image_and_text_only_records(run_train, tmp_path, fmt, arch):
    """Records of 0, 1, 2 and 3 images, each format read from its own file; both model families."""
    path = write_data(tmp_path, fmt)
    run_dir = tmp_path / "run"
    result = run_train(
        *QUICK,
        f"model={arch}",
        "data=llava_json",
        f"data.path={path}",
        f"data.image_root={tmp_path / 'img'}",
        "train.max_steps=10",
        f"hydra.run.dir={run_dir}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    done = summary(run_dir)
    assert (done["status"], done["steps"], done["records_skipped"]) == ("completed", 10, 0)
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
    counts = summary(reference)["samples_per_source"]
    assert counts == {"main": 24, "extra": 8}  # 8 steps x 4 samples, drawn 3:1 (exact per block)
    assert metrics(reference)[-1]["data/samples_main"] == 24

    run_dir = tmp_path / "run"
    process = start(run_dir, [*args, "train.save_every=4"], isolated_env)
    wait_for(process, lambda: last_step(run_dir) >= 5 and latest(run_dir) == "step4")
    kill_group(process)
    assert last_step(run_dir) < 8
    result = run_train(f"resume={run_dir}", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 4
    assert losses(run_dir) == losses(reference)  # bitwise
    assert summary(run_dir)["samples_per_source"] == counts
    import torch

    saved = torch.load(run_dir / "checkpoints" / "step4" / "launcher_rank0.pt", weights_only=False)
    assert saved["sources"] == {"main": 12, "extra": 4}


# ----------------------------------------------------------------------------- ZeRO-3, mixed modalities
MICRO, STEPS, SEED = 2, 6, 3


def modality_split_records(root: Path) -> Path:
    """Records placed so that, in the order the sampler deals them, rank 0's batches of steps 1-3 are
    text-only while rank 1's have images, and the reverse for steps 4-6."""
    from launcher.checkpoint import ResumableSampler

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


def test_without_the_guard_the_watchdog_ends_the_hang_with_one_line(run_train, tmp_path):
    path = modality_split_records(tmp_path)
    run_dir = tmp_path / "hang"
    timeout = 20
    result = run_train(
        *zero_args(tmp_path, path),
        "deepspeed=z3",
        "data.modality_guard=false",
        f"dist.step_timeout_s={timeout}",
        "dist.timeout_s=600",
        f"hydra.run.dir={run_dir}",
        timeout=900,
    )
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.search(rf"step 1 did not finish within dist.step_timeout_s={timeout}", errors[0]), errors[0]
    stacks = list((run_dir / "errors").glob("rank*_stacks.txt"))
    assert stacks and "train_step" in stacks[0].read_text()
    # From rank 0's last line before step 1 (its data cache is ready) to the watchdog's stack dump.
    ready = re.findall(r"^\[([\d-]+ [\d:]+),(\d+)\]\[INFO\] data cache", (run_dir / "train.log").read_text(), re.M)[-1]
    ready_at = time.mktime(time.strptime(ready[0], "%Y-%m-%d %H:%M:%S")) + int(ready[1]) / 1000
    hung_for = stacks[0].stat().st_mtime - ready_at
    assert timeout - 1 < hung_for < timeout + 30, hung_for
