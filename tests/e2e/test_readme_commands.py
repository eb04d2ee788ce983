"""Every command in the README's ```bash blocks works as written, and so does its Python snippet.

Each `python train.py ...` line runs with tiny settings appended (2 steps, no W&B, no evaluation, its
own run directory); lines that name a real model run as `dry_run=true` (no weights are read, their
architecture configs ship with the launcher). Paths the README makes up (`/data/train.json`,
`outputs/runs/2026-11-29/16-00-00`, `RUN_DIR`, ...) are replaced by files and runs this module makes.
The two set-up-and-go commands at the top are what CI itself runs (tests/unit/test_readme.py).

A command whose job another command here trains already, or an end-to-end test trains as it is, is
planned only (`dry_run=true`, PLANNED; the built-in set drawn at 64 records): its command line composes,
its DeepSpeed dict is built and validated by DeepSpeed's own config model, and what sets it apart from the
job trained elsewhere is asserted in that dict. Each entry says where its training is covered.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from launcher.config.precision import precision_of
from tests.helpers import ROOT, subprocess_env

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
TINY = ["train.max_steps=2", "logger=none", "train.eval_every=0", "data.eval_accuracy=false"]
REAL_MODELS = ("model=llava_1_5_7b", "model=qwen2_vl_2b", "model=qwen2_5_vl_7b")
README_SWEEP_DIR = "outputs/multirun/2026-11-29/16-00-00"

# Commands this test cannot run, each still checked to compose (`python train.py ARGS --cfg job`):
# (a fragment of the README line, why it cannot run here)
EXCEPTIONS = [
    ("dist=torchrun dist.nnodes=2", "one command per node: the other node (node0's peer) does not exist here"),
]


def _zero(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = dicts
    return ds["zero_optimization"]


def _offloaded_bf16_zero3(dicts: list[dict[str, Any]]) -> bool:
    zero = _zero(dicts)
    offloaded = zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    return zero["stage"] == 3 and offloaded and precision_of(dicts[0]) == "bf16"


def _shapes(dicts: list[dict[str, Any]]) -> set[tuple[int, str]]:
    return {(ds["zero_optimization"]["stage"], precision_of(ds)) for ds in dicts}


# Commands planned only: (a fragment of the README line, where its job trains, what its dicts must say).
PLANNED: list[tuple[str, str, Callable[[list[dict[str, Any]]], bool]]] = [
    (
        "train.py deepspeed=z3_offload precision=bf16",
        "tests/unit/train/test_trainer.py::test_bf16_with_cpu_offload_trains[z3_offload] trains this job",
        lambda dicts: _offloaded_bf16_zero3(dicts),
    ),
    (
        "deepspeed_json=examples/ds_z3_offload_config.json precision=bf16",
        "its shape (ZeRO-3, parameters and optimizer on the CPU, bf16) trains in tests/unit/train/test_trainer.py::"
        "test_bf16_with_cpu_offload_trains[z3_offload]; here the example file's dict is built and validated",
        lambda dicts: _offloaded_bf16_zero3(dicts),
    ),
    (
        "data=llava_json data.path=/data/train.json data.image_root=/data/images",
        "llava-format files with images train in tests/unit/train/test_loaders.py (multi-image, text-only, "
        "multi-turn records); here this file's records are indexed and the job planned",
        lambda dicts: len(dicts) == 1,
    ),
    (
        "train.py data.task=motion",
        "tests/unit/train/test_loaders.py trains video records on both tiny families (with the data cache and "
        "without, DPO too); bench/video_data.py --learn measures this command learning (BENCHMARKS.md); here its "
        "clips are drawn and the job planned",
        lambda dicts: len(dicts) == 1,
    ),
    (
        "train.py loss=dpo data.task=colour",
        "tests/e2e/test_preference.py trains the built-in preference task (1,024 pairs, 2 ranks, ZeRO-0 and "
        "ZeRO-3) to a held-out reward accuracy of 0.95, tests/unit/train/test_preference_training.py at 1 rank",
        lambda dicts: len(dicts) == 1,
    ),
    (
        "loss=dpo data=llava_json data.path=/data/prefs.jsonl method=lora loss.reference=adapter",
        "tests/unit/train/test_preference_training.py trains DPO under LoRA with the adapter's base as the "
        "reference; here this preference file's pairs are indexed and the job planned",
        lambda dicts: len(dicts) == 1,
    ),
    (
        "+deepspeed_extra.zero_optimization.stage3_max_reuse_distance=1e9",
        "ZeRO-3 on 1 rank trains in tests/e2e/test_sweep.py (fp32) and test_device_check.py (bf16); here the "
        "extra key reaches the dict",
        lambda dicts: _zero(dicts)["stage"] == 3 and _zero(dicts)["stage3_max_reuse_distance"] == 1e9,
    ),
    (
        "deepspeed=z3 dist.nproc_per_node=2",
        "tests/e2e/test_dist.py trains this job (2 ranks, ZeRO-3) and compares every launcher with it",
        lambda dicts: (
            _zero(dicts)["stage"] == 3
            and dicts[0]["train_batch_size"]
            == 2 * dicts[0]["train_micro_batch_size_per_gpu"] * dicts[0]["gradient_accumulation_steps"]
        ),
    ),
    (
        "-m deepspeed=z0,z2,z3 precision=bf16,fp32",
        "its jobs train in tests/e2e/test_device_check.py (z0, z2, z3 in bf16; z2 in fp32), as the default job "
        "(z0 fp32) and in tests/e2e/test_sweep.py (z3 fp32), which also runs sweeps to their comparison",
        lambda dicts: len(dicts) == 6 and _shapes(dicts) == {(s, p) for s in (0, 2, 3) for p in ("bf16", "fp32")},
    ),
]


def _bash_lines() -> list[tuple[int, str]]:
    """(README line number, command) for every command line of every ```bash block but the first."""
    lines = README.read_text().splitlines()
    commands, in_block, blocks = [], False, 0
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            in_block = line == "```bash" and not in_block
            blocks += in_block
            continue
        if not in_block or blocks == 1:
            continue  # the first block holds the two set-up-and-go commands
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if commands and commands[-1][1].endswith("\\"):
            commands[-1] = (commands[-1][0], commands[-1][1][:-1] + " " + text)
        else:
            commands.append((number, text))
    return [(number, _strip_comment(text)) for number, text in commands]


