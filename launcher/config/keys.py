"""The keys a command line may set, and the one line a key the launcher does not read gets.

Hydra refuses `train.learning_rate=1e-4` (not in the schema) with advice to append it with `+`; with the
`+` it composed, the schema dropped it, and the run trained at the default rate (issue 44). Here a key the
launcher does not read is refused either way, naming this launcher's key where the user typed another
tool's name (the HF Trainer's, LLaMA-Factory's, ms-swift's) or a near miss. Pure: no Hydra, no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from launcher.config.schema import Config

# What users of the HF Trainer, LLaMA-Factory and ms-swift type -> this launcher's key (or choice).
ALIASES: dict[str, str] = {
    "learning_rate": "train.lr",
    "per_device_train_batch_size": "train.micro_batch_size",
    "train_batch_size": "train.global_batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "num_train_epochs": "train.epochs",
    "max_grad_norm": "train.grad_clip",
    "adam_beta1": "train.betas",
    "adam_beta2": "train.betas",
    "adam_epsilon": "train.eps",
    "lr_scheduler_type": "train.min_lr_ratio (the schedule is cosine with warm-up)",
    "save_steps": "train.save_every",
    "eval_steps": "train.eval_every",
    "logging_steps": "train.log_every",
    "save_total_limit": "train.keep_checkpoints",
    "cutoff_len": "data.max_length",
    "model_max_length": "data.max_length",
    "max_seq_length": "data.max_length",
    "max_len": "data.max_length",
    "lora_rank": "method.r",
    "lora_r": "method.r",
    "lora_alpha": "method.alpha",
    "lora_dropout": "method.dropout",
    "lora_target": "method.target_modules",
    "target_modules": "method.target_modules",
    "model_name_or_path": "model.path",
    "model_id_or_path": "model.path",
    "dataset": "data.path",
    "dataset_dir": "data.image_root",
    "image_folder": "data.image_root",
    "data_path": "data.path",
    "output_dir": "hydra.run.dir",
    "bf16": "precision=bf16",
    "fp16": "precision=fp16",
    "report_to": "logger=wandb or logger=none",
    "resume_from_checkpoint": "resume=RUN_DIR",
    "freeze_vision_tower": "model.freeze_vision",
    "freeze_vit": "model.freeze_vision",
    "image_max_pixels": "model.max_pixels",
    "image_min_pixels": "model.min_pixels",
    "pref_beta": "loss.beta",
    "stage": "loss=sft|dpo|ipo (and method=full|lora|qlora)",
    "finetuning_type": "method=full|lora|qlora",
    "train_type": "method=full|lora|qlora",
}
# Nodes whose keys are the user's own (parameter groups, stages, DeepSpeed's extra keys) or Hydra's.
_OPEN = ("hydra",)


def schema_keys(node: type = Config, prefix: str = "") -> Iterator[tuple[str, bool]]:
    """Every dotted key of the schema, and whether its value is open (a dict or Any: keys of the user's)."""
    hints = typing.get_type_hints(node)
    for field in dataclasses.fields(node):
        key, kind = prefix + field.name, hints[field.name]
        if dataclasses.is_dataclass(kind):
            yield key, False
            yield from schema_keys(kind, key + ".")
        else:
            yield key, kind is Any or typing.get_origin(kind) is dict


def unknown_keys(config: Mapping[str, Any]) -> list[str]:
    """The dotted keys of a composed config (a DictConfig or a dict) that the schema does not have."""
    known = dict(schema_keys())
    found: list[str] = []

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for name in node:
            key = prefix + str(name)
            if key in _OPEN or known.get(key) is True:
                continue
            if key not in known:
                found.append(key)
            elif isinstance(value := node[name], Mapping):
                walk(value, key + ".")

    walk(config, "")
    return found


def hint(key: str) -> str:
    """What the user probably meant by `key` (a dotted key the launcher does not read), or ''."""
    key = key.lstrip("+~")
    last = key.rsplit(".", 1)[-1]
    if last in ALIASES:
        return f"did you mean {ALIASES[last]}? ({last} is another tool's name for it)"
    close = difflib.get_close_matches(key, [k for k, _ in schema_keys()], n=1, cutoff=0.75)
    if close:
        return f"did you mean {close[0]}?"
    by_last = [k for k, _ in schema_keys() if k.rsplit(".", 1)[-1] == last]
    if by_last:
        return f"did you mean {by_last[0]}?"
    return ""


def refusal(keys: list[str]) -> str:
    """The one line for keys a command line added that the launcher does not read."""
    first = keys[0]
    advice = hint(first)
    more = f" (and {', '.join(keys[1:])})" if len(keys) > 1 else ""
    return (
        f"{first}{more}: the launcher reads no such key, so it would be ignored"
        + (f"; {advice}" if advice else "")
        + "; python train.py --cfg job lists every key"
    )
