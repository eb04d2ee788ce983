"""`python train.py` as a user runs it, where the subprocess is the point: the README's first-run command,
what the terminal shows, and jobs of two ranks (torchrun): ZeRO stages that agree, LoRA at ZeRO-3 with its
adapter gathered, exported and reloaded, and ranks whose batches differ in modality (ZeRO-3's guard,
the watchdog).

One rank in this process: tests/unit/train/test_trainer.py and test_loaders.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from launcher.config.schema import config_from_yaml
from launcher.core.rundir import RunDir
from launcher.data.accuracy import exact_match_accuracy
from launcher.data.records import ConversationDataset, load_records
from launcher.data.shapes import prepare_data
from launcher.data.video import write_video
from launcher.export.export import export
from launcher.train.checkpoint import ResumableSampler
from launcher.train.faults import FAULT_ENV
from tests.helpers import (
    COLOURS,
    ROOT,
    conversation,
    losses,
    read_metrics,
    read_summary,
    run_train_py,
    subprocess_env,
    write_images,
)

pytestmark = pytest.mark.slow

CACHE = ROOT / "outputs" / "cache"
# Short runs: no W&B, fp32, seeded.
SHORT = ("logger=none", "train.micro_batch_size=8", "train.eval_every=0", "train.seed=1")


def succeeded(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def eval_accuracy(model: Any, run_dir: Path) -> float:
    """Exact match of `model` on the run's held-out samples, as the run measured it (data.eval_samples)."""
    from transformers import AutoProcessor

    config = config_from_yaml(RunDir(run_dir).config)
    _, eval_file, image_root = prepare_data(config.data, CACHE)  # the run's cached data
    records, _ = load_records(eval_file, image_root)
    processor = AutoProcessor.from_pretrained(RunDir(run_dir).model)
    dataset = ConversationDataset(records[: int(config.data.eval_samples)])
    correct, total = exact_match_accuracy(model, processor, dataset, max_new_tokens=int(config.data.max_new_tokens))
    return correct / total


# ----------------------------------------------------------------------------- the first run
@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """`python train.py` as in the README (W&B offline), once: its test reads it, and the LoRA job below
    fine-tunes its model."""
    tmp = tmp_path_factory.mktemp("first")
    run_dir = tmp / "run"
    return run_train_py(subprocess_env(tmp), f"hydra.run.dir={run_dir}", timeout=900), run_dir


