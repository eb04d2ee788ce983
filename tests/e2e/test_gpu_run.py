"""bench/gpu_run.py in its CPU mode: the prepared GPU run of issue 41 (a plain PyTorch loop on transformers'
model, then the launcher's rows through launcher.tune), rehearsed end to end on shrunk configs of the same
two families, so that on a lent GPU only the sizes and the device differ. The padding phase is left out: its
path is the packing phase's with `tune.batching=[pad]`, which tests/unit/tune/test_tuner.py measures. The video
phase (issue 43) runs on its 4-frame clips of 224 px, taken as videos by the real Qwen2-VL image processor."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

# What bench/results/gpu.json's rows carry (issue 41), at least.
ROW_KEYS = {
    "runner", "model", "real_shape", "batching", "pack_length", "micro_batch", "zero", "checkpointing", "method",
    "real_tokens_per_s", "mfu", "peak_mib", "planned_mib", "data_wait_frac", "device", "commit", "date",
}  # fmt: skip


def stale_tuning(directory, candidate: str) -> None:
    """What an earlier call on a warm machine left in a phase's folder: a finished tuning with one row."""
    directory.mkdir(parents=True)
    (directory / "tune.md").write_text("# an earlier call's tuning\n")
    row = {"name": candidate, "status": "fits", "tokens_per_s": 1.0, "mfu": 0.5, "peak": 2**20, "planned": 2**20,
           "candidate": {"preset": "z0", "micro": 9, "checkpointing": False, "batching": "pack"}}  # fmt: skip
    (directory / "results.json").write_text(json.dumps([row]))
    (directory / "runs" / candidate).mkdir(parents=True)
    (directory / "runs" / candidate / "profile.md").write_text("# an earlier call's profile\n")


def test_the_rehearsal_writes_a_plain_loop_row_then_the_launchers_rows_with_their_plans(isolated_env, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    # A warm machine keeps the work folder between calls: this call's rows must be its own.
    for phase in ("packing", "profile"):
        stale_tuning(work / f"tune_{phase}", "stale-candidate")
    done = subprocess.run(
        [sys.executable, "bench/gpu_run.py", "--cpu", "--out-dir", str(out), "--work-dir", str(work),
         "--phases", "plain", "packing", "profile", "lora7b", "video16", "--records", "16", "--commit", "abc123"],
        cwd=ROOT, env=isolated_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {path.name for path in out.iterdir()} == {"gpu.json", "gpu.md", "profile.md", "run.log"}
    rows = json.loads((out / "gpu.json").read_text())
    assert all(set(row) >= ROW_KEYS for row in rows)
    assert not any(row.get("candidate") == "stale-candidate" for row in rows)
    assert all(row["commit"] == "abc123" and row["real_shape"] is False for row in rows)
    # The plain loop comes first, with no launcher in it: its rows have no plan and no data loading.
    plain = [row for row in rows if row["runner"] == "plain-loop"]
    assert rows[: len(plain)] == plain and [row["seq_len"] for row in plain] == [1024, 2048]
    assert all(row["status"] == "ok" and row["planned_mib"] is None and row["data_wait_frac"] is None for row in plain)
    launcher = rows[len(plain) :]
    assert [(row["phase"], row["batching"], row["method"], row["kernels"]) for row in launcher] == [
        ("packing", "pack", "full", "torch"), ("lora7b", "pack", "lora", "torch"), ("video16", "pad", "full", "torch")
    ]  # fmt: skip
    assert all(row["kernels_ran"] == "torch" for row in launcher)  # read from each candidate run's summary.json
    for row in rows:
        assert row["real_tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_mib"] > 0, row
    for row in launcher:
        assert row["status"] == "fits" and row["zero"] == 0 and row["planned_mib"] > 0, row
        assert 0 <= row["data_wait_frac"] < 1, row
    assert [row["pack_length"] for row in launcher] == [2048, 2048, None]
    table = (out / "gpu.md").read_text()
    assert "| real tokens/s | x plain best |" in table
    ratios = [line.split(" | ")[9] for line in table.splitlines() if line.startswith("| plain-loop")]
    assert "1.00" in ratios  # each row is a ratio to the plain loop's best
    # The fastest launcher row once more, its step 3 profiled: where its step went, by part.
    fastest = launcher[0]  # the only launcher row measured before the profile phase
    profile = (out / "profile.md").read_text()
    assert f"The fastest launcher row: {fastest['candidate']} ({fastest['phase']})" in profile
    assert "# Where steps 3-3 went (rank 0)" in profile and "| matmuls |" in profile and "| idle |" in profile
    assert "earlier call" not in profile and "\n  | " not in (out / "run.log").read_text()  # no command failed


def test_its_plan_mode_plans_each_tuner_phase_at_data_max_length_and_from_the_records(isolated_env, tmp_path):
    """`--plan GIB`: nothing trains; each tuner phase's candidates as the tuner plans them, side by side."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "bench/gpu_run.py", "--cpu", "--plan", "1", "--out-dir", str(out), "--work-dir",
         str(tmp_path / "work"), "--phases", "fixed", "packing", "--records", "8"],
        cwd=ROOT, env=isolated_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {path.name for path in out.iterdir()} == {"plan.md", "run.log"}
    lines = (out / "plan.md").read_text().splitlines()
    assert lines[0] == (
        "| phase | candidate | planned MiB at data.max_length | planned MiB from the records | on 1 GiB |"
    )
    rows = [line.split(" | ") for line in lines[2:4]]
    assert [row[:2] for row in rows] == [["| fixed", "z0-fp32-mb2-pad"], ["| packing", "z0-fp32-mb1-pack2048"]]
    fixed, packed = ([float(cell.replace(",", "")) for cell in row[2:4]] for row in rows)
    assert 0 < fixed[1] <= fixed[0]  # records cut to data.max_length: at most the limit
    assert packed[1] > 0 and packed[0] > 0  # a row's images from its plan, not from plan.text_tokens
    # A packed phase's rows, as its candidates would train them: how full, how many images each holds.
    assert lines[4] == "" and lines[5].startswith("- packing: ") and "(data.pack_max_images=12)" in lines[5]
    assert "candidates are planned from their lengths" in (out / "run.log").read_text()


def test_a_command_that_fails_leaves_its_last_lines_in_run_log_and_not_an_earlier_calls(tmp_path, monkeypatch):
    """Only OUT comes back from the GPU machine: a phase's own log stays there, so its end goes into run.log."""
    spec = importlib.util.spec_from_file_location("gpu_run", ROOT / "bench" / "gpu_run.py")
    gpu_run = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_run", gpu_run)  # its dataclasses look their module up there
    spec.loader.exec_module(gpu_run)
    out, log = tmp_path / "out", tmp_path / "tune_fixed.log"
    out.mkdir()
    log.write_text("an earlier call's line\n")
    run = gpu_run.Run(out, tmp_path, time.time() + 60, dict(os.environ), {})
    failing = "import sys; print('\\n'.join(f'line {i}' for i in range(40))); sys.exit('error: the reason')"
    assert gpu_run.run_until(run, [sys.executable, "-c", failing], log, 30) == 1
    tail = (out / "run.log").read_text().splitlines()
    assert tail[0].endswith("the last 30 lines of tune_fixed.log:") and len(tail) == 31
    assert tail[1] == "  | line 11" and tail[-1] == "  | error: the reason"
    assert gpu_run.run_until(run, [sys.executable, "-c", "print('fine')"], log, 30) == 0
    assert len((out / "run.log").read_text().splitlines()) == 31  # a command that succeeds adds nothing
