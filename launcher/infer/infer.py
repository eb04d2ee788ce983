"""`python -m launcher.infer MODEL [QUESTION] [--image FILE]`: ask a trained model, without a script.

    python -m launcher.infer outputs/runs/DAY/TIME --image shape.png "what shape is it?"
    python -m launcher.infer outputs/runs/DAY/TIME --image shape.png        # questions from stdin, one a line
    python -m launcher.infer outputs/runs/DAY/TIME --checkpoint step200 --image shape.png "what shape?"
    python -m launcher.infer outputs/runs/DAY/TIME --batch questions.json   # answers in questions.answers.jsonl
    python -m launcher.infer outputs/runs/DAY/TIME --sample --temperature 0.7 --top-p 0.9 --seed 1 "..."

MODEL is a run directory (its model/, or with --checkpoint one of its checkpoints, consolidated as
launcher.export does), a model directory (a full model, or a LoRA run's adapters on the base they name) or
a hub id. The question goes through the model's own chat template, with the image before it; the answer is
greedy (or sampled: --sample, from --seed), up to --max-new-tokens (default 64), one line per question on
stdout. --batch FILE: a JSON list (or JSON lines) of {"question": ..., "image": path relative to FILE's
folder, optional}; the answers go to FILE's name with .answers.jsonl, one {"question", "image", "answer"}
each, written whole or not at all. Bad input (no model, no image file, a malformed batch) is one `error:`
line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.core.errors import LauncherError, one_line

log = logging.getLogger("launcher")


def load_trained(path: str) -> tuple[Any, Any]:
    """(model, processor) in fp32 for generation: a run directory's model/, a model directory, a LoRA run's
    adapters on their base (the processor is the base's), or a hub id."""
    import torch

    from launcher.model.loading import load_model_and_processor

    local = Path(path).expanduser()
    if (local / "model").is_dir() and not (local / "config.json").is_file():
        local = local / "model"  # a run directory
    if (local / "adapter_config.json").is_file():
        from peft import PeftConfig, PeftModel

        base = PeftConfig.from_pretrained(str(local)).base_model_name_or_path
        model, processor = load_model_and_processor(base, torch_dtype=torch.float32)
        return PeftModel.from_pretrained(model, str(local)).eval(), processor
    if not local.exists() and path.count("/") != 1:
        raise LauncherError(f"{path}: no such run or model directory (nor a hub id like org/name)")
    model, processor = load_model_and_processor(str(local) if local.exists() else path, torch_dtype=torch.float32)
    return model.eval(), processor


@dataclass(frozen=True)
class Decoding:
    """How an answer is drawn: greedily (the default), or sampled with a temperature and a nucleus."""

    max_new_tokens: int = 64
    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0

    def generate_kwargs(self) -> dict[str, Any]:
        if not self.sample:
            return {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        return {
            "max_new_tokens": self.max_new_tokens,
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }


def answer(model: Any, processor: Any, question: str, image: Any | None, decoding: Decoding = Decoding()) -> str:
    """The model's answer to `question` about `image` (a PIL image, or None: text only), drawn as `decoding` says."""
    import torch

    from launcher.data.collate import _render

    content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": question}]
    prompt = _render(processor, [{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[[image]] if image is not None else None, return_tensors="pt")
    device = next(model.parameters()).device
    inputs = {k: v.to(device, torch.float32 if v.is_floating_point() else None) for k, v in inputs.items()}
    with torch.no_grad():
        pad = processor.tokenizer.pad_token_id
        generated = model.generate(**inputs, **decoding.generate_kwargs(), pad_token_id=pad)
    return processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def read_image(path: Path, what: str = "--image") -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise LauncherError(f"{what} {path}: no such file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise LauncherError(f"{what} {path}: not an image this launcher can read ({one_line(err)})") from None


def load_checkpoint(run: str, tag: str) -> tuple[Any, Any]:
    """(model, processor) of checkpoint `tag` of run directory `run`, consolidated as launcher.export reads it."""
    from launcher.core.rundir import RunDir
    from launcher.export.export import _run_config, load_source

    directory = RunDir(Path(run).expanduser())
    source = load_source(directory, _run_config(directory), tag)
    return source.model.eval(), source.processor


def read_batch(path: Path) -> list[dict[str, Any]]:
    """The questions of a --batch file: [{"question", "image" (a path, or None)}], images relative to its folder."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise LauncherError(f"--batch {path}: no such file") from None
    try:
        items = (
            json.loads(text)
            if text.lstrip().startswith("[")
            else [json.loads(line) for line in text.splitlines() if line.strip()]
        )
    except ValueError as err:
        raise LauncherError(f"--batch {path}: not JSON or JSON lines ({one_line(err)})") from None
    batch = []
    for number, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("question"), str) or not item["question"].strip():
            raise LauncherError(f'--batch {path} item {number}: needs a "question" (text), and may name an "image"')
        image = item.get("image")
        batch.append({"question": item["question"].strip(), "image": None if image is None else str(image)})
    return batch


def answer_batch(model: Any, processor: Any, path: Path, decoding: Decoding) -> Path:
    """Answer every question of the --batch file `path`; the answers' file beside it (written whole, renamed
    into place), returned."""
    from launcher.core.json_files import write_text_atomic

    rows = []
    for number, item in enumerate(read_batch(path)):
        image_path = None if item["image"] is None else path.parent / item["image"]
        image = None if image_path is None else read_image(image_path, f"--batch {path} item {number}: image")
        reply = answer(model, processor, item["question"], image, decoding)
        rows.append(json.dumps({**item, "answer": reply}))
    out = path.with_name(f"{path.name.removesuffix(path.suffix)}.answers.jsonl")
    write_text_atomic(out, "".join(f"{row}\n" for row in rows))
    return out


def main(
    argv: Sequence[str] | None = None, questions: Iterable[str] | None = None, prog: str = "python -m launcher.infer"
) -> int:
    """The command line (`python -m launcher.infer`, or `launcher.chat`: `prog`)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run directory, a model directory or a hub id")
    parser.add_argument("question", nargs="?", help="the question (none: one per line from stdin)")
    parser.add_argument("--image", type=Path, default=None, help="the image the questions are about")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--checkpoint", default=None, help="a checkpoint tag of the run (step200, latest) instead of model/"
    )
    parser.add_argument("--batch", type=Path, default=None, help="a JSON file of questions; answers written beside it")
    parser.add_argument("--sample", action="store_true", help="sample the answers instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=1.0, help="with --sample")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --sample: the nucleus")
    parser.add_argument("--seed", type=int, default=0, help="with --sample: the same seed draws the same answers")
    args = parser.parse_intermixed_args(argv)  # the question before or after --image
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens}: must be 1 or more")
    if args.temperature <= 0 or not 0 < args.top_p <= 1:
        parser.error(
            f"--temperature {args.temperature} --top-p {args.top_p}: need a temperature > 0 and 0 < top-p <= 1"
        )
    if args.batch is not None and (args.question or args.image):
        parser.error("--batch FILE names its questions and images: give no question or --image with it")
    decoding = Decoding(args.max_new_tokens, args.sample, args.temperature, args.top_p)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" bars between the answers
    try:
        image = read_image(args.image) if args.image is not None else None
        if args.batch is not None:
            read_batch(args.batch)  # a malformed batch is refused before the model loads
        model, processor = (
            load_trained(args.model) if args.checkpoint is None else load_checkpoint(args.model, args.checkpoint)
        )
        if args.sample:
            import torch

            torch.manual_seed(args.seed)
        if args.batch is not None:
            print(f"answers: {answer_batch(model, processor, args.batch, decoding)}", flush=True)
            return 0
        asked = [args.question] if args.question else (questions if questions is not None else sys.stdin)
        for question in asked:
            if question.strip():
                reply = answer(model, processor, question.strip(), image, decoding)
                print(reply, flush=True)
    except LauncherError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    return 0
