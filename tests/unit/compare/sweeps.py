"""Run directories as a training job leaves them, for the tests of launcher.compare (and tests/e2e).

summary.json starts from the launcher's own record of a planned job (launcher.core.summary.Summary);
metrics.jsonl and .hydra/*.yaml are written by hand, as the input format itself, so these sweeps are what a
real multirun leaves on disk, minus the checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

from launcher.core.rundir import RunDir
from launcher.core.summary import Summary

GIB = 2**30
MIB = 2**20
BASE_CHOICES = {"comm": "default", "model": "tiny_llava", "data": "shapes", "hydra/launcher": "basic"}
ERROR = "offload=param needs ZeRO stage 3: set zero=stage3 or offload=optimizer"
# What the sweep's runs are called (by job directory): the settings that tell them apart.
NAMES = {
    "0": "zero=stage2,offload=none,precision=bf16",
    "1": "zero=stage3,offload=none,precision=bf16",
    "2": "zero=stage2,offload=param,precision=bf16",
    "3": "zero=stage3,offload=none,precision=fp32",
    "10": "zero=stage2,offload=none,precision=fp32",
}
BY_THROUGHPUT = ["1", "0", "10", "3", "2"]  # sorted by samples/s, failed last


def write_run(
    run_dir: Path,
    *,
    overrides: list[str],
    choices: dict | None = None,
    summary: dict | None = None,
    metrics: list[dict] | None = None,
    hydra_choices: dict | None = None,
    extra_metrics_text: str = "",
) -> Path:
    """Write the files a job leaves in its run directory (only those given)."""
    run = RunDir(run_dir)
    run.hydra.mkdir(parents=True)
    run.overrides.write_text("".join(f"- {o}\n" for o in overrides))
    if hydra_choices is not None:
        lines = ["hydra:", "  runtime:", "    choices:"]
        lines += [f"      {k}: {'null' if v is None else v}" for k, v in hydra_choices.items()]
        run.hydra_config.write_text("\n".join(lines) + "\n")
    if summary is not None:
        planned = Summary.planned(world_size=1, overrides=overrides, choices={**BASE_CHOICES, **(choices or {})})
        run.summary.write_text(json.dumps({**planned.to_json(), "status": "completed", **summary}))
    if metrics is not None or extra_metrics_text:
        text = "".join(json.dumps(m) + "\n" for m in metrics or [])
        run.metrics.write_text(text + extra_metrics_text)
    return run_dir


def loss_lines(steps: int, start: float, samples_per_sec: float, peak: int) -> list[dict]:
    lines = []
    for step in range(1, steps + 1):
        lines.append(
            {
                "step": step,
                "train/loss": start / step**0.5,
                "train/lr": 1e-3,
                "perf/samples_per_sec": samples_per_sec,
                "mem/peak_bytes": peak - (steps - step) * MIB,
            }
        )
    lines.append({"step": steps, "eval/loss": start / steps**0.5 + 0.1, "eval/accuracy": 0.5})
    return lines


def make_sweep(root: Path) -> Path:
    """A 5-job sweep over zero x offload x precision: 3 completed, 1 failed, 1 killed hard."""
    root.mkdir(parents=True)
    (root / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    write_run(
        root / "0",
        overrides=["zero=stage2", "precision=bf16", "hydra.run.dir=/x/0"],
        choices={"zero": "stage2", "offload": "none", "precision": "bf16"},
        summary={
            "steps": 20,
            "wall_s": 75.0,
            "final_loss": 0.8,
            "eval_loss": 0.9,
            "eval_accuracy": 0.5,
            "samples_per_sec": 40.0,
            "tokens_per_sec": 4000.0,
            "peak_memory_bytes": int(1.5 * GIB),
        },
        metrics=loss_lines(20, 2.0, 40.0, int(1.5 * GIB)),
    )
    write_run(
        root / "1",
        overrides=["zero=stage3", "precision=bf16"],
        choices={"zero": "stage3", "offload": "none", "precision": "bf16"},
        summary={
            "steps": 20,
            "wall_s": 3725.0,
            "final_loss": 0.7,
            "samples_per_sec": 55.5,
            "tokens_per_sec": 5550.0,
            "padding_frac": 0.125,
            "mfu": 0.0375,
            "peak_memory_bytes": 900 * MIB,
        },
        metrics=loss_lines(20, 1.8, 55.5, 900 * MIB),
    )
    write_run(
        root / "2",
        overrides=["zero=stage2", "offload=param", "precision=bf16"],
        choices={"zero": "stage2", "offload": "param", "precision": "bf16"},
        summary={"status": "failed", "error": ERROR},
    )
    write_run(
        root / "3",
        overrides=["zero=stage3", "precision=fp32"],
        hydra_choices={
            **BASE_CHOICES,
            "zero": "stage3",
            "offload": "none",
            "precision": "fp32",
            "deepspeed": None,
        },
        metrics=loss_lines(5, 2.2, 20.0, 2 * GIB)[:-1],
        extra_metrics_text='{"step": 6, "train/lo',  # killed mid-write
    )
    write_run(
        root / "10",
        overrides=["zero=stage2", "precision=fp32"],
        choices={"zero": "stage2", "offload": "none", "precision": "fp32"},
        summary={
            "steps": 20,
            "wall_s": 95.0,
            "final_loss": 0.85,
            "samples_per_sec": 30.0,
            "peak_memory_bytes": 2 * GIB,
        },
        metrics=loss_lines(20, 2.1, 30.0, 2 * GIB),
    )
    return root