def test_the_first_run_command_learns_and_its_saved_model_reloads(first_run):
    """`python train.py` as in the README: held-out exact match >= 0.9, in under 3 minutes."""
    from transformers import AutoModelForImageTextToText

    result, run_dir = first_run
    succeeded(result)
    summary = read_summary(run_dir)
    assert summary["status"] == "completed"
    assert summary["eval_accuracy"] >= 0.9, summary
    for key in ("final_loss", "eval_loss", "samples_per_sec", "tokens_per_sec", "peak_memory_bytes", "wall_s"):
        assert summary[key] > 0, key
    assert summary["world_size"] == 1 and summary["zero_stage"] == 0
    assert RunDir(run_dir).train_log.read_text()
    assert list(RunDir(run_dir).checkpoints.iterdir())
    first = read_metrics(run_dir)[0]
    for key in ("train/loss", "train/lr", "train/grad_norm", "perf/samples_per_sec", "perf/tokens_per_sec"):
        assert key in first
    for key in ("perf/step_time_s", "perf/data_wait_frac", "mem/peak_bytes"):
        assert key in first
    assert "run summary" in result.stdout and str(run_dir) in result.stdout

    # The saved model/ reloads with plain transformers and reproduces the accuracy.
    model = AutoModelForImageTextToText.from_pretrained(RunDir(run_dir).model)
    assert eval_accuracy(model, run_dir) == pytest.approx(summary["eval_accuracy"], abs=0.011)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_short_run_prints_its_plan_progress_and_one_summary(run_train, tmp_path, nproc):
    """The terminal of `python train.py train.max_steps=5` (W&B offline): what the launcher decided,
    progress and one summary, at most 15 lines, once per run however many ranks; the libraries' lines
    (DeepSpeed's, W&B's, transformers' bars, the compiler probe) go to train.log at most. It was 59."""
    run_dir = tmp_path / "run"
    # WANDB_SILENT unset, as for a user (the fixture silences W&B for the other tests). On 2 ranks, rank 1 holds
    # 400 MiB more from step 3: the memory figures rank 0 writes are the largest rank's.
    extra = {"WANDB_SILENT": None, FAULT_ENV: "1:3:alloc=400" if nproc == 2 else None}
    result = run_train("train.max_steps=5", f"dist.nproc_per_node={nproc}", f"hydra.run.dir={run_dir}", env=extra)
    succeeded(result)
    if nproc == 2:
        peaks = [row["mem/peak_bytes"] for row in read_metrics(run_dir)]
        assert peaks[2] - peaks[1] >= 300 * 2**20, peaks  # rank 1's ballast (rank 0's own peak barely moves)
        assert read_summary(run_dir)["peak_memory_bytes"] >= peaks[2]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    shown = "\n".join(lines)
    assert len(lines) <= 15, shown
    assert len(set(lines)) == len(lines), shown  # no rank repeats another's line
    (job,) = [line for line in lines if line.startswith("job: ")]  # stderr; the summary is on stdout
    assert job.startswith(f"job: tiny_llava (full) on {nproc} rank") and job.endswith(f"run dir {run_dir}")
    assert any("step 1/5 |" in line for line in lines) and any("step 5/5 |" in line for line in lines), shown
    assert "run summary: completed, 5 steps in" in shown and str(RunDir(run_dir).model) in shown
    assert "W&B      offline run " in shown and "upload with `wandb sync " in shown
    for noise in ("wandb:", "Loading weights", "Writing model shards", "Setting accelerator", "learning rate from"):
        assert noise not in shown, shown
    assert "test.c" not in shown and "built successfully" not in shown
    log = RunDir(run_dir).train_log.read_text()
    for kept in ("Setting accelerator to CPU", "Attempting to get learning rate", "W&B offline run", "step 5/5"):
        assert kept in log, kept


# ----------------------------------------------------------------------------- ZeRO at two ranks
def test_zero_stages_agree_at_two_ranks_and_zero3_partitions_and_generates_in_lock_step(run_train, tmp_path):
    """ZeRO changes memory, not mathematics: at two ranks stages 0-3 agree to 1e-4 relative at fp32 (one
    sweep, one directory per job shared by both ranks). At ZeRO-3 each rank holds about half of the
    parameters, partitioned while they load; both ranks generate the held-out answers in lock-step; the
    gathered model saves and reloads whole."""
    sweep = tmp_path / "sweep"
    stages = "zero=stage0,stage1,stage2,stage3"
    eval_set = ("data.eval_accuracy=true", "data.eval_samples=16")
    result = run_train("-m", stages, *SHORT, "train.max_steps=6", *eval_set, "dist.nproc_per_node=2",
                       f"hydra.sweep.dir={sweep}", timeout=1200)  # fmt: skip
    succeeded(result)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    curves = {f"stage{i}": losses(sweep / str(i)) for i in range(4)}
    assert all(len(curve) == 6 for curve in curves.values()) and curves["stage0"][-1] < curves["stage0"][0]
    for name, curve in curves.items():
        for step, (a, b) in enumerate(zip(curves["stage0"], curve, strict=True), start=1):
            assert abs(a - b) <= 1e-4 * abs(a), f"{name} vs stage0 at step {step}: {b} vs {a}"
    summaries = [read_summary(sweep / str(i)) for i in range(4)]
    assert [(s["zero_stage"], s["world_size"]) for s in summaries] == [(i, 2) for i in range(4)]
    stage2, stage3 = summaries[2], summaries[3]
    total = stage3["params_total"]
    for held in stage3["params_held_per_rank"]:
        assert held == pytest.approx(total / 2, rel=0.05)
    assert stage2["params_held_per_rank"] == [total, total] and stage2["partitioned_at_load"] is False
    assert stage3["partitioned_at_load"] is True  # zero.Init at from_pretrained, not afterwards
    assert stage3["eval_accuracy"] is not None
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(RunDir(sweep / "3").model)
    assert sum(p.numel() for p in model.parameters()) == total


