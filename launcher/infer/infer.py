"""`python -m launcher.infer MODEL [QUESTION] [--image FILE]`: ask a trained model, without a script.

    python -m launcher.infer outputs/runs/DAY/TIME --image shape.png "what shape is it?"
    python -m launcher.infer outputs/runs/DAY/TIME --image shape.png        # questions from stdin, one a line

MODEL is a run directory (its model/), a model directory (a full model, or a LoRA run's adapters on the base
they name) or a hub id. The question goes through the model's own chat template, with the image before it;
the answer is greedy (--max-new-tokens, default 64), one line per question on stdout. Bad input (no model,
no image file) is one `error:` line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable, Sequence
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


def answer(model: Any, processor: Any, question: str, image: Any | None, *, max_new_tokens: int) -> str:
    """The model's greedy answer to `question` about `image` (a PIL image, or None: text only)."""
    import torch

    from launcher.data.collate import _render

    content = ([{"type": "image"}] if image is not None else []) + [{"type": "text", "text": question}]
    prompt = _render(processor, [{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[[image]] if image is not None else None, return_tensors="pt")
    device = next(model.parameters()).device
    inputs = {k: v.to(device, torch.float32 if v.is_floating_point() else None) for k, v in inputs.items()}
    with torch.no_grad():
        generated = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id
        )
    return processor.tokenizer.decode(generated[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def read_image(path: Path) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise LauncherError(f"--image {path}: no such file") from None
    except (UnidentifiedImageError, OSError) as err:
        raise LauncherError(f"--image {path}: not an image this launcher can read ({one_line(err)})") from None


def main(argv: Sequence[str] | None = None, questions: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.infer", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a run directory, a model directory or a hub id")
    parser.add_argument("question", nargs="?", help="the question (none: one per line from stdin)")
    parser.add_argument("--image", type=Path, default=None, help="the image the questions are about")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_intermixed_args(argv)  # the question before or after --image
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens}: must be 1 or more")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" bars between the answers
    try:
        image = read_image(args.image) if args.image is not None else None
        model, processor = load_trained(args.model)
        asked = [args.question] if args.question else (questions if questions is not None else sys.stdin)
        for question in asked:
            if question.strip():
                print(answer(model, processor, question.strip(), image, max_new_tokens=args.max_new_tokens), flush=True)
    except LauncherError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    return 0