def _strip_comment(command: str) -> str:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=False)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return shlex.join(list(lexer))


def _python_snippet() -> tuple[int, str]:
    match = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert match, "README.md has no ```python block (the snippet that loads a run's model/)"
    return README.read_text()[: match.start()].count("\n") + 2, match.group(1)


COMMANDS = _bash_lines()


def _with(args: list[str], settings: list[str]) -> list[str]:
    """`args` with `settings` appended, replacing any the command sets itself."""
    keys = {setting.split("=", 1)[0] for setting in settings}
    return [arg for arg in args if arg.split("=", 1)[0] not in keys] + settings


def _run(argv: list[str], env: dict[str, str], where: str, timeout: float = 600) -> str:
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{where} failed (exit {result.returncode}): {shlex.join(argv)}\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def env(work: Path) -> dict[str, str]:
    return {**subprocess_env(work), "HF_HUB_OFFLINE": "1"}  # the real presets' commands never reach the hub


COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 60, 220)}


@pytest.fixture(scope="module")
def data(work: Path) -> Path:
    """A small llava-format data set, `train.json` and its images, for the README's /data/ paths: questions
    about the colours of zero to two images."""
    root = work / "data"
    (root / "images").mkdir(parents=True)
    names = []
    for colour, rgb in COLOURS.items():
        for size in (24, 40):
            names.append(f"{colour}_{size}.png")
            Image.new("RGB", (size, size + 8), rgb).save(root / "images" / names[-1])
    records = []
    for index in range(48):
        images = [names[(index * 5 + k) % len(names)] for k in range(index % 3)]
        question, answer = (
            ("which colours?", " ".join(name.split("_")[0] for name in images))
            if images
            else (
                f"say the number {index % 7}",
                f"number {index % 7}",
            )
        )
        turns = [{"from": "human", "value": "<image>\n" * len(images) + question}, {"from": "gpt", "value": answer}]
        records.append({"id": f"l{index}", "image": images, "conversations": turns})
    (root / "train.json").write_text(json.dumps(records))
    pairs = [  # the same questions as preference pairs (TRL's format): the right colours over a wrong answer
        {
            "prompt": turns[0]["value"],
            "chosen": turns[1]["value"],
            "rejected": "purple",
            "images": [f"images/{name}" for name in record["image"]],
        }
        for record in records
        for turns in [record["conversations"]]
    ]
    (root / "prefs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return root


@pytest.fixture(scope="module")
def base_run(quick_run) -> Path:
    """A short run of the built-in job (the session's): the run directory the README's resume and
    snippet use, read only (the resume continues a copy)."""
    assert (quick_run.run_dir / "model").is_dir() and (quick_run.run_dir / "checkpoints" / "latest").exists()
    return quick_run.run_dir


@pytest.fixture(scope="module")
def state(work: Path) -> dict[str, Path]:
    """The runs some commands make (the sweep, the LoRA run: MAKERS) for the ones that read them (compare,
    export), in this process."""
    return {}


def _substitute(text: str, data: Path) -> str:
    for made_up in ("train.json", "prefs.jsonl", "images"):
        text = text.replace(f"/data/{made_up}", str(data / made_up))
    return text


# What a command planned only draws of the built-in set (a dry run makes it first): its size changes no dict, and
# the dry run of data.task=motion took 19.4 s at the default 4,000 clips, 7.0 s at this size.
PLANNED_BUILT_IN_SET = ["data.n_train=64", "data.n_eval=16"]


def _train_argv(args: list[str], name: str, work: Path, planned: bool) -> list[str]:
    multirun = "-m" in args
    if planned or any(arg in REAL_MODELS for arg in args):
        built_in = not any(arg.startswith("data=") for arg in args)
        args = _with(args, ["dry_run=true", *(PLANNED_BUILT_IN_SET if built_in else [])])
    place = f"hydra.sweep.dir={work / name}" if multirun else f"hydra.run.dir={work / name}"
    if any(arg.startswith("resume=") for arg in args):
        place = None  # a resume runs in the run directory it names
    return [sys.executable, "train.py", *_with(args, TINY + ([place] if place else []))]


def _planned_dicts(directory: Path, multirun: bool) -> list[dict[str, Any]]:
    """The DeepSpeed dicts a dry run (each job of a sweep's) wrote."""
    folders = sorted(path for path in directory.iterdir() if path.name.isdigit()) if multirun else [directory]
    return [json.loads((folder / "ds_config.json").read_text()) for folder in folders]


def _train_command(
    number: int, command: str, work: Path, env: dict[str, str], data: Path, base_run: Path, state: dict[str, Path]
) -> None:
    """Run a README `python train.py ...` line (tiny, planned only or resumed from the session's run) and check
    what it wrote; the runs later commands read go into `state`."""
    where = f"README.md line {number} ({command})"
    name = f"line{number}"
    args = shlex.split(_substitute(command, data))[2:]
    planned = next((entry for entry in PLANNED if entry[0] in command), None)
    if any(arg.startswith("resume=") for arg in args):
        copy = work / f"{name}_resumed"
        shutil.copytree(base_run, copy)
        args = [f"resume={copy}" if arg.startswith("resume=") else arg for arg in args]
        args = _with(args, ["train.max_steps=3"])
        _run([sys.executable, "train.py", *_with(args, TINY[1:])], env, where)
        summary = json.loads((copy / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 3, f"{where}: {summary}"
        return
    train_argv = _train_argv(args, name, work, planned is not None)
    output = _run(train_argv, env, where)
    if "--cfg" in args:
        assert "zero" in output, f"{where}: printed no config"
        return
    if "-m" in args:
        assert (work / name / "compare.md").is_file(), f"{where}: the sweep wrote no comparison"
        state["sweep"] = work / name
    if "dry_run=true" in train_argv:
        dicts = _planned_dicts(work / name, "-m" in args)
        assert dicts, f"{where}: the dry run wrote no ds_config.json"
        if planned is not None:
            _, trained_in, check = planned
            assert check(dicts), f"{where}: planned only ({trained_in}); its dicts: {dicts}"
    elif "-m" not in args:
        summary = json.loads((work / name / "summary.json").read_text())
        assert summary["status"] == "completed", f"{where}: {summary}"
        if "method=lora" in args:
            state["lora"] = work / name


# Runs that later commands read, and the README command that makes each. A command that reads one runs its
# maker first when this process has not: under -n, pytest-xdist may give the two to different workers.
MAKERS = {"lora": "python train.py method=lora", "sweep": "python train.py -m deepspeed=z0,z2,z3 precision=bf16,fp32"}


def _made(key: str, work: Path, env: dict[str, str], data: Path, base_run: Path, state: dict[str, Path]) -> Path:
    if key not in state:
        maker = next(((number, command) for number, command in COMMANDS if command == MAKERS[key]), None)
        assert maker, f"the README no longer has `{MAKERS[key]}`, which makes the {key} run later commands read"
        _train_command(*maker, work, env, data, base_run, state)
    return state[key]


@pytest.mark.parametrize(("number", "command"), COMMANDS, ids=[f"README:{n}" for n, _ in COMMANDS])
def test_readme_command(number, command, work, env, data, base_run, state):
    where = f"README.md line {number} ({command})"
    name = f"line{number}"
    text = _substitute(command, data)
    exception = next((why for fragment, why in EXCEPTIONS if fragment in command), None)
    argv = shlex.split(text)
    assert argv[0] == "python", f"{where}: not a `python ...` command; add it to EXCEPTIONS with a reason"
    if exception:
        assert argv[1] == "train.py", f"{where}: exceptions must be train.py commands (checked with --cfg job)"
        composed = _run([sys.executable, *argv[1:], "--cfg", "job"], env, where, timeout=120)
        assert "zero" in composed, f"{where}: --cfg job printed no config"
        pytest.skip(f"{where}: composed only: {exception}")
    if argv[1] == "train.py":
        if any(state.get(key) == work / name for key in MAKERS):
            return  # a command that reads this run made it first, in this process, and checked it
        _train_command(number, command, work, env, data, base_run, state)
        return
    module = argv[2] if argv[1] == "-m" else None
    if module == "launcher.plan":
        _run([sys.executable, *argv[1:]], env, where)
    elif module == "launcher.prepare":
        output = _run([sys.executable, "-m", module, *argv[3:]], env, where)
        assert "train: " in output and "prepared in" in output, f"{where}: {output[-500:]}"
    elif module == "launcher.compare":
        sweep = _made("sweep", work, env, data, base_run, state)
        args = [str(sweep) if arg == README_SWEEP_DIR else arg for arg in argv[3:]]
        output = _run([sys.executable, "-m", module, *args], env, where)
        assert "compare.md" in output, f"{where}: {output[-500:]}"
    elif module == "launcher.export":
        lora = _made("lora", work, env, data, base_run, state)
        out = work / f"{name}_export"
        args = [str(lora) if arg == "RUN_DIR" else str(out) if arg == "DIR" else arg for arg in argv[3:]]
        _run([sys.executable, "-m", module, *args], env, where)
        assert (out / "config.json").is_file(), f"{where}: no model in {out}"
    elif module == "launcher.infer":
        image = work / "shape.png"
        Image.new("RGB", (32, 32), COLOURS["red"]).save(image)
        args = [str(base_run) if arg == "RUN_DIR" else str(image) if arg == "shape.png" else arg for arg in argv[3:]]
        output = _run([sys.executable, "-m", module, *args], env, where)
        assert output.strip(), f"{where}: no answer"
    elif module == "launcher.tune":
        tiny = [
            "tune.presets=[z0]",
            "tune.precisions=[fp32]",
            "tune.micro_batch_sizes=[16]",
            "tune.gradient_checkpointing=[false]",
            "tune.measure_steps=1",
            f"tune.dir={work / name}",
            "logger=none",
        ]
        _run([sys.executable, "-m", module, *_with(argv[3:], tiny)], env, where)
        assert (work / name / "best.yaml").is_file(), f"{where}: the tuner picked nothing"
    else:
        pytest.fail(f"{where}: this test does not know how to run it; teach it, or add it to EXCEPTIONS")


def test_every_planned_only_entry_names_a_readme_command():
    """An entry whose command left the README would plan nothing: drop it with the command."""
    for fragment, _, _ in PLANNED:
        assert any(fragment in command for _, command in COMMANDS), fragment


def test_readme_python_snippet(work, env, base_run):
    number, code = _python_snippet()
    assert 'model_dir = "outputs/runs/DATE/TIME/model"' in code
    code = code.replace('"outputs/runs/DATE/TIME/model"', repr(str(base_run / "model")))
    script = work / "snippet.py"
    script.write_text(code)
    where = f"README.md line {number} (the ```python snippet)"
    argv = [sys.executable, str(script)]
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{where} failed: {result.stderr[-3000:]}"
    assert result.stdout.endswith("\n"), f"{where}: printed no line: {result.stdout!r}"
