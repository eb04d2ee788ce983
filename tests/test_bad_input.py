"""Bad input beyond the config core, each case run as `python train.py` (the table in docs/errors.md).

Every case must end in one line starting with "error: " that names the key or file and says what to
do, with exit code 2 (a mistake the user can fix; 1 for a failure while training), no traceback,
`summary.json` saying "failed" where the job has a run directory of its own, and nothing that looks
complete: no model/, no complete checkpoint, and no ds_config.json when the job stopped before its
plan was done. A refused resume leaves the run it would have continued exactly as it was.
The config-core cases (rules between groups, batch arithmetic, ...) are in tests/test_cli.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, cpu_only, limit_file_size
from tests.test_models import SIZES

GOOD = {
    "image": "images/ok.png",
    "conversations": [{"from": "human", "value": "<image>\nwhat?"}, {"from": "gpt", "value": "red"}],
}
# Short runs: a case that gets as far as training trains two steps of four samples.
COMMON = [
    "logger=none",
    "train.max_steps=2",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "data.eval_accuracy=false",
]


@dataclass(frozen=True)
class Case:
    """One bad input: the arguments, and a part of the error line (both formatted with `Inputs`)."""

    id: str
    args: tuple[str, ...]
    message: str
    code: int = 2
    planned: bool = False  # stopped after the plan was written (ds_config.json may exist)
    run_dir: str = "new"  # new: {tmp}/run holds a failed summary; none: no run dir can exist; old: {old} unchanged
    cpu_only: bool = False  # refused for want of CUDA: accepted on a GPU machine


CASES = [
    # ------------------------------------------------------------------ data
    Case(
        "data-path-is-a-plain-folder",
        ("data=llava_json", "data.path={data}/images"),
        "{data}/images is a folder, but not one `datasets` saved (no state.json or dataset_dict.json)",
    ),
    Case("data-path-not-set", ("data=llava_json",), "data.path is not set for data=llava_json"),
    Case(
        "data-path-missing",
        ("data=llava_json", "data.path={data}/nowhere.json"),
        "data.path={data}/nowhere.json: no such file or folder",
    ),
    Case(
        "image-zero-bytes",
        ("data=llava_json", "data.path={data}/zero_byte.json"),
        "{data}/zero_byte.json record 1: image file {data}/images/empty.png is empty (0 bytes)",
    ),
    Case(
        "image-undecodable",
        ("data=llava_json", "data.path={data}/not_image.json"),
        "{data}/not_image.json record 1: image file {data}/images/text.png cannot be decoded as an image",
    ),
    Case(
        "image-truncated",
        ("data=llava_json", "data.path={data}/truncated.json"),
        "{data}/truncated.json record 7: cannot decode image {data}/images/cut.png",
        code=2,
        planned=True,
    ),
    Case(
        "image-truncated-all-skipped",
        ("data=llava_json", "data.path={data}/all_truncated.json", "data.on_bad_record=skip"),
        "data: none of the 8 records could be decoded (all skipped under data.on_bad_record=skip)",
        planned=True,
    ),
    Case(
        "image-decompression-bomb",
        ("data=llava_json", "data.path={data}/bomb.json", "data.max_image_pixels=10000"),
        "{data}/bomb.json record 1: image file {data}/images/big.png is 300x300 = 90000 pixels, over "
        "data.max_image_pixels=10000",
    ),
    Case(
        "image-path-leaves-the-root",
        ("data=llava_json", "data.path={data}/escape.json"),
        "{data}/escape.json record 1: image path '../outside.png' leaves the image root {data}",
    ),
    Case(
        "image-markers-do-not-match",
        ("data=llava_json", "data.path={data}/markers.json"),
        "{data}/markers.json record 1: 2 '<image>' marker(s) but 1 image(s)",
    ),
    Case(
        "data-format-does-not-match",
        ("data=llava_json", "data.path={data}/train.json", "data.format=sharegpt"),
        "{data}/train.json record 0: 'messages' must be a non-empty list (sharegpt format)",
    ),
    Case(
        "data-format-unknown-record",
        ("data=llava_json", "data.path={data}/unknown.json"),
        "{data}/unknown.json record 0: not a record of a known format (found 'question', 'answer')",
    ),
    Case(
        "data-path-and-sources",
        ("data=llava_json", "data.path={data}/train.json", "data.sources=[{{path: {data}/train.json}}]"),
        "data.path and data.sources are both set",
    ),
    Case("mixture-without-sources", ("data=mixture",), "data.sources is not set for data=mixture"),
    Case(
        "mixture-weight-negative",
        ("data=mixture", "data.sources=[{{path: {data}/train.json, weight: -1}}]"),
        "data.sources[0].weight=-1.0: a mixture weight must be a positive number",
    ),
    Case(
        "mixture-source-missing",
        ("data=mixture", "data.sources=[{{path: {data}/train.json}}, {{path: {data}/gone.json}}]"),
        "data.sources[1].path={data}/gone.json: no such file or folder",
    ),
    Case(
        "group-by-length-with-a-mixture",
        ("data=mixture", "data.sources=[{{path: {data}/train.json}}]", "data.group_by_length=true"),
        "data.group_by_length=true with data.sources: a mixture deals its draws by weight",
    ),
    Case(
        "group-by-length-without-the-cache",
        ("data.group_by_length=true", "data.cache=false"),
        "data.group_by_length=true needs data.cache=true",
    ),
    Case(
        "max-length-zero",
        ("data.max_length=0",),
        "data.max_length=0 must be a positive number of tokens per sample (text + image tokens), e.g. 2048",
    ),
    Case(
        "max-length-below-one-image",
        ("data.max_length=16",),
        "data.max_length=16 leaves no room beside one image's 16 tokens (tiny_llava at model.image_size=32): "
        "every record with an image would be skipped; raise data.max_length",
    ),
    Case(
        "eval-path-missing",
        ("data=llava_json", "data.path={data}/train.json", "data.eval_path={data}/nowhere.json"),
        "data.eval_path={data}/nowhere.json: no such file",
    ),
    Case(
        "image-root-missing",
        ("data=llava_json", "data.path={data}/train.json", "data.image_root={data}/nowhere"),
        "data.image_root={data}/nowhere: no such directory",
    ),
    Case(
        "data-file-not-utf8",
        ("data=llava_json", "data.path={data}/binary.json"),
        "{data}/binary.json: not UTF-8 text",
    ),
    Case(
        "data-file-is-one-json-object",
        ("data=llava_json", "data.path={data}/object.json"),
        "{data}/object.json: the file is one JSON object (keys 'data'), not records",
    ),
    Case(
        "all-records-bad-with-skip",
        ("data=llava_json", "data.path={data}/all_bad.json", "data.on_bad_record=skip"),
        "{data}/all_bad.json: empty data set (all 5 records are bad and were skipped)",
    ),
    Case(
        "fewer-records-than-a-micro-batch",
        ("data=llava_json", "data.path={data}/two.json"),
        "data: 2 usable training records, fewer than one global micro-batch (4 x 1 ranks)",
    ),
    Case(
        "image-is-a-directory",
        ("data=llava_json", "data.path={data}/image_dir.json"),
        "{data}/image_dir.json record 1: image {data}/images is a directory",
    ),
    Case("num-workers-negative", ("data.num_workers=-1",), "data.num_workers=-1 must lie in [0, "),
    Case("num-workers-huge", ("data.num_workers=500",), "data.num_workers=500 must lie in [0, "),
    Case(
        "image-path-is-a-symlink-loop",
        ("data=llava_json", "data.path={data}/loop.json"),
        "{data}/loop.json record 1: image path {data}/images/loop cannot be read (Too many levels of symbolic links)",
    ),
    Case(
        "image-path-too-long",
        ("data=llava_json", "data.path={data}/long_name.json"),
        "{data}/long_name.json record 1: image path {data}/images/xxxx",
    ),
    # ------------------------------------------------------------------ model
    Case(
        "model-path-with-a-tiny-model",
        ("model.path={models}/good",),
        "model.path={models}/good is given, but model=tiny_llava builds a tiny model from code and would ignore it",
    ),
    Case("tiny-hidden-size-zero", ("model.hidden_size=0",), "model.hidden_size=0 must be a positive multiple of 32"),
    Case("tiny-hidden-size-odd", ("model.hidden_size=3",), "model.hidden_size=3 must be a positive multiple of 32"),
    Case("tiny-no-layers", ("model.num_layers=0",), "model.num_layers=0 must be positive"),
    Case(
        "tiny-image-not-whole-patches",
        ("model.image_size=30",),
        "model.image_size=30 must be a multiple of model.patch_size=8",
    ),
    Case(
        "pixels-range-empty",
        ("model=tiny_qwen2_vl", "model.min_pixels=4096", "model.max_pixels=1024"),
        "model.max_pixels=1024 is below model.min_pixels=4096: raise model.max_pixels or lower model.min_pixels",
    ),
    Case(
        "pixels-not-positive",
        ("model=tiny_qwen2_vl", "model.max_pixels=0"),
        "model.max_pixels=0 must be a positive number of pixels per image",
    ),
    # Stopped by launcher.validate.check_model_choices in entry.check_inputs, before any rank starts.
    Case(
        "pixels-for-llava",
        ("model.max_pixels=4096",),
        "model.max_pixels=4096: only dynamic-resolution models (the Qwen2-VL family) resize images to a pixel count",
    ),
    Case(
        "flash-attention-on-cpu",
        ("model.attn_implementation=flash_attention_2",),
        "model.attn_implementation=flash_attention_2 needs a CUDA device (this job runs on cpu)",
        cpu_only=True,
    ),
    # ------------------------------------------------------------------ knobs that reach DeepSpeed
    Case("lr-infinite", ("train.lr=inf",), "train.lr=inf must be a finite number"),
    Case("betas-out-of-range", ("train.betas=[0.9,1.0]",), "train.betas=[0.9, 1.0] must be two numbers in [0, 1)"),
    Case("dist-timeout-zero", ("dist.timeout_s=0",), "dist.timeout_s=0 must be positive"),
    Case(
        "step-timeout-negative",
        ("dist.step_timeout_s=-5",),
        "dist.step_timeout_s=-5.0 must be a number of seconds, or 0 (or null) for no watchdog",
    ),
    Case("max-image-pixels-zero", ("data.max_image_pixels=0",), "data.max_image_pixels=0 must be positive"),
    Case("wandb-log-every-zero", ("logger.log_every=0",), "logger.log_every=0 must be positive"),
    Case("synthetic-eval-set-empty", ("data.n_eval=0",), "data.n_eval=0 must be positive"),
    Case(
        "optimizer-parameter-unknown",
        ("+deepspeed_extra.optimizer.params.momentum=0.9",),
        "optimizer.params.momentum is not a parameter of the optimizer (type AdamW) (AdamW takes",
    ),
    Case(
        "optimizer-type-unknown",
        ("+deepspeed_extra.optimizer.type=Adamm",),
        "optimizer.type=Adamm is not an optimizer DeepSpeed can build",
    ),
    Case(
        "scheduler-type-unknown",
        ("+deepspeed_extra.scheduler.type=Cosine",),
        "scheduler.type=Cosine is not a scheduler DeepSpeed can build: use one of LRRangeTest",
    ),
    Case(
        "scheduler-parameter-unknown",
        ("+deepspeed_extra.scheduler.params.warmup_steps=3",),
        "scheduler.params.warmup_steps is not a parameter of the scheduler WarmupCosineLR",
    ),
    Case(
        "model-dir-without-config",
        ("model=llava_1_5_7b", "model.path={models}/empty"),
        "model.path={models}/empty: cannot read its config",
    ),
    Case(
        "model-is-text-only",
        ("model=llava_1_5_7b", "model.path={models}/text_only"),
        "model.path={models}/text_only is a llama model (LlamaForCausalLM), not an image-text-to-text model",
    ),
    Case(
        "model-without-weights",
        ("model=llava_1_5_7b", "model.path={models}/no_weights"),
        "model.path={models}/no_weights has a config but no weights",
    ),
    Case(
        "model-weights-corrupt",
        ("model=llava_1_5_7b", "model.path={models}/corrupt_weights"),
        "model.path={models}/corrupt_weights: cannot load its weights",
        planned=True,
    ),
    Case(
        "model-without-processor",
        ("model=llava_1_5_7b", "model.path={models}/no_processor"),
        "model.path={models}/no_processor: cannot load its processor",
        planned=True,
    ),
    # ------------------------------------------------------------------ machine and directories
    Case(
        "more-ranks-than-devices",
        ("dist.nproc_per_node={too_many_ranks}",),
        "dist.nproc_per_node={too_many_ranks} is more than the",
    ),
    Case(
        "master-port-busy",
        ("dist.master_port={busy_port}",),
        "dist.master_port={busy_port} is already in use",
        planned=True,
    ),
    Case(
        "cache-dir-under-a-file",
        ("cache_dir={data}/a_file/cache",),
        "cache_dir={data}/a_file/cache: cannot write there ({data}/a_file is a file, not a directory)",
    ),
    Case(
        "run-dir-under-a-file",
        ("hydra.run.dir={data}/a_file/run",),
        "hydra.run.dir={data}/a_file/run: cannot create it ({data}/a_file is a file, not a directory)",
        run_dir="none",
    ),
    Case(
        "run-dir-in-proc",
        ("hydra.run.dir=/proc/launcher-test/run",),
        "hydra.run.dir=/proc/launcher-test/run: cannot create it (cannot create a directory in /proc",
        run_dir="none",
    ),
    Case(
        "sweep-dir-under-a-file",
        ("-m", "hydra.sweep.dir={data}/a_file/sweep", "dry_run=true"),
        "hydra.sweep.dir={data}/a_file/sweep: cannot create it",
        run_dir="none",
    ),
    # ------------------------------------------------------------------ method and model choices
    Case(
        "lora-targets-match-nothing",
        ("method=lora", "method.target_modules=[qproj]"),
        "method.target_modules=['qproj'] (method.include_vision=False, model.freeze_language=False, "
        "model.freeze_vision=False) matches no module of LlavaForConditionalGeneration",
    ),
    Case(
        "qlora-without-cuda",
        ("method=qlora",),
        "method=qlora cannot run here: 4-bit quantisation (bitsandbytes) needs a CUDA device",
        cpu_only=True,
    ),
    Case(
        "flash-attention-on-cpu",
        ("model.attn_implementation=flash_attention_2",),
        "model.attn_implementation=flash_attention_2 needs a CUDA device",
        cpu_only=True,
    ),
    # ------------------------------------------------------------------ resume
    Case("resume-missing-directory", ("resume={tmp}/nowhere",), "resume={tmp}/nowhere: no such directory"),
    Case("resume-not-a-run", ("resume={data}",), "resume={data}: {data} is not a run directory"),
    Case(
        "resume-run-without-checkpoint",
        ("resume={never_saved}",),
        "resume={never_saved}: no complete checkpoint in {never_saved}/checkpoints",
        run_dir="old",
    ),
    Case(
        "resume-incomplete-checkpoint",
        ("resume={incomplete}",),
        "resume={incomplete}: no complete checkpoint in {incomplete}/checkpoints",
        run_dir="old",
    ),
    Case(
        "resume-other-precision",
        ("resume={old}", "precision=bf16"),
        "cannot resume {old}/checkpoints/step2: the job differs from the one that saved it (precision fp32 -> bf16)",
        run_dir="old",
    ),
    Case(
        "resume-global-batch-not-kept",
        ("resume={old}", "dist.nproc_per_node=2"),
        "the checkpoint's global batch 4 cannot be kept on 2 rank(s) with micro batch 4 (4 is no multiple of "
        "4 x 2): give train.micro_batch_size=1 or 2",
        run_dir="old",
    ),
    Case(
        "resume-global-batch-other",
        ("resume={old}", "dist.nproc_per_node=2", "train.micro_batch_size=2", "train.global_batch_size=8"),
        "train.global_batch_size=8: a resume keeps the checkpoint's global batch (4); leave it out",
        run_dir="old",
    ),
    Case(
        "resume-other-model",
        ("resume={old}", "model=tiny_qwen2_vl"),
        "the job differs from the one that saved it (model.arch tiny_llava -> tiny_qwen2_vl;",
        run_dir="old",
    ),
    Case(
        "resume-other-method",
        ("resume={old}", "method=lora"),
        "the job differs from the one that saved it (method.name full -> lora",
        run_dir="old",
    ),
]


# ---------------------------------------------------------------------------------------------- inputs
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """Records files, good and bad, next to their images."""
    from PIL import Image

    root = tmp_path_factory.mktemp("data")
    (root / "images").mkdir()
    Image.new("RGB", (32, 32), (200, 20, 20)).save(root / "images" / "ok.png")
    files = {
        "train.json": json.dumps([GOOD] * 8),
        "two.json": json.dumps([GOOD] * 2),
        "object.json": json.dumps({"data": [GOOD] * 8}, indent=1),  # records wrapped in an object
        "all_bad.json": json.dumps([{**GOOD, "image": "images/nowhere.png"}] * 5),
        "image_dir.json": json.dumps([GOOD, {**GOOD, "image": "images"}] * 4),
        "a_file": "a regular file where a directory is expected",
    }
    files["loop.json"] = json.dumps([GOOD, {**GOOD, "image": "images/loop"}])
    for name, image in (("zero_byte", "empty"), ("not_image", "text"), ("bomb", "big"), ("escape", "../outside")):
        image = image if image.startswith("..") else f"images/{image}"
        files[f"{name}.json"] = json.dumps([GOOD, {**GOOD, "image": f"{image}.png"}] * 4)
    files["truncated.json"] = json.dumps([GOOD] * 7 + [{**GOOD, "image": "images/cut.png"}])
    files["all_truncated.json"] = json.dumps([{**GOOD, "image": "images/cut.png"}] * 8)
    two_markers = [{"from": "human", "value": "<image><image>what?"}, {"from": "gpt", "value": "red"}]
    files["markers.json"] = json.dumps([GOOD, {**GOOD, "conversations": two_markers}] * 4)
    files["unknown.json"] = json.dumps([{"question": "what?", "answer": "red"}] * 8)
    files["long_name.json"] = json.dumps([GOOD, {**GOOD, "image": "images/" + "x" * 5000}])
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "images" / "loop").symlink_to(root / "images" / "loop")  # a symlink to itself
    (root / "images" / "empty.png").write_bytes(b"")
    (root / "images" / "text.png").write_text("not an image")
    Image.new("RGB", (300, 300)).save(root / "images" / "big.png")
    Image.new("RGB", (64, 64), (20, 200, 20)).save(root / "images" / "cut.png")
    whole = (root / "images" / "cut.png").read_bytes()
    (root / "images" / "cut.png").write_bytes(whole[: len(whole) // 2])  # the header survives, the pixels do not
    (root / "binary.json").write_bytes(b"\xff\xd8\xff\xe0 a JPEG saved as .json")
    return root


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """A tiny image-text-to-text model, broken copies of it, and a text-only model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from launcher.model.tiny import build_tiny_model_dir

    root = tmp_path_factory.mktemp("models")
    vocabulary = ["red circle", "what is in the image?"]
    good = build_tiny_model_dir("tiny_llava", root / "good", vocabulary, seed=0, **SIZES)
    (root / "empty").mkdir()
    shutil.copytree(good, root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()
    shutil.copytree(good, root / "corrupt_weights")
    (root / "corrupt_weights" / "model.safetensors").write_bytes(b"truncated")
    shutil.copytree(good, root / "no_processor")
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json", "chat_template.jinja"):
        (root / "no_processor" / name).unlink(missing_ok=True)
    text_config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1
    )
    LlamaForCausalLM(text_config).save_pretrained(root / "text_only")
    return root


