"""Export a run as a standalone Hugging Face directory, checked by reloading it.

    python -m launcher.export RUN_DIR                      # model/ (or the newest checkpoint) -> RUN_DIR/export
    python -m launcher.export RUN_DIR --merge              # LoRA folded into the base -> RUN_DIR/export-merged
    python -m launcher.export RUN_DIR --checkpoint step_00000020 --out /models/mine

The source is the run's final `model/`, or a ZeRO checkpoint of any stage (`--checkpoint TAG`, or the
newest complete one when the run has no model/), consolidated with DeepSpeed's own zero_to_fp32, or
the universal copy a resume on another world size made of one (`--checkpoint universal/TAG`). What
is written loads with plain transformers (`AutoModelForImageTextToText`, `AutoProcessor`), or for an
unmerged LoRA adapter with plain peft on its base (`PeftModel.from_pretrained`). `--merge` folds the
adapters into the base weights and keeps every module trained in full beside them (the projector).

Before it says it succeeded, the export reloads what it wrote the plain way and compares its logits on
a few held-out samples of the run's data with the trained model's: the largest difference must stay
within --tolerance (1e-4). Everything is written to a hidden directory first and renamed at the end, so
a failed export leaves nothing that looks complete. Weights are exported in fp32, the precision the
optimizer kept them in.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.config.schema import Config, OnBadRecord, config_from_yaml
from launcher.core.checkpoints import complete_tags, find_resume_tag, read_marker
from launcher.core.errors import Interrupted, LauncherError, TrainingFailed, one_line
from launcher.core.rundir import UNIVERSAL_DIR, RunDir, directory_problem
from launcher.core.signals import STOP_SIGNALS, handling, name, pause_for_test
from launcher.data.collate import Collator
from launcher.data.formats import BadRecordError
from launcher.data.records import ConversationDataset, read_data
from launcher.data.video import VideoSampling
from launcher.model.loading import load_model_and_processor, set_pixel_limits
from launcher.model.method import apply_method, uses_adapters
from launcher.train import universal
from launcher.train.checkpoint import write_failures_reported

log = logging.getLogger("launcher.export")

DEFAULT_TOLERANCE = 1e-4
DEFAULT_SAMPLES = 8


@dataclass
class Source:
    """What is exported: the trained model (in fp32), where it came from, and how it was trained."""

    model: Any  # a transformers model, or a peft model around one
    processor: Any
    base: str  # the base model directory or hub id (LoRA: what the adapter applies to)
    adapters: bool
    origin: str  # "model/" or "checkpoint step_00000020"


@dataclass
class Exported:
    out: Path
    difference: float  # the largest logit difference between the reloaded export and the trained model
    kind: str  # model | merged model | LoRA adapter
    origin: str


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (holding model/ or checkpoints/)")
    parser.add_argument("--merge", action="store_true", help="fold LoRA adapters into the base weights")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: RUN_DIR/export[-merged])")
    parser.add_argument(
        "--checkpoint", default=None, help="a checkpoint tag (step200: a folder of RUN/checkpoints) or 'latest'"
    )
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="held-out samples compared")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="largest logit difference")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: compare on at least 1 held-out sample")
    if not args.tolerance > 0:
        parser.error(f"--tolerance {args.tolerance}: must be a positive logit difference (1e-4 is the default)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _quiet_libraries()
    try:
        with handling(STOP_SIGNALS, _stopped):  # Ctrl-C: one line, the partial export removed (export's finally)
            done = export(
                args.run_dir,
                out=args.out,
                merge=args.merge,
                checkpoint=args.checkpoint,
                samples=args.samples,
                tolerance=args.tolerance,
            )
    except LauncherError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    print(
        f"exported the {done.kind} of {done.origin} to {done.out}; reloaded, its logits differ from the trained "
        f"model's by at most {done.difference:.2e} (tolerance {args.tolerance:g}) on {args.samples} held-out samples"
    )
    return 0


def _stopped(signum: int, _frame: object) -> None:
    raise Interrupted(f"export stopped by {name(signum)}; nothing was written (run it again)")


def _quiet_libraries() -> None:
    """Per-file progress bars and deprecation notes of the loading libraries drown the one result line."""
    import warnings

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def export(
    run_dir: Path,
    *,
    out: Path | None = None,
    merge: bool = False,
    checkpoint: str | None = None,
    samples: int = DEFAULT_SAMPLES,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Exported:
    """Write the run's model to `out`, reload it and compare its logits with the trained model's."""
    directory = RunDir(Path(run_dir))
    out = Path(out) if out is not None else directory.path / ("export-merged" if merge else "export")
    _check_destination(out)
    cfg = _run_config(directory)
    source = load_source(directory, cfg, checkpoint)
    # The run's image resolution (Qwen2-VL family) goes with its processor: a base's has its own.
    set_pixel_limits(source.processor, min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels)
    batches = held_out_batches(cfg, source.processor, samples)
    reference = logits(source.model, batches)
    model = source.model
    if merge and source.adapters:
        model = model.merge_and_unload()  # ModulesToSaveWrapper gives way to the trained copy
    elif merge:
        log.info("method=full: nothing to merge, exporting the model as it is")
    partial = out.with_name(f".{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with write_failures_reported(out, what="the export"):  # a full disk: one line, nothing left
            partial.mkdir(parents=True)
            model.save_pretrained(partial)
            source.processor.save_pretrained(partial)
        pause_for_test("export")  # the tests' stop signals land here, half of it written (a no-op otherwise)
        reloaded = reload(partial, source.base, adapters=source.adapters and not merge)
        difference = max(float((a - b).abs().max()) for a, b in zip(reference, logits(reloaded, batches), strict=True))
        if not difference <= tolerance:
            raise TrainingFailed(
                f"export of {directory.path} ({source.origin}): the reloaded model's logits differ from the trained "
                f"model's by {difference:.2e} > --tolerance {tolerance:g}; nothing was written"
            )
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    kind = "LoRA adapter" if source.adapters and not merge else "merged model" if source.adapters else "model"
    return Exported(out, difference, kind, source.origin)


def _check_destination(out: Path) -> None:
    """Before anything loads: the export can be written there (a new or empty directory that can be made)."""
    if out.is_symlink():
        raise LauncherError(f"--out {out} is a symbolic link: give the directory itself (the export replaces --out)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LauncherError(f"--out {out} exists and is not empty: give a new directory (or remove that one first)")
    if (problem := directory_problem(out.parent)) is not None:
        raise LauncherError(f"--out {out}: cannot be created ({problem}); give a directory you can write")


def _run_config(directory: RunDir) -> Config:
    if not directory.config.is_file():
        raise LauncherError(
            f"{directory.path} is not a run directory (no .hydra/config.yaml): give the directory train.py wrote"
        )
    return config_from_yaml(directory.config)


# ----------------------------------------------------------------------------- the trained model
def load_source(directory: RunDir, cfg: Config, checkpoint: str | None) -> Source:
    """The trained model in fp32: from model/, or from a checkpoint consolidated by zero_to_fp32."""
    adapters = uses_adapters(cfg.method)
    model_dir = directory.model
    if checkpoint is None and any((model_dir / name).is_file() for name in ("config.json", "adapter_config.json")):
        return _from_model_dir(model_dir, adapters)
    saved = directory.checkpoints.is_dir()
    tag = checkpoint
    if tag in (None, "latest"):
        tag = find_resume_tag(directory, warn=log.warning) if saved else None
    if tag is None:
        raise LauncherError(
            f"{directory.path} holds no model/ and no complete checkpoint to export: export a run that finished, "
            "or one that saved a checkpoint (train.save_every=N)"
        )
    original = tag.removeprefix(f"{UNIVERSAL_DIR}/")  # a universal copy: its original holds the marker
    if Path(original).name != original or original in ("", ".", ".."):
        raise LauncherError(
            f"--checkpoint {tag}: a checkpoint tag is a folder name in {directory.checkpoints} (step200, or "
            f"{UNIVERSAL_DIR}/step200 for a universal copy), not a path"
        )
    complete_copy = tag == original or universal.is_universal(directory.checkpoint(tag))
    if not (complete_copy and directory.marker(original).is_file()):
        complete = [t for _, t in complete_tags(directory)] if saved else []
        raise LauncherError(
            f"--checkpoint {tag}: no complete checkpoint of that name in {directory.checkpoints} "
            f"(complete: {', '.join(complete) or 'none'}; universal copies: {UNIVERSAL_DIR}/TAG)"
        )
    return _from_checkpoint(directory, cfg, tag, adapters)


def _from_model_dir(model_dir: Path, adapters: bool) -> Source:
    """The final model; for LoRA, the adapter on the base it names (the processor is the base's)."""
    if adapters:
        from peft import PeftConfig, PeftModel

        base = PeftConfig.from_pretrained(str(model_dir)).base_model_name_or_path
        model, processor = _load_fp32(base)
        return Source(PeftModel.from_pretrained(model, str(model_dir)).eval(), processor, base, True, "model/")
    model, processor = _load_fp32(str(model_dir))
    return Source(model.eval(), processor, str(model_dir), False, "model/")


def _load_fp32(path: str) -> tuple[Any, Any]:
    import torch

    return load_model_and_processor(path, torch_dtype=torch.float32)


def _from_checkpoint(directory: RunDir, cfg: Config, tag: str, adapters: bool) -> Source:
    """Rebuild the model the run trained (base, freezing, adapters) and load the consolidated weights."""
    marker = read_marker(directory, tag.removeprefix(f"{UNIVERSAL_DIR}/"))
    summary = directory.read_summary()
    base = marker.base_model or (summary.base_model if summary else None)
    if not base:
        raise LauncherError(
            f"checkpoint {directory.checkpoint(tag)} does not name its base model (saved by an older launcher); "
            "export the run's model/ instead"
        )
    model, processor = _load_fp32(base)
    model = apply_method(model, cfg.method, cfg.model)
    if universal.is_universal(directory.checkpoint(tag)):
        # Trained parameters only (frozen ones keep the base's values, as in training).
        trained = {name: param.shape for name, param in model.named_parameters() if param.requires_grad}
        state = universal.full_state_dict(directory.checkpoint(tag), trained)
        parameters = set(trained)
    else:
        try:
            state = consolidated_state_dict(directory, tag)
        except (OSError, RuntimeError, EOFError, KeyError, ValueError) as err:  # torch.load's and zero_to_fp32's
            raise LauncherError(
                f"checkpoint {directory.checkpoint(tag)} cannot be read ({one_line(err, named=True, limit=160)}): "
                "it is damaged, or was removed while exporting; give another --checkpoint (or export model/)"
            ) from err
        parameters = {name for name, _ in model.named_parameters()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name in parameters]
    if missing or unexpected:
        raise LauncherError(
            f"checkpoint {directory.checkpoint(tag)} does not fit the model {base} with method={cfg.method.name} "
            f"({len(missing)} weights missing, e.g. {missing[:1]}; {len(unexpected)} unexpected, e.g. {unexpected[:1]})"
        )
    return Source(model.float().eval(), processor, base, adapters, f"checkpoint {tag}")


def consolidated_state_dict(run_dir: RunDir, tag: str) -> dict[str, Any]:
    """The full fp32 state dict of a checkpoint, whatever its ZeRO stage and world size.

    Stages 1-3 (and bf16 at stage 0, whose optimizer partitions like stage 1): DeepSpeed's
    zero_to_fp32 reassembles the optimizer's fp32 master weights. fp32 at stage 0 keeps no master
    copy: the module's own weights are the fp32 weights."""
    import contextlib
    import io

    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = run_dir.checkpoint(tag)
    if list(tag_dir.glob("*optim_states.pt")):
        # zero_to_fp32 prints its progress and draws progress bars.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(run_dir.checkpoints), tag=tag))
    state = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {name: tensor.float() for name, tensor in state["module"].items()}


# ----------------------------------------------------------------------------- checking what was written
def reload(directory: Path, base: str, *, adapters: bool) -> Any:
    """What a user gets with plain transformers (and plain peft for an adapter) from `directory`."""
    import torch
    from transformers import AutoModelForImageTextToText

    if adapters:
        from peft import PeftModel

        model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
        return PeftModel.from_pretrained(model, str(directory)).eval()
    return AutoModelForImageTextToText.from_pretrained(str(directory), dtype=torch.float32).eval()


def held_out_batches(cfg: Config, processor: Any, samples: int) -> list[dict[str, Any]]:
    """A few samples of the run's held-out split (its training split when it has none), collated."""
    cache = Path(str(cfg.cache_dir)).expanduser().absolute()
    data = dataclasses.replace(cfg.data, on_bad_record=OnBadRecord.skip)
    loaded = read_data(data, cache)
    dataset = ConversationDataset(loaded.eval or loaded.train, VideoSampling.of(cfg.data.video))
    chosen = []
    for index in range(len(dataset)):  # the first `samples` whose images decode
        with contextlib.suppress(BadRecordError):
            chosen.append(dataset[index])
        if len(chosen) == max(1, samples):
            break
    collate = Collator(processor)
    return [collate(chosen[start : start + 4]) for start in range(0, len(chosen), 4)]


def logits(model: Any, batches: list[dict[str, Any]]) -> list[Any]:
    import torch

    with torch.no_grad():
        outputs = []
        for batch in batches:
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
            outputs.append(model(**inputs).logits.float())
        return outputs


if __name__ == "__main__":
    sys.exit(main())
