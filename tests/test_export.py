"""`python -m launcher.export`: what it refuses (fast) and a full fine-tune exported from ZeRO checkpoints (slow).

LoRA exports (merged and not) are in tests/test_lora_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose_config, limit_file_size
from tests.test_train_e2e import summary


def export(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLM_LAUNCHER_CACHE": str(ROOT / "outputs" / "cache")}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "launcher.export", str(run_dir), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def eval_accuracy(model, run_dir: Path) -> float:
    """Exact match of `model` on the run's held-out samples, as the run measured it (data.eval_samples)."""
    from transformers import AutoProcessor

    from launcher.data.records import ConversationDataset, load_records
    from launcher.data.accuracy import exact_match_accuracy
    from launcher.data.shapes import prepare_data

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    _, eval_file, image_root = prepare_data(cfg.data, ROOT / "outputs" / "cache")
    records, _ = load_records(eval_file, image_root)
    records = records[: int(cfg.data.eval_samples)]
    processor = AutoProcessor.from_pretrained(run_dir / "model")
    correct, total = exact_match_accuracy(
        model, processor, ConversationDataset(records), max_new_tokens=int(cfg.data.max_new_tokens)
    )
    return correct / total


def assert_one_line(result: subprocess.CompletedProcess[str], message: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.fixture
def never_trained(tmp_path: Path) -> Path:
    """A run directory that stopped before its first checkpoint: its config, no model/, no checkpoint."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_config(["logger=none"]), run_dir / ".hydra" / "config.yaml")
    (run_dir / "checkpoints" / "step5").mkdir(parents=True)  # begun, never completed
    return run_dir


def test_a_run_with_no_model_and_no_checkpoint_is_one_line(never_trained):
    assert_one_line(export(never_trained), f"{never_trained} holds no model/ and no complete checkpoint to export")
    assert not (never_trained / "export").exists()


def test_an_unknown_checkpoint_tag_names_the_complete_ones(never_trained):
    assert_one_line(export(never_trained, "--checkpoint", "step9"), "--checkpoint step9: no complete checkpoint")


def test_a_destination_that_exists_and_is_not_empty_is_refused(never_trained, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "weights.bin").write_text("someone else's")
    assert_one_line(export(never_trained, "--out", str(out)), f"--out {out} exists and is not empty")
    assert (out / "weights.bin").read_text() == "someone else's"


def test_a_directory_that_is_no_run_is_refused(tmp_path):
    assert_one_line(export(tmp_path), f"{tmp_path} is not a run directory")


@pytest.mark.slow
def test_full_finetune_at_zero3_on_two_ranks_exports_from_a_mid_run_checkpoint_and_the_end(run_train, tmp_path):
    from transformers import AutoModelForImageTextToText

    run_dir = tmp_path / "run"
    result = run_train(
        "deepspeed=z3",
        "dist.nproc_per_node=2",
        "logger=none",
        "train.micro_batch_size=8",
        "train.max_steps=60",
        "train.save_every=30",
        "train.eval_every=0",
        "data.eval_samples=64",
        f"hydra.run.dir={run_dir}",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Mid-run: the ZeRO-3 partitions of both ranks consolidated by zero_to_fp32, then reloaded and compared.
    middle = export(run_dir, "--checkpoint", "step30", "--out", str(tmp_path / "step30"))
    assert middle.returncode == 0, middle.stderr[-3000:]
    # The end, from model/ and from the last checkpoint: the same weights either way.
    end = export(run_dir, "--out", str(tmp_path / "end"))
    assert end.returncode == 0, end.stderr[-3000:]
    last = export(run_dir, "--checkpoint", "latest", "--out", str(tmp_path / "latest"))
    assert last.returncode == 0, last.stderr[-3000:]
    exported = {
        name: AutoModelForImageTextToText.from_pretrained(tmp_path / name, dtype=torch.float32)
        for name in ("step30", "end", "latest")
    }
    end_weights = exported["end"].state_dict()
    for name, tensor in exported["latest"].state_dict().items():
        torch.testing.assert_close(tensor, end_weights[name], msg=name)
    middle_weights = exported["step30"].state_dict()
    assert any(not torch.equal(middle_weights[name], end_weights[name]) for name in end_weights)
    assert eval_accuracy(exported["end"], run_dir) == summary(run_dir)["eval_accuracy"]


@pytest.mark.slow
def test_zero_stage0_checkpoint_exports(run_train, tmp_path):
    """Stage 0 at fp32 keeps no optimizer partitions: the module's own weights are exported."""
    run_dir = tmp_path / "run"
    result = run_train("logger=none", "train.max_steps=4", "train.eval_every=0", "data.eval_accuracy=false",
                       f"hydra.run.dir={run_dir}", timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    exported = export(run_dir, "--checkpoint", "latest", "--out", str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()

    # A disk that fills (here: a file size limit) while the export is written: one line, nothing left.
    full = tmp_path / "full"
    result = subprocess.run(
        [sys.executable, "-m", "launcher.export", str(run_dir), "--out", str(full)],
        cwd=ROOT,
        env={**os.environ, "VLM_LAUNCHER_CACHE": str(ROOT / "outputs" / "cache")},
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_file_size(64 * 1024),
    )
    assert result.returncode == 1, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"cannot write the export {full}" in errors[0] and "Traceback" not in result.stderr
    assert not full.exists() and not list(tmp_path.glob(".full*"))


def test_nonsense_samples_or_tolerance_are_refused(never_trained):
    for args, message in ((["--samples", "0"], "--samples 0"), (["--tolerance", "-1"], "--tolerance -1.0")):
        result = export(never_trained, *args)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
