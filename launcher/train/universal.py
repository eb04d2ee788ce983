"""DeepSpeed universal checkpoints: a run's checkpoint, converted for another world size or ZeRO stage.

    checkpoints/step40/                  the original, as the saving job cut it (never modified)
    checkpoints/universal/step40/        its universal copy: zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt,
                                         zero/optimizer_state.pt, the model-states files, universal_complete.json

The launcher converts once, before any rank starts (`ensure_universal`): ZeRO-1/2/3 checkpoints with
DeepSpeed's own `ds_to_universal`, ZeRO-0 ones here (DeepSpeed's converter reads only ZeRO files:
deepspeedai/DeepSpeed#7200). The copy is then normalised so that every target stage reads it:
DeepSpeed writes one layout per source stage, and its ZeRO-1/2 and ZeRO-3 loaders each read only their
own (ZeRO-3 writes bare tensors and no step, ZeRO-1/2 no optimizer step for ZeRO-3, each its own
model-states file name). The conversion writes into a hidden folder and renames it when complete, so a
kill part-way leaves the original usable and the next resume converts again.

The ranks load it with DeepSpeed's `load_universal` at ZeRO-1/2/3 (`launcher.checkpoint.load`); at
ZeRO-0, which DeepSpeed's universal loader does not serve, `load_into_stage0` copies the full values.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from launcher.core.rundir import RunDir

DONE_FILE = "universal_complete.json"
# Test hook: the launcher kills itself (SIGKILL) half-way through a conversion.
KILL_CONVERSION_ENV = "LAUNCHER_TEST_KILL_CONVERSION"
_STAGE0_STATES = "mp_rank_00_model_states.pt"
_ZERO3_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_MOMENTS = ("exp_avg", "exp_avg_sq")


def is_universal(folder: Path) -> bool:
    return (folder / DONE_FILE).is_file()


def ensure_universal(run_dir: RunDir, tag: str, saved_stage: int, param_names: list[str] | None) -> Path:
    """The universal copy of checkpoint `tag` (made now unless a complete one exists); returns its folder.

    `param_names`: the trainable parameters in the order the optimizer holds them (recorded at save;
    what a ZeRO-0 checkpoint's optimizer state is indexed by)."""
    out = run_dir.inside(run_dir.universal(tag))
    if is_universal(out):
        return out
    partial = out.parent / f".{tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a conversion that was killed
    partial.mkdir(parents=True)
    started = time.time()
    if saved_stage == 0:
        if not param_names:
            raise ValueError(
                f"{run_dir.checkpoint(tag)}: no parameter names recorded; cannot convert a ZeRO-0 checkpoint"
            )
        _from_stage0(run_dir.checkpoint(tag), partial, param_names)
    else:
        _from_zero(run_dir.checkpoint(tag), partial)
    if os.environ.get(KILL_CONVERSION_ENV):
        os.kill(os.getpid(), signal.SIGKILL)
    _normalise(partial)
    done = {"source": str(run_dir.checkpoint(tag)), "source_zero_stage": saved_stage, "seconds": time.time() - started}
    (partial / DONE_FILE).write_text(json.dumps(done))
    shutil.rmtree(out, ignore_errors=True)  # a folder there without the completion file (made by hand?)
    os.replace(partial, out)
    (out.parent / "latest_universal").unlink(missing_ok=True)  # DeepSpeed's pointer: the tag is always given
    return out


def _from_zero(source: Path, out: Path) -> None:
    """DeepSpeed's converter, in this process (one worker each: no fork of a process holding torch threads)."""
    import contextlib
    import io

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    args = SimpleNamespace(
        input_folder=str(source),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # our models carry no universal_checkpoint_info (only AutoTP/EP ones do)
    )
    # Its progress lines and bars, per parameter; an error still raises.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal(args)


def _from_stage0(source: Path, out: Path, names: list[str]) -> None:
    """A ZeRO-0 checkpoint (one file: the module and the plain torch optimizer's state) in universal layout."""
    import torch

    states = torch.load(source / _STAGE0_STATES, map_location="cpu", weights_only=False)
    module, optimizer = states["module"], states["optimizer"]
    if not isinstance(optimizer, dict) or "state" not in optimizer or "fp32_groups_flat" in optimizer:
        raise ValueError(
            f"{source}: the ZeRO-0 optimizer state is not a plain torch optimizer's (fp32); only fp32 ZeRO-0 "
            "checkpoints convert"
        )
    indices = [index for group in optimizer["param_groups"] for index in group["params"]]
    if len(indices) != len(names):
        raise ValueError(f"{source}: {len(indices)} optimized tensors, but {len(names)} parameter names recorded")
    step = None
    for index, name in zip(indices, names, strict=True):
        state = optimizer["state"].get(index, {})
        tensors = {"fp32": module[name], **{key: state[key] for key in _MOMENTS if key in state}}
        if set(tensors) != {"fp32", *_MOMENTS}:
            raise ValueError(f"{source}: no Adam moments for {name}: only Adam-style optimizer states convert")
        folder = out / "zero" / name
        folder.mkdir(parents=True)
        for key, tensor in tensors.items():
            torch.save({"param": tensor.detach().float().cpu().clone(), "cat_dim": 0}, folder / f"{key}.pt")
        step = _as_step(state["step"])
        torch.save(step, folder / "step.pt")
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer["param_groups"]]
    import deepspeed

    torch.save({"param_groups": groups, "ds_version": deepspeed.__version__}, out / "zero" / "optimizer_state.pt")
    meta = {key: value for key, value in states.items() if key not in ("module", "optimizer")}
    torch.save({**meta, "module": {}, "optimizer": None}, out / _STAGE0_STATES)


