"""End-to-end training runs of `python train.py`, as subprocesses, on this CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

# Short runs: no W&B, no generation (unless a test wants it), 20 steps at fp32.
SHORT = [
    "logger=none",
    "train.micro_batch_size=8",
    "train.max_steps=20",
    "train.eval_every=0",
    "data.eval_accuracy=false",
    "train.seed=1",
]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def losses(run_dir: Path) -> list[float]:
    return [m["train/loss"] for m in metrics(run_dir)]


def assert_same_curves(curves: dict[str, list[float]], rel: float) -> None:
    reference_name, reference = next(iter(curves.items()))
    for name, curve in curves.items():
        assert len(curve) == len(reference), name
        for step, (a, b) in enumerate(zip(reference, curve, strict=True), start=1):
            assert abs(a - b) <= rel * abs(a), f"{name} vs {reference_name} at step {step}: {b} vs {a}"


def test_default_job_learns_and_its_saved_model_reloads(run_train, tmp_path):
    """`python train.py` as in the README: held-out exact match >= 0.9, in under 3 minutes."""
    run_dir = tmp_path / "run"
    result = run_train(f"hydra.run.dir={run_dir}", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    result_summary = summary(run_dir)
    assert result_summary["status"] == "completed"
    assert result_summary["eval_accuracy"] >= 0.9, result_summary
    for key in ("final_loss", "eval_loss", "samples_per_sec", "tokens_per_sec", "peak_memory_bytes", "wall_s"):
        assert result_summary[key] > 0, key
    assert result_summary["world_size"] == 1 and result_summary["zero_stage"] == 0
    assert (run_dir / "train.log").read_text()
    assert list((run_dir / "checkpoints").iterdir())
    first = metrics(run_dir)[0]
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/samples_per_sec", "perf/tokens_per_sec"):
        assert key in first
    for key in ("perf/step_time_s", "perf/data_wait_frac", "mem/peak_bytes"):
        assert key in first
    assert "run summary" in result.stdout and str(run_dir) in result.stdout

    # The saved model/ reloads with plain transformers and reproduces the accuracy.
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from launcher.data.records import ConversationDataset, load_records

    model = AutoModelForImageTextToText.from_pretrained(run_dir / "model")
    processor = AutoProcessor.from_pretrained(run_dir / "model")
    from launcher.data.accuracy import exact_match_accuracy
    from launcher.data.shapes import prepare_data

    run_cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    _, eval_file, image_root = prepare_data(run_cfg.data, ROOT / "outputs" / "cache")  # the run's cached data
    records, _ = load_records(eval_file, image_root)

    correct, total = exact_match_accuracy(model, processor, ConversationDataset(records), max_new_tokens=4)
    assert correct / total == pytest.approx(result_summary["eval_accuracy"], abs=0.011)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_30_step_run_prints_its_plan_progress_and_one_summary(run_train, tmp_path, nproc):
    """The terminal of `python train.py train.max_steps=30` (W&B offline): what the launcher decided,
    progress and one summary, at most 15 lines, once per run however many ranks; the libraries' lines
    (DeepSpeed's, W&B's, transformers' bars, the compiler probe) go to train.log at most. It was 59."""
    run_dir = tmp_path / "run"
    # WANDB_SILENT unset, as for a user (the fixture silences W&B for the other tests).
    result = run_train(
        "train.max_steps=30", f"dist.nproc_per_node={nproc}", f"hydra.run.dir={run_dir}", env={"WANDB_SILENT": None}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    shown = "\n".join(lines)
    assert len(lines) <= 15, shown
    assert len(set(lines)) == len(lines), shown  # no rank repeats another's line
    (job,) = [line for line in lines if line.startswith("job: ")]  # stderr; the summary is on stdout
    assert job.startswith(f"job: tiny_llava (full) on {nproc} rank") and job.endswith(f"run dir {run_dir}")
    assert any("step 1/30 |" in line for line in lines) and any("step 30/30 |" in line for line in lines), shown
    assert "run summary: completed, 30 steps in" in shown and str(run_dir / "model") in shown
    assert "W&B      offline run " in shown and "upload with `wandb sync " in shown
    for noise in ("wandb:", "Loading weights", "Writing model shards", "Setting accelerator", "learning rate from"):
        assert noise not in shown, shown
    assert "test.c" not in shown and "built successfully" not in shown
    log = (run_dir / "train.log").read_text()
    for kept in ("Setting accelerator to CPU", "Attempting to get learning rate", "W&B offline run", "step 30/30"):
        assert kept in log, kept


@pytest.mark.parametrize("nproc", [1, 2])
def test_zero_stages_give_the_same_losses(run_train, tmp_path, nproc):
    """ZeRO changes memory, not mathematics: stages 0-3 agree to 1e-4 relative at fp32."""
    sweep_dir = tmp_path / "sweep"
    result = run_train(
        "-m",
        "zero=stage0,stage1,stage2,stage3",
        *SHORT,
        f"dist.nproc_per_node={nproc}",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    curves = {f"stage{i}": losses(sweep_dir / str(i)) for i in range(4)}
    assert all(len(curve) == 20 for curve in curves.values())
    assert curves["stage0"][-1] < curves["stage0"][0]  # it trains
    assert_same_curves(curves, rel=1e-4)
    for i in range(4):
        assert summary(sweep_dir / str(i))["zero_stage"] == i
        assert summary(sweep_dir / str(i))["world_size"] == nproc
    if nproc == 2:
        # At ZeRO-3 each rank holds about half of the parameters; below it, all of them.
        stage3 = summary(sweep_dir / "3")
        total = stage3["params_total"]
        for held in stage3["params_held_per_rank"]:
            assert held == pytest.approx(total / 2, rel=0.05)
        assert summary(sweep_dir / "2")["params_held_per_rank"] == [total, total]
        assert summary(sweep_dir / "2")["partitioned_at_load"] is False
        # One output directory per job, shared by both ranks.
        assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]


def test_zero3_two_ranks_generates_in_lock_step_and_saves_a_loadable_model(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(
        "deepspeed=z3",
        "precision=bf16",
        "dist.nproc_per_node=2",
        "logger=none",
        "train.max_steps=10",
        "data.eval_samples=16",
        f"hydra.run.dir={run_dir}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result_summary = summary(run_dir)
    assert result_summary["eval_accuracy"] is not None and result_summary["precision"] == "bf16"
    assert result_summary["partitioned_at_load"] is True  # zero.Init at from_pretrained, not afterwards
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(run_dir / "model")
    assert sum(p.numel() for p in model.parameters()) == result_summary["params_total"]


@pytest.mark.parametrize(
    "preset",
    ["z2_offload", "z3_offload"],  # optimizer on CPU at stage 2; parameters and optimizer at stage 3
)
def test_bf16_with_cpu_offload_trains(run_train, tmp_path, preset):
    run_dir = tmp_path / "run"
    result = run_train(f"deepspeed={preset}", "precision=bf16", *SHORT, f"hydra.run.dir={run_dir}", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(run_dir)
    assert curve[-1] < curve[0]
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert summary(run_dir)["precision"] == "bf16"


def write_multiturn_llava_json(root: Path) -> Path:
    """A small user data set in LLaVA format with multi-turn records and images in a subfolder."""
    from PIL import Image

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


@pytest.mark.parametrize("model", ["tiny_qwen2_vl", "tiny_llava"])
def test_user_llava_json_multiturn_data_trains(run_train, tmp_path, model):
    data = write_multiturn_llava_json(tmp_path / "data")
    run_dir = tmp_path / "run"
    result = run_train(
        f"model={model}",
        "data=llava_json",
        f"data.path={data}",
        "train.micro_batch_size=4",
        *SHORT,
        f"hydra.run.dir={run_dir}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(run_dir)
    assert len(curve) == 20 and curve[-1] < curve[0]
    assert summary(run_dir)["eval_loss"] is None  # no eval file given
