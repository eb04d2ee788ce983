"""`python train.py` as a user runs it: --cfg job, dry runs, and every bad input as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, cpu_only

NO_HEAVY_IMPORTS = """
import runpy, sys
sys.argv = ["train.py", "--cfg", "job"]
try:
    runpy.run_path("train.py", run_name="__main__")
finally:
    heavy = sorted(m for m in ("torch", "deepspeed", "transformers", "wandb") if m in sys.modules)
    print("HEAVY:", ",".join(heavy), file=sys.stderr)
"""


def test_cfg_job_prints_the_config_without_heavy_imports():
    result = subprocess.run(
        [sys.executable, "-c", NO_HEAVY_IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "zero:\n  stage: 0" in result.stdout
    assert "HEAVY: \n" in result.stderr or result.stderr.rstrip().endswith("HEAVY:")


def test_dry_run_writes_and_prints_the_final_deepspeed_json(run_train, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train("deepspeed=z3_offload", "precision=bf16", "dry_run=true", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    written = json.loads((run_dir / "ds_config.json").read_text())
    printed = json.loads(result.stdout[result.stdout.index("{") :])
    assert printed == written
    zero = written["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["device"] == "cpu"
    assert written["bf16"]["enabled"] is True
    assert zero["reduce_bucket_size"] == 64 * 64  # tiny_llava's language model: hidden 64
    assert not (run_dir / "metrics.jsonl").exists()  # trains nothing


def test_deepspeed_json_migration_from_the_command_line(run_train, tmp_path):
    base = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": False},
    }
    path = tmp_path / "ds_z2_config.json"
    path.write_text(json.dumps(base))
    run_dir = tmp_path / "run"
    result = run_train(f"deepspeed_json={path}", "precision=bf16", "dry_run=true", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    ds = json.loads((run_dir / "ds_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["overlap_comm"] is False
    assert ds["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    assert ds["train_micro_batch_size_per_gpu"] == 32 and ds["bf16"]["enabled"] is True


BAD_INPUTS = [
    (["zero=stage2", "offload=param"], 2, "parameter offload (offload_param.device=cpu) needs ZeRO stage 3"),
    (["deepspeed=z2", "offload=nvme"], 2, "needs ZeRO stage 3"),
    (["deepspeed=z3_nvme"], 2, "set offload.nvme_path="),
    (
        ["deepspeed=z3_nvme", "offload.nvme_path=/nonexistent/nvme"],
        2,
        "offload.nvme_path=/nonexistent/nvme does not exist",
    ),
    pytest.param(
        ["precision=fp16"],
        2,
        "precision=fp16 is not supported on this cpu: use precision=bf16 or precision=fp32",
        marks=cpu_only,
    ),
    (["precision=bf16", "+deepspeed_extra.fp16.enabled=true"], 2, "fp16 and bf16 are both enabled"),
    (["train.global_batch_size=30", "train.micro_batch_size=4"], 2, "train.global_batch_size=30 is not divisible"),
    (
        ["train.global_batch_size=32", "train.micro_batch_size=4", "train.grad_accum=2"],
        2,
        "inconsistent batch sizes: train.global_batch_size=32",
    ),
    (["train.micro_batch_size=0"], 2, "train.micro_batch_size=0 must be a positive integer"),
    (["train.lr=-1"], 2, "train.lr=-1.0 must be positive"),
    (["+deepspeed_extra.zero_optimisation.stage=3"], 2, "deepspeed_extra.zero_optimisation is not a DeepSpeed key"),
    (["+deepspeed_extra.zero_optimization.bogus=1"], 2, "DeepSpeed rejects zero_optimization.bogus"),
    (["+deepspeed_extra.gradient_clipping=auto"], 2, 'gradient_clipping="auto" would be silently dropped'),
    (["deepspeed_json=/nonexistent/ds.json"], 2, "deepspeed_json=/nonexistent/ds.json: no such file"),
    # A JSON written for 8 ranks (64 = 4 x 2 x 8), run on 1: the error names the file's keys and the overrides.
    (
        ["deepspeed_json=tests/golden/z2_fp32_ws8.json", "train.lr=1e-4"],
        2,
        "inconsistent batch sizes: deepspeed_json=tests/golden/z2_fp32_ws8.json sets train_batch_size=64, but the "
        "file's train_micro_batch_size_per_gpu=4 x the file's gradient_accumulation_steps=2 x world size 1 = 8",
    ),
    (
        ["deepspeed_json=tests/golden/z2_fp32_ws8.json", "train.global_batch_size=30"],
        2,
        "train.global_batch_size=30 is not divisible by train_micro_batch_size_per_gpu=4 (from "
        "deepspeed_json=tests/golden/z2_fp32_ws8.json) x world size 1",
    ),
    (["zero=stage0", "offload=optimizer"], 2, "optimizer offload needs ZeRO stage 1, 2 or 3"),
    (
        ["model=llava_1_5_7b", "model.path=/nonexistent/llava"],
        2,
        "model.path=/nonexistent/llava: cannot read its config",
    ),
    # Hydra's own compose-time errors: the schema rejects typos, unknown presets list the options.
    (["deepspeed=z9"], 1, "Available options in 'deepspeed'"),
    (["zero.stag=3"], 1, "Key 'stag' not in 'ZeroConfig'"),
]


def _values(case) -> tuple:
    return case.values if hasattr(case, "values") else case  # a pytest.param or a plain tuple


@pytest.mark.parametrize(
    ("args", "code", "message"), BAD_INPUTS, ids=[" ".join(_values(case)[0]) for case in BAD_INPUTS]
)
def test_bad_input_is_one_clear_line(run_train, tmp_path, args, code, message):
    run_dir = tmp_path / "run"
    result = run_train(*args, "dry_run=true", f"hydra.run.dir={run_dir}", timeout=120)
    assert result.returncode == code, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    assert not (run_dir / "ds_config.json").exists()  # nothing that looks complete
    if code == 2:
        error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(error_lines) == 1
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "failed" and message in summary["error"]


def test_bad_deepspeed_json_names_line_and_column(run_train, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"zero_optimization": {"stage": 3,}}')
    result = run_train(f"deepspeed_json={path}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert f"deepspeed_json={path}: not valid JSON (line 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_deepspeed_launcher_local_rank_argument_does_not_break_hydra(run_train, tmp_path):
    result = run_train("--local_rank=0", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert Path(tmp_path / "run" / "ds_config.json").is_file()


def _write_records(root: Path, records: object, name: str = "train.json") -> Path:
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), (200, 20, 20)).save(root / "images" / "ok.png")
    (root / "images" / "broken.png").write_bytes(b"not a png")
    path = root / name
    path.write_text(records if isinstance(records, str) else json.dumps(records))
    return path


GOOD = {
    "image": "images/ok.png",
    "conversations": [{"from": "human", "value": "<image>\nwhat?"}, {"from": "gpt", "value": "red"}],
}
NO_ANSWER = {"image": "images/ok.png", "conversations": [{"from": "human", "value": "<image>\nwhat?"}]}
MISSING_IMAGE = {**GOOD, "image": "images/nowhere.png"}
BAD_DATA = [
    ("malformed", '[{"image": "images/ok.png",]', "train.json:1: malformed JSON"),
    ("jsonl-malformed", json.dumps(GOOD) + "\n{oops\n", "train.json:2"),
    ("missing-image", [GOOD, MISSING_IMAGE], "record 1"),
    ("no-assistant", [GOOD, NO_ANSWER], "record 1"),
    ("empty", [], "train.json"),
    ("unreadable-image", [{**GOOD, "image": "images/broken.png"}] * 40, "broken.png"),
]


@pytest.mark.parametrize(("case", "records", "message"), BAD_DATA, ids=[c for c, _, _ in BAD_DATA])
def test_bad_data_names_the_file_and_record(run_train, tmp_path, case, records, message):
    path = _write_records(tmp_path / "data", records)
    run_dir = tmp_path / "run"
    result = run_train(
        "data=llava_json", f"data.path={path}", "logger=none", "train.micro_batch_size=4", f"hydra.run.dir={run_dir}"
    )
    assert result.returncode == 2, result.stderr[-2000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and message in summary["error"]
    assert not (run_dir / "model").exists()


def test_bad_records_can_be_skipped_and_counted(run_train, tmp_path):
    path = _write_records(tmp_path / "data", [GOOD] * 8 + [MISSING_IMAGE, NO_ANSWER])
    run_dir = tmp_path / "run"
    result = run_train(
        "data=llava_json",
        f"data.path={path}",
        "data.on_bad_record=skip",
        "logger=none",
        "train.micro_batch_size=4",
        "train.max_steps=2",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["records_skipped"] == 2
    # Which, and why: one line each, with the line data.on_bad_record=error would have stopped with.
    listed = run_dir / "skipped_records.jsonl"
    lines = [json.loads(line) for line in listed.read_text().splitlines()]
    assert [(line["split"], line["file"], line["record"]) for line in lines] == [
        ("train", str(path), 8),
        ("train", str(path), 9),
    ]
    assert lines[0]["reason"] == f"{path} record 8: image file {path.parent / 'images' / 'nowhere.png'} does not exist"
    assert lines[1]["reason"] == f"{path} record 9: no assistant turn to learn from (llava format)"
    assert f"data: 2 bad record(s) skipped: see {listed}" in (run_dir / "train.log").read_text()


def test_missing_data_file_is_named(run_train, tmp_path):
    result = run_train(
        "data=llava_json", "data.path=/nonexistent/train.json", "logger=none", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 2
    assert "error: data.path=/nonexistent/train.json: no such file" in result.stderr


def test_preflight_warns_or_refuses_a_job_that_will_not_fit(run_train, tmp_path):
    too_small = ["dry_run=true", "plan.gpu_memory_gb=0.0001", "plan.cpu_memory_gb=0.0001"]
    warned = run_train(*too_small, f"hydra.run.dir={tmp_path / 'warn'}")
    assert warned.returncode == 0, warned.stderr[-2000:]
    assert "warning: memory plan: deepspeed=z0 fp32 on 1 rank needs about" in warned.stderr
    refused = run_train(*too_small, "preflight=error", f"hydra.run.dir={tmp_path / 'error'}")
    assert refused.returncode == 2
    assert "error: memory plan: deepspeed=z0 fp32 on 1 rank" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (tmp_path / "error" / "ds_config.json").exists()
    quiet = run_train("dry_run=true", "preflight=off", *too_small[1:], f"hydra.run.dir={tmp_path / 'off'}")
    assert quiet.returncode == 0 and "memory plan" not in quiet.stderr