# ----------------------------------------------------------------------------- LoRA at two ranks
@pytest.fixture(scope="module")
def zero3_lora_run(first_run) -> Path:
    """What people use LoRA for: a trained model (the first run's) learns a second task (the colour
    question about the same images) with method=lora at ZeRO-3 on 2 ranks, checkpointed mid-run and at
    the end."""
    result, base = first_run
    succeeded(result)
    run_dir = base.parent / "lora"
    lora = ("method=lora", "model.source=pretrained", f"model.path={RunDir(base).model}", "data.task=colour")
    two_ranks = ("deepspeed=z3", "dist.nproc_per_node=2")
    steps = ("train.max_steps=20", "train.save_every=10", "train.eval_every=0", "data.eval_samples=64")
    env = subprocess_env(base.parent)
    succeeded(run_train_py(env, *lora, *two_ranks, "logger=none", *steps, f"hydra.run.dir={run_dir}", timeout=900))
    return run_dir


def test_zero3_adapter_is_complete_and_equals_the_gathered_weights(zero3_lora_run, first_run):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    run_dir = zero3_lora_run
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["zero_stage"] == 3 and summary["world_size"] == 2
    assert summary["method"] == "lora" and 0 < summary["params_trainable"] <= 0.1 * summary["params_total"]
    assert summary["trainable_fraction"] == pytest.approx(summary["params_trainable"] / summary["params_total"])
    adapter = load_file(RunDir(run_dir).model / "adapter_model.safetensors")
    config = json.loads((RunDir(run_dir).model / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == RunDir(first_run[1]).model
    assert config["modules_to_save"] == ["model.multi_modal_projector"]

    # DeepSpeed's consolidation of the last checkpoint (same step as model/): every trainable tensor.
    gathered = get_fp32_state_dict_from_zero_checkpoint(str(RunDir(run_dir).checkpoints), tag="step20")
    expected = {
        name.replace(".default", "").replace("modules_to_save.", ""): tensor
        for name, tensor in gathered.items()
        if "lora_" in name or "modules_to_save" in name
    }
    assert len(expected) == 2 * 7 * 2 + 4  # (A, B) x 7 linear layers x 2 layers + the projector's 2 linears
    assert sorted(adapter) == sorted(expected)
    for name, tensor in expected.items():
        assert adapter[name].shape == tensor.shape and tensor.numel() > 0, name
        torch.testing.assert_close(adapter[name].float(), tensor, rtol=0, atol=0, msg=name)
    assert any(float(t.detach().abs().sum()) > 0 for n, t in expected.items() if "lora_B" in n)  # B trained off zero


def test_zero3_merged_export_reproduces_logits_and_accuracy(zero3_lora_run, tmp_path):
    from transformers import AutoModelForImageTextToText

    run_dir = zero3_lora_run
    done = export(run_dir, out=tmp_path / "merged", merge=True)
    assert (done.kind, done.origin) == ("merged model", "model/") and done.difference <= 1e-4
    assert not (done.out / "adapter_config.json").exists() and (done.out / "config.json").is_file()
    model = AutoModelForImageTextToText.from_pretrained(done.out, dtype=torch.float32)
    assert not any("lora" in name for name, _ in model.named_parameters())
    # The projector trained in full survived the merge (ms-swift#9187 lost a trained component there).
    trained = load_file(RunDir(run_dir).model / "adapter_model.safetensors")
    torch.testing.assert_close(
        model.model.multi_modal_projector.linear_1.weight,
        trained["base_model.model.model.multi_modal_projector.linear_1.weight"].float(),
    )
    assert eval_accuracy(model, run_dir) == read_summary(run_dir)["eval_accuracy"]


def test_zero3_adapter_loads_with_plain_peft_and_reproduces_accuracy(zero3_lora_run):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    run_dir = zero3_lora_run
    base = json.loads((RunDir(run_dir).model / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), RunDir(run_dir).model
    )
    accuracy = eval_accuracy(model, run_dir)
    assert accuracy == read_summary(run_dir)["eval_accuracy"] and accuracy > 0


def test_export_from_a_mid_run_checkpoint(zero3_lora_run, tmp_path):
    for merge in (True, False):
        done = export(zero3_lora_run, out=tmp_path / f"merge-{merge}", checkpoint="step10", merge=merge)
        assert done.kind == ("merged model" if merge else "LoRA adapter") and "step10" in done.origin
        assert (done.out / ("config.json" if merge else "adapter_config.json")).is_file()


@pytest.mark.parametrize(
    ("label", "overrides", "jobs"),
    [
        ("z0-z2", ["-m", "deepspeed=z0,z2"], 2),  # one sweep: two jobs
        ("z3_offload-bf16", ["deepspeed=z3_offload", "precision=bf16"], 1),
    ],
    ids=["z0-z2", "z3_offload-bf16"],
)
def test_lora_trains_on_two_ranks_at_every_zero_stage(run_train, tmp_path, label, overrides, jobs):
    """ZeRO-3 without offload: `zero3_lora_run` above; at one rank: tests/unit/train/test_trainer.py. Each
    job ends generating the held-out answers on both ranks (at ZeRO-3 in bf16, in lock-step). The adapters train
    on the tiny model's random weights: the pretrained base is tests/unit/launch/test_run.py's."""
    out = tmp_path / label
    where = f"hydra.sweep.dir={out}" if jobs > 1 else f"hydra.run.dir={out}"
    lora = ("method=lora", "model.tiny_base=random", *SHORT, "data.eval_samples=16", "train.max_steps=8")
    lora = (*lora, "dist.nproc_per_node=2")
    succeeded(run_train(*overrides, *lora, where, timeout=1200))
    for run_dir in [out / str(job) for job in range(jobs)] if jobs > 1 else [out]:
        curve = losses(run_dir)
        assert len(curve) == 8 and curve[-1] < curve[0], run_dir
        summary = read_summary(run_dir)
        assert summary["method"] == "lora" and summary["params_trainable"] <= 0.1 * summary["params_total"]
        assert summary["world_size"] == 2 and summary["eval_accuracy"] is not None
        adapter = load_file(RunDir(run_dir).model / "adapter_model.safetensors")
        assert adapter and all(t.numel() > 0 for t in adapter.values())


# ----------------------------------------------------------------------------- ranks of different modalities
MICRO, STEPS, SEED = 2, 6, 3


def modality_split_records(root: Path) -> Path:
    """Records placed so that, in the order the sampler deals them, rank 0's batches of steps 1-3 are
    text-only while rank 1's have images and videos (a record of each in a batch), and the reverse for steps
    4-6, where rank 0's have images only: rank 0 is never given a video (issue 43's acceptance). A model that
    takes videos as videos (tiny_qwen2_vl) calls its vision tower once for a batch's images and once more
    for its videos: the guard gives rank 0 a blank video in steps 4-6, and blank media to each text-only
    batch."""
    names = write_images(root / "img")
    videos = write_colour_clips(root / "img")
    n = 2 * MICRO * STEPS
    dealt = {
        rank: list(ResumableSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=SEED)) for rank in (0, 1)
    }
    records: list[dict | None] = [None] * n
    for rank, order in dealt.items():
        for position, index in enumerate(order):
            step = position // MICRO  # 0-based
            text_only = (rank == 0) == (step < STEPS // 2)
            if rank == 1 and not text_only and position % MICRO == 0:
                video = videos[index % len(videos)]
                turns = [{"from": "human", "value": "<video>\nwhich colour?"},
                         {"from": "gpt", "value": video.split("_")[0]}]  # fmt: skip
                records[index] = {"id": str(index), "video": video, "conversations": turns}
                continue
            images = [] if text_only else [names[index % len(names)]] * (1 + index % 2)
            question, answer = conversation(index, images)
            turns = [{"from": "human", "value": "<image>" * len(images) + question}, {"from": "gpt", "value": answer}]
            records[index] = {"id": str(index), "images": images, "conversations": turns}
    path = root / "split.json"
    path.write_text(json.dumps(records))
    return path


def write_colour_clips(root: Path) -> list[str]:
    """A 2 s clip of each colour, brightening frame by frame (4 frames sampled of 8)."""
    names = []
    for colour, rgb in COLOURS.items():
        frames = [np.full((32, 40, 3), [min(255, c + 4 * t) for c in rgb], dtype=np.uint8) for t in range(8)]
        write_video(root / f"{colour}_clip.mp4", frames, fps=4)
        names.append(f"{colour}_clip.mp4")
    return names


def zero_args(root: Path, path: Path) -> list[str]:
    return [
        "logger=none",
        "train.eval_every=0",
        "data.eval_accuracy=false",
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
    """On tiny_qwen2_vl, which takes videos as videos: both guards (a blank image, a blank video) at once."""
    path = modality_split_records(tmp_path)
    sweep = tmp_path / "sweep"
    args = [*zero_args(tmp_path, path), "model=tiny_qwen2_vl", f"hydra.sweep.dir={sweep}"]
    succeeded(run_train("-m", "deepspeed=z0,z3", *args, timeout=900))
    curves = {}
    for job, stage in enumerate(("z0", "z3")):
        summary = read_summary(sweep / str(job))
        assert summary["status"] == "completed" and summary["records_skipped"] == 0  # the videos trained
        curves[stage] = losses(sweep / str(job))
    assert len(curves["z3"]) == STEPS
    for z0, z3 in zip(curves["z0"], curves["z3"], strict=True):
        assert abs(z3 - z0) <= 1e-5 * abs(z0), curves


def assert_ended_within(run_dir: Path, seconds: float) -> None:
    """From rank 0's last line before step 1 (its data cache is ready) to the end of the job's files."""
    log = RunDir(run_dir).train_log.read_text()
    ready = re.findall(r"^\[([\d-]+ [\d:]+),(\d+)\]\[launcher\]\[INFO\] - data cache", log, re.M)[-1]
    ready_at = time.mktime(time.strptime(ready[0], "%Y-%m-%d %H:%M:%S")) + int(ready[1]) / 1000
    ended_at = max(path.stat().st_mtime for path in RunDir(run_dir).errors.iterdir())
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
    assert read_summary(run_dir)["status"] == "failed"
    assert_ended_within(run_dir, 20 + 30)


def test_a_hung_step_is_ended_by_the_watchdog_with_one_line(run_train, tmp_path):
    """Rank 1 stops answering in step 2 (the test hook), rank 0 waits in the step's all-reduce: each
    rank's watchdog dumps its stacks and the job ends with one line naming the step."""
    path = modality_split_records(tmp_path)
    run_dir = tmp_path / "hang"
    timeout = 15
    args = [*zero_args(tmp_path, path), "deepspeed=z3", f"dist.step_timeout_s={timeout}", "dist.timeout_s=600"]
    result = run_train(*args, f"hydra.run.dir={run_dir}", env={FAULT_ENV: "1:2:hang"}, timeout=900)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert re.search(rf"rank \d: step 2 did not finish within dist.step_timeout_s={timeout} s", errors[0]), errors[0]
    stacks = {p.name: p.read_text() for p in RunDir(run_dir).errors.glob("rank*_stacks.txt")}
    assert stacks and all("train_step" in text for text in stacks.values()), stacks
    assert read_summary(run_dir)["status"] == "failed" and [m["step"] for m in read_metrics(run_dir)] == [1]
    assert_ended_within(run_dir, timeout + 30)