def _environment() -> dict[str, str]:
    return {**os.environ, "VLM_LAUNCHER_CACHE": str(ROOT / "outputs" / "cache"), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A completed two-step run with a checkpoint, to resume with the wrong settings."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = subprocess.run(
        [sys.executable, "train.py", *COMMON, "train.save_every=0", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step2" / "launcher_complete.json").is_file()
    return run_dir


@pytest.fixture
def busy_port():
    """A port something listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _inputs(case: Case, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, object]:
    """The values the case's arguments and message name; fixtures are made only when a case needs them."""
    text = " ".join(case.args) + case.message
    values: dict[str, object] = {"tmp": tmp_path, "too_many_ranks": _usable_cores() + 1}
    if "{data}" in text:
        values["data"] = request.getfixturevalue("data_dir")
    if "{models}" in text:
        values["models"] = request.getfixturevalue("models_dir")
    if "{busy_port}" in text:
        values["busy_port"] = request.getfixturevalue("busy_port")
    if "{old}" in text or "{incomplete}" in text:
        # A copy: a refused resume must leave the run alone, and the copy shows whether it did.
        old = tmp_path / "old"
        shutil.copytree(request.getfixturevalue("finished_run"), old)
        if "{incomplete}" in text:
            (old / "checkpoints" / "step2" / "launcher_complete.json").unlink()
            values["incomplete"] = old
        values["old"] = old
    if "{never_saved}" in text:
        # A run directory as Hydra leaves it for a job that stopped before its first checkpoint.
        never_saved = tmp_path / "never_saved"
        (never_saved / ".hydra").mkdir(parents=True)
        (never_saved / ".hydra" / "overrides.yaml").write_text("- logger=none\n")
        values["never_saved"] = values["old"] = never_saved
    return values


# ---------------------------------------------------------------------------------------------- checks
def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory but the log Hydra appends to and the lock a job takes on it."""
    return {
        str(path.relative_to(run_dir)): path.read_bytes()
        for path in sorted(run_dir.rglob("*"))
        if path.is_file() and path.name not in ("train.log", ".lock")
    }


def assert_one_clear_error(result: subprocess.CompletedProcess[str], message: str, code: int) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == code, output[-3000:]
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, output[-3000:]
    assert message in error_lines[0], error_lines[0]
    assert "Traceback" not in output
    # Said once: no warning that repeats it, no log line that echoes it.
    assert sum(message in line for line in output.splitlines()) == 1, output[-3000:]
    return error_lines[0]


def assert_failed_and_incomplete(run_dir: Path, message: str, *, planned: bool) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and message in summary["error"]
    assert not (run_dir / "model").exists()
    assert not list(run_dir.glob("checkpoints/*/launcher_complete.json"))
    assert not (run_dir / "checkpoints" / "latest").exists()
    if not planned:
        assert not (run_dir / "ds_config.json").exists()
        assert not (run_dir / "job.json").exists()


@pytest.mark.parametrize(
    "case", [pytest.param(case, marks=cpu_only) if case.cpu_only else case for case in CASES], ids=[c.id for c in CASES]
)
def test_bad_input_is_one_clear_error(run_train, request, tmp_path, case):
    values = _inputs(case, request, tmp_path)
    args = [arg.format(**values) for arg in case.args]
    message = case.message.format(**values)
    run_dir = tmp_path / "run"
    before = _files(Path(values["old"])) if case.run_dir == "old" else None
    own_dir = [] if any(arg.startswith("hydra.run.dir=") for arg in args) else [f"hydra.run.dir={run_dir}"]
    result = run_train(*args, *COMMON, *own_dir, timeout=600)
    assert_one_clear_error(result, message, case.code)
    if case.run_dir == "new":
        assert_failed_and_incomplete(run_dir, message, planned=case.planned)
    elif case.run_dir == "old":
        assert _files(Path(values["old"])) == before  # Hydra's files put back, summary untouched
        assert not run_dir.exists()
    else:
        assert not run_dir.exists()


def _train_with_file_limit(args: list[str], env: dict[str, str], limit: int) -> subprocess.CompletedProcess[str]:
    """`python train.py ARGS` whose files may not grow past `limit` bytes (a real write error)."""
    return subprocess.run(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=limit_file_size(limit),
    )


@pytest.mark.slow  # it trains: 10 s on a quiet 2-core machine, 30 s on a busy one
def test_a_failed_checkpoint_write_is_one_line_and_leaves_nothing_that_looks_complete(isolated_env, tmp_path):
    """A real write error while saving: files may grow to 2 MiB, the checkpoint (about 3.5 MiB) cannot.

    Everything written before the save (the cached tiny model: about 1.2 MiB) stays under the limit;
    the data cache (49 MB of pixels) is not used here: its own write failure is the next test."""
    run_dir = tmp_path / "run"
    result = _train_with_file_limit(
        [*COMMON, "train.save_every=0", "data.cache=false", f"hydra.run.dir={run_dir}"], isolated_env, 2 * 2**20
    )
    message = f"cannot write checkpoint {run_dir / 'checkpoints' / 'step2'} ("
    line = assert_one_clear_error(result, message, 1)
    assert "file size limit (ulimit -f) 2 MiB" in line
    assert_failed_and_incomplete(run_dir, message, planned=True)
    assert (run_dir / "checkpoints" / "step2").is_dir()  # the partial files stay, never resumed from


@pytest.mark.slow  # it builds a tiny model and the built-in set first: 10-20 s
def test_a_failed_data_cache_write_is_one_line_and_leaves_no_cache_that_looks_complete(isolated_env, tmp_path):
    """Files may grow to 2 MiB; the data cache of 300 built-in records holds 3.5 MiB of pixels."""
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    args = [*COMMON, "data.n_train=300", "data.n_eval=20", f"cache_dir={cache}", f"hydra.run.dir={run_dir}"]
    result = _train_with_file_limit(args, isolated_env, 2 * 2**20)
    line = assert_one_clear_error(result, f"cannot write the data cache under {cache / 'data_cache'} (", 1)
    assert "data.cache=false" in line
    assert not list((cache / "data_cache").rglob("meta.json"))  # nothing that looks complete
    assert not list((cache / "data_cache").iterdir())  # the partial build is removed


def test_a_new_job_in_a_finished_runs_directory_is_refused_and_leaves_it_as_it_was(run_train, finished_run):
    """Without resume=, a job would append to the old run's metrics and sit next to its checkpoints."""
    before = _files(finished_run)
    result = run_train("logger=none", f"hydra.run.dir={finished_run}", timeout=120)
    line = assert_one_clear_error(result, f"hydra.run.dir={finished_run} already holds a run", 2)
    assert f"continue it with resume={finished_run}" in line
    assert _files(finished_run) == before
