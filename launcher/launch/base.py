"""A tiny model's pretrained base (model.tiny_base): the tiny model trained once on a question of the built-in
set, so that adapters start from a model that knows something (launcher.model.method.tiny_base_task).

The base is trained by `train.py` itself, in a child process (a full fine-tune of the tiny build on one rank,
ZeRO 0, no logger): the same training path as every job, nothing written twice. Its `model/` is kept in the
cache beside the tiny build it starts from, built once (launcher.core.builds: written whole, then renamed
into place; reused while every file matches its record) and named by everything it was trained from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from launcher.config.schema import Config
from launcher.core.builds import build_once, reusable
from launcher.core.errors import Interrupted, LauncherError, error_line
from launcher.core.rundir import RunDir
from launcher.core.signals import name, received
from launcher.job.planning import cache_dir
from launcher.model.method import tiny_base_task

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "train.py"
RECORD = "tiny_base.json"
RECIPE_VERSION = 1  # bump when the pretraining below changes, so cached bases are trained again
# Steps that learn each question, the vision tower kept random: the colour question to 1.000 held-out exact match
# after 400, the shape question (whose answer also names the colour) to 0.970 after 1,000 (BENCHMARKS.md).
STEPS = {"colour": 400, "shape": 1000}


def pretrained_base(cfg: Config, tiny_dir: str, say: Callable[[str], None]) -> str:
    """The directory the job's ranks load: `tiny_dir` (the tiny build, random weights), or its base pretrained
    on the task model.tiny_base asks for, trained here the first time (a dry run trains nothing)."""
    task = tiny_base_task(cfg)
    if task is None:
        return tiny_dir
    arguments = _arguments(cfg, Path(tiny_dir), task)
    key = hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(tiny_dir).with_name(f"{Path(tiny_dir).name}-{task}-base-{key}")
    what = f"{cfg.model.arch} pretrained on the built-in {task} question"
    random_instead = "model.tiny_base=random starts from random weights"
    if cfg.dry_run:  # the tiny build has the base's architecture: the plan reads it
        say(f"base: {what} ({arguments['steps']} steps, trained once at the first start; {random_instead})")
        return tiny_dir
    if not reusable(out, arguments, RECORD):
        say(f"base: training {what}, {arguments['steps']} steps, once, into {out} ({random_instead})")
    build_once(out, arguments, RECORD, lambda where: _train(cfg, Path(tiny_dir), task, arguments, where))
    scored = json.loads((out / "pretraining.json").read_text())["eval_accuracy"]
    known = task == str(cfg.data.task) and cfg.data.synthetic
    say(
        f"base: {what}, held-out exact match {scored:.3f} after {arguments['steps']} steps"
        + ("; it answers this job's question already" if known else "; this job's question is new to it")
    )
    return str(out)


def _arguments(cfg: Config, tiny_dir: Path, task: str) -> dict[str, object]:
    """What the base is trained from: the tiny build (its name holds its architecture, sizes, seed and
    vocabulary), the task and its steps, and the built-in set's images as the job has them."""
    synthetic = bool(cfg.data.synthetic)
    return {
        "recipe": RECIPE_VERSION,
        "tiny_build": tiny_dir.name,
        "task": task,
        "steps": STEPS[task],
        "train_seed": int(cfg.train.seed),
        "data_seed": int(cfg.data.seed) if synthetic else 0,
        "image_size": int(cfg.data.image_size) if synthetic else 32,
    }


def _alone() -> dict[str, str]:
    """This environment without a launcher's or scheduler's rank variables: the child is a job of its own."""
    ranks = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC")
    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", *ranks))}


def _train(cfg: Config, tiny_dir: Path, task: str, arguments: dict[str, object], where: Path) -> None:
    """Train the base with train.py into `where`/run, then keep its model/ (and what it scored) in `where`."""
    run = where / "run"
    command = [
        sys.executable,
        str(TRAIN_SCRIPT),
        f"model={cfg.model.name}",
        "model.source=pretrained",
        f"model.path={tiny_dir}",
        "method=full",
        # The vision tower keeps its random weights: tuned to colours alone it loses the shapes, and adapters
        # on the language model cannot learn the shape question then (0.57 held-out exact match against 0.94).
        "model.freeze_vision=true",
        "loss=sft",
        "data=shapes",
        f"data.task={task}",
        f"data.seed={arguments['data_seed']}",
        f"data.image_size={arguments['image_size']}",
        f"train.max_steps={arguments['steps']}",
        f"train.seed={arguments['train_seed']}",
        "deepspeed=z0",
        "dist=local",
        "logger=none",
        f"cache_dir={cache_dir(cfg)}",
        f"hydra.run.dir={run}",
    ]
    with (where / "pretraining.log").open("w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=TRAIN_SCRIPT.parent, env=_alone())
        stopped = None
        while child.poll() is None:  # a stop of this launcher stops the child too (it ends "interrupted")
            if stopped is None and (stopped := received()) is not None:
                child.send_signal(signal.SIGTERM)
            time.sleep(0.1)
    if stopped is not None or child.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM):
        raise Interrupted(f"stopped by {stopped or name(signal.SIGTERM)} while training the tiny base; start again")
    trained = RunDir(run)
    summary = trained.read_summary()
    if child.returncode != 0 or summary is None or not trained.model.is_dir():
        raise LauncherError(
            f"training the tiny base (model.tiny_base) failed: {error_line((where / 'pretraining.log').read_text())}; "
            "model.tiny_base=random starts from random weights instead"
        )
    for item in trained.model.iterdir():
        shutil.move(str(item), where / item.name)
    shutil.rmtree(run)
    (where / "pretraining.log").unlink()
    scored = {key: getattr(summary, key) for key in ("eval_accuracy", "eval_loss", "final_loss", "steps")}
    (where / "pretraining.json").write_text(json.dumps({"task": task, **scored}, indent=2) + "\n")