def _as_step(value: Any) -> Any:
    import torch

    return value.detach().float().cpu().clone() if torch.is_tensor(value) else torch.tensor(float(value))


def _normalise(out: Path) -> None:
    """One layout every target stage reads: dicts with "param" (ZeRO-3 writes bare tensors), a step
    per parameter (ZeRO-3 writes none), the optimizer's step and DeepSpeed's version in
    optimizer_state.pt (ZeRO-1/2 leave out the one, ZeRO-3 the other), both model-states names."""
    import deepspeed
    import torch

    zero = out / "zero"
    optim_path = zero / "optimizer_state.pt"
    optim = torch.load(optim_path, map_location="cpu", weights_only=False)
    inner = optim.get("optimizer_state_dict") or {}
    step = next((state["step"] for state in (inner.get("state") or {}).values() if "step" in state), None)
    folders = [path for path in sorted(zero.iterdir()) if path.is_dir()]
    if step is None:  # from ZeRO-1/2: each parameter's step.pt
        step = next((torch.load(f / "step.pt", weights_only=False) for f in folders if (f / "step.pt").is_file()), None)
    for folder in folders:
        if not (folder / "exp_avg.pt").is_file():
            # A frozen parameter or buffer (DeepSpeed writes every module tensor): no target reads it.
            shutil.rmtree(folder)
            continue
        for key in ("fp32", *_MOMENTS):
            value = torch.load(folder / f"{key}.pt", map_location="cpu", weights_only=False)
            if not isinstance(value, dict):
                torch.save({"param": value, "cat_dim": 0}, folder / f"{key}.pt")
        if not (folder / "step.pt").is_file() and step is not None:
            torch.save(_as_step(step), folder / "step.pt")
    groups = optim.get("param_groups") or inner.get("param_groups") or []
    optim["param_groups"] = groups
    optim.setdefault("ds_version", deepspeed.__version__)
    if step is not None:
        optim["optimizer_state_dict"] = {"state": {0: {"step": _as_step(step)}}, "param_groups": groups}
    torch.save(optim, optim_path)
    names = [_STAGE0_STATES, _ZERO3_STATES]
    present = [name for name in names if (out / name).is_file()]
    if not present:
        raise ValueError(f"{out}: no model-states file was converted")
    for name in names:
        if not (out / name).is_file():
            shutil.copy2(out / present[0], out / name)
    for extra in out.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"):
        if extra.name != _ZERO3_STATES:
            extra.unlink()  # every ZeRO-3 rank's copy; a target reads rank 0's


# ----------------------------------------------------------------------------- reading it
def read_full(folder: Path, name: str, key: str) -> Any:
    """One parameter's full fp32 value or Adam moment, flat (its shape is the model's)."""
    import torch

    value = torch.load(folder / "zero" / name / f"{key}.pt", map_location="cpu", weights_only=False)
    return (value["param"] if isinstance(value, dict) else value).reshape(-1)


def load_into_stage0(engine: Any, folder: Path) -> None:
    """Fill a ZeRO-0 (fp32) engine from a universal folder: weights, Adam moments and step, the
    scheduler and DeepSpeed's counters."""
    import torch

    states = torch.load(folder / _STAGE0_STATES, map_location="cpu", weights_only=False)
    optim = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    optimizer = engine.optimizer
    names = {param: name for name, param in engine.module.named_parameters()}
    state, groups, index = {}, [], 0
    with torch.no_grad():
        for number, group in enumerate(optimizer.param_groups):
            ids = []
            for param in group["params"]:
                name = names[param]
                param.copy_(read_full(folder, name, "fp32").view_as(param).to(param.dtype))
                step = torch.load(folder / "zero" / name / "step.pt", weights_only=False)
                state[index] = {"step": _as_step(step)}
                for key in _MOMENTS:
                    state[index][key] = read_full(folder, name, key).view_as(param).to(param.device)
                ids.append(index)
                index += 1
            saved = optim["param_groups"][min(number, len(optim["param_groups"]) - 1)]
            groups.append({**{key: value for key, value in saved.items() if key != "params"}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    engine.global_steps = int(states.get("global_steps", 0))
    engine.global_samples = int(states.get("global_samples", 0))
    engine.skipped_steps = int(states.get("skipped_steps", 0))


def full_state_dict(folder: Path, shapes: dict[str, Any]) -> dict[str, Any]:
    """The trained parameters' full fp32 values by name (for an export), shaped as `shapes` says."""
    return {name: read_full(folder, name, "fp32").view(shape).clone() for name, shape in shapes.items()}
