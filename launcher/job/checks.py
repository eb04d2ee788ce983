"""Checks at the edge: the device, the inputs a job reads, and DeepSpeed's own validation of the dict.

These need the machine, the file system or heavy imports, so they stay out of the pure builder in
`launcher.config.ds_config` and the ranges in `launcher.config.ranges`. The launcher runs them before any
rank starts (`check_inputs`), so what the ranks would stop on stops the job once, in one line.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from pathlib import Path
from typing import Any

from launcher.config.groups import PARTS, check_schedule, group_specs
from launcher.config.precision import Device
from launcher.config.ranges import usable_cores
from launcher.config.schema import Config, DataConfig, DistConfig, ModelConfig, is_preference
from launcher.config.stages import Stage, stage_config
from launcher.core.errors import LauncherError
from launcher.core.rundir import directory_problem
from launcher.data.estimate import index_cost
from launcher.data.formats import looks_like_hub_id
from launcher.data.records import INDEX_DIR, data_sources, read_data, require_one_global_batch
from launcher.data.stream import stream_files
from launcher.job.spec import Job
from launcher.model.components import base_model
from launcher.model.groups import assign, stage_specs
from launcher.model.kernels import check_kernels
from launcher.model.loading import (
    check_hub_model,
    check_pixel_limits,
    is_hub_id,
    read_config,
    resolve_attn_implementation,
)
from launcher.model.method import apply_method, check_adapter_targets, check_method, component_paths, uses_adapters
from launcher.model.stats import fewest_image_tokens, frozen_meta_model, model_dir, pack_length

log = logging.getLogger("launcher")


def check_inputs(config: Config, job: Job, *, launching: bool) -> None:
    """What the ranks would stop on, checked here so that it stops the job before any rank starts.

    Data files and loader settings, the cache directory, a local model directory's weights, the records
    (indexed here, `check_records`), the method (adapter targets, 4-bit loading), the
    attention kernel and image resolution, and whether this machine has a device for every rank it
    would start (not for a dry run, which may plan a job for a bigger machine)."""
    # The loss first: what a preference loss cannot honour at all (packing, streaming) is the real reason, not
    # the setting that packing or streaming would need next.
    check_loss(config)
    check_data(config.data)
    check_cache_dir(config)
    check_model_files(config.model, launching=launching)
    check_records(config, micro_batch=job.micro_batch, world_size=job.world_size, launching=launching)
    check_method(config, job.device.kind, launching=launching)
    if uses_adapters(config.method):
        check_adapter_targets(frozen_meta_model(config), config)
    check_groups(config, job.ds_config, job.stages)
    check_model_choices(config, job.device.kind, job.precision, launching=launching)
    check_compile(config, job.ds_config)
    check_kernels(config.model, job.device.kind, launching=launching)
    if launching:
        check_local_ranks(config.dist, job.device.kind)


def check_compile(config: Config, ds_config: dict[str, Any]) -> None:
    """model.compile at ZeRO-3 is refused: DeepSpeed gathers each module's weights in hooks it marks as not to
    be compiled, so every compiled MLP and norm breaks into pieces around them (seen on the tiny model here:
    the same losses, and graph breaks at every hook)."""
    if config.model.compile and int(ds_config["zero_optimization"]["stage"]) == 3:
        raise LauncherError(
            "model.compile=true with ZeRO-3: DeepSpeed gathers each layer's partitioned weights in hooks that "
            "torch.compile cannot trace, so the compiled parts break around them; use ZeRO 0-2 "
            "(deepspeed=z2), or model.compile=false"
        )


def check_groups(config: Config, ds_config: dict[str, Any], stages: tuple[Stage, ...] = ()) -> None:
    """Each group of train.groups holds a trainable parameter of the model as the job trains it (on the meta
    device, frozen and adapted), none is held by two, and the scheduler keeps their rates. With train.stages:
    every stage trains something, and each stage's groups hold what trains in it."""
    specs = group_specs(config.train.groups)
    if not specs and not stages:
        return
    check_schedule(specs, ds_config)
    for stage in stages or (None,):
        staged = config if stage is None else stage_config(config, stage)
        model = frozen_meta_model(staged)
        if uses_adapters(config.method):
            model = apply_method(model, config.method, config.model)
        if stage is not None:
            paths = component_paths(base_model(model))
            missing = [part for part in stage.train if part not in paths]
            if missing:
                raise LauncherError(
                    f"train.stages[{stage.index}] ({stage.name}) trains {missing[0]}, which this model has no module "
                    f"for (it has {', '.join(paths) or 'none of them'}): name the parts it has"
                )
        why = [f"model.freeze_{part}=true" for part in PARTS[:3] if getattr(staged.model, f"freeze_{part}")]
        if stage is not None:
            why = [f"train.stages[{stage.index}] trains {' + '.join(stage.train)} only"]
        if uses_adapters(config.method):
            why.append(f"method={config.method.name}")
        assign(model, stage_specs(specs, stage), why_frozen=f" ({', '.join(why)})" if why else "")


def detect_device() -> Device:
    """The accelerator DeepSpeed will train on, and which half-precision types it supports."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    kind = "cuda" if accelerator.device_name() == "cuda" else accelerator.device_name()
    name = ""
    if kind == "cuda":
        import torch

        name = torch.cuda.get_device_name(0)
    return Device(
        kind=kind,
        bf16=bool(accelerator.is_bf16_supported()),
        fp16=bool(accelerator.is_fp16_supported()),
        name=name,
    )


def check_image_text_to_text(config: Any, path: str) -> None:
    """Refuse a model that AutoModelForImageTextToText cannot load (a text-only LLM, a CLIP encoder)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return
    architectures = ", ".join(getattr(config, "architectures", None) or []) or "no architecture given"
    raise LauncherError(
        f"model.path={path} is a {config.model_type} model ({architectures}), not an image-text-to-text model: "
        "give a vision-language model that AutoModelForImageTextToText loads (LLaVA, Qwen2-VL, ...)"
    )


# File names transformers loads weights from (a single file, or the index of a sharded checkpoint).
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_model_files(model_cfg: ModelConfig, *, launching: bool = False) -> None:
    """A local model directory must hold weights, not only a config; a hub id's the ranks fetch, so the hub
    must be reachable or the model in the local hub cache (checked when launching: a dry run plans offline)."""
    if str(model_cfg.source) != "pretrained" or not model_cfg.path:
        return
    path = Path(str(model_cfg.path)).expanduser()
    if launching and not path.exists() and is_hub_id(str(model_cfg.path)):
        if (note := check_hub_model(str(model_cfg.path))) is not None:
            log.warning(note)
        return
    if path.is_dir() and not any((path / name).is_file() for name in WEIGHT_FILES):
        raise LauncherError(
            f"model.path={model_cfg.path} has a config but no weights (model.safetensors or pytorch_model.bin): "
            "copy the complete model directory, or save it with save_pretrained"
        )


def check_model_choices(cfg: Config, device_kind: str, precision: str, *, launching: bool = True) -> str:
    """The model settings that need the machine or the model's config; returns the attention kernel.

    model.attn_implementation must run on this device, with the flash-attn package and in this
    precision (auto resolves here; a dry run, which may plan for another machine, keeps what was
    asked). model.min_pixels / model.max_pixels need a dynamic-resolution model (the Qwen2-VL
    family): the model's config is read when either is set (a tiny model is built into the cache
    for it, as the memory preflight does)."""
    attn = str(cfg.model.attn_implementation)
    if launching:
        attn = resolve_attn_implementation(attn, device_kind=device_kind, precision=precision)
    min_pixels, max_pixels = cfg.model.min_pixels, cfg.model.max_pixels
    if min_pixels is not None or max_pixels is not None:
        config = read_config(model_dir(cfg))
        check_pixel_limits(config, min_pixels=min_pixels, max_pixels=max_pixels, tiny=str(cfg.model.source) == "tiny")
    check_max_length(cfg)
    if cfg.data.packing and str(cfg.model.source) != "tiny":  # the tiny families keep records apart (tested)
        check_packing_model(read_config(str(cfg.model.path)))
    return attn


def check_packing_model(config: Any) -> None:
    """Packed records stay apart only where the language model builds its causal mask with transformers'
    masking utilities, which read restarting position ids as separate sequences (the models marked
    `_supports_attention_backend`; eager, sdpa and flash-attention-2 alike). Older implementations (ALiBi
    models such as MPT, Falcon, BLOOM) would let every record attend to the ones before it in its row."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    text = config.get_text_config()
    name = MODEL_MAPPING_NAMES.get(text.model_type)
    language_model = getattr(transformers, name, None) if isinstance(name, str) else None
    if not getattr(language_model, "_supports_attention_backend", False):
        raise LauncherError(
            f"data.packing=true with a {text.model_type} language model ({name or 'not in transformers'}), whose "
            "attention cannot keep packed records apart (it builds no mask from restarting positions): each "
            "record would attend to the ones before it; use data.group_by_length=true instead"
        )


def check_max_length(cfg: Config) -> None:
    """data.max_length (and a packed row, data.pack_length) must leave room beside one image: below that
    every record with an image is skipped, which training would only find record by record."""
    longest = cfg.data.max_length
    found = fewest_image_tokens(cfg) if longest is not None or cfg.data.packing else None
    if found is None:
        return
    tokens, what = found
    if longest is not None and int(longest) <= tokens:
        raise LauncherError(
            f"data.max_length={longest} leaves no room beside one image's {tokens} tokens ({what}): every "
            f"record with an image would be skipped; raise data.max_length (e.g. {max(2048, 2 * tokens)}), or "
            "null for no limit"
        )
    budget = pack_length(cfg.data) if cfg.data.packing else None
    if budget is not None and budget <= tokens:
        raise LauncherError(
            f"data.pack_length={budget} is no longer than one image's {tokens} tokens ({what}): no record with an "
            f"image fits a row; raise data.pack_length (e.g. {max(4096, 4 * tokens)})"
        )


def check_data(data: DataConfig) -> None:
    """The data files exist and the loader's settings are valid (records are read by the ranks)."""
    if data.group_by_length and not data.cache:
        raise LauncherError(
            "data.group_by_length=true needs data.cache=true: the lengths it sorts by come from the cache"
        )
    if data.group_by_length and data.sources:
        raise LauncherError(
            "data.group_by_length=true with data.sources: a mixture deals its draws by weight, not by length; "
            "use one of them"
        )
    if data.streaming:
        _check_streaming(data)
    if data.packing:
        _check_packing(data)
    if data.synthetic:
        return
    if data.name == "mixture" and not data.sources:  # conf/data/mixture.yaml: the sources are the point
        raise LauncherError(
            f"data.sources is not set for data={data.name}: give the sources, e.g. "
            "'data.sources=[{path: a.json, weight: 3}, {path: b.parquet, weight: 1}]'"
        )
    sources = list(data.sources or [])
    path = data.path
    if sources and path:
        raise LauncherError("data.path and data.sources are both set: give one data set (data.path) or a mixture")
    if not sources and not path:
        raise LauncherError(
            f"data.path is not set for data={data.name}: give the training file, `datasets` folder or hub id"
        )
    paths = [(f"data.sources[{i}].path", source.path) for i, source in enumerate(sources)] or [("data.path", path)]
    if data.streaming:  # a folder, a glob or a URL of shard files: listed by check_records
        paths = []
    for key, value in [*paths, ("data.eval_path", data.eval_path)]:
        if value and not Path(str(value)).expanduser().exists() and not looks_like_hub_id(str(value)):
            raise LauncherError(f"{key}={value}: no such file or folder (nor a hub id like org/name)")
    for index, source in enumerate(sources):
        if not math.isfinite(source.weight) or source.weight <= 0:
            raise LauncherError(
                f"data.sources[{index}].weight={source.weight}: a mixture weight must be a positive number"
            )
    roots = [data.image_root, *(source.image_root for source in sources)]
    for root in filter(None, roots):
        if not Path(str(root)).expanduser().is_dir():
            raise LauncherError(f"data.image_root={root}: no such directory")


def check_loss(cfg: Config) -> None:
    """A preference loss (loss=dpo|ipo): its knobs, and the one-line refusals of what it cannot honour."""
    loss, data, method = cfg.loss, cfg.data, str(cfg.method.name)
    preference = is_preference(loss.name)
    if bool(data.pairs) != preference:
        raise LauncherError(
            f"data.pairs={data.pairs} with loss={loss.name}: the loss decides whether records are preference pairs; "
            "leave data.pairs unset"
        )
    if not preference:
        return
    if not (math.isfinite(loss.beta) and loss.beta > 0):
        raise LauncherError(f"loss.beta={loss.beta}: it must be a positive number (DPO's usual: 0.1)")
    if not 0 <= loss.label_smoothing < 0.5:
        raise LauncherError(f"loss.label_smoothing={loss.label_smoothing}: it must be at least 0 and below 0.5")
    if loss.label_smoothing and str(loss.name) != "dpo":
        raise LauncherError(f"loss.label_smoothing={loss.label_smoothing} with loss={loss.name}: only dpo smooths")
    refused = [
        (bool(data.packing), "data.packing=true", "a pair's two answers are scored row by row: set data.packing=false"),
        (bool(data.streaming), "data.streaming=true", "pairs are read and cached first: set data.streaming=false"),
        (bool(data.sources), "data.sources (a mixture)", "train one preference set (data.path)"),
        (bool(cfg.train.stages), "train.stages", "the reference is the model a run starts from: train the stages "
         "as runs of their own"),
    ]  # fmt: skip
    for present, what, fix in refused:
        if present:
            raise LauncherError(f"loss={loss.name} with {what}: {fix}")
    reference = str(loss.reference)
    if reference == "adapter" and method not in ("lora", "qlora"):
        raise LauncherError(
            f"loss.reference=adapter needs method=lora or qlora (the base under the adapter is the reference); "
            f"with method={method} use loss.reference=precomputed or live"
        )
    if reference == "live" and method == "qlora":
        raise LauncherError(
            "loss.reference=live with method=qlora would load the 4-bit base twice: use loss.reference=adapter "
            "(the base under the adapter) or precomputed"
        )
    if reference == "precomputed" and not data.cache:
        raise LauncherError(
            "loss.reference=precomputed with data.cache=false: the log-probs are kept by the data cache's key; set "
            "data.cache=true, or loss.reference=live (or adapter under LoRA)"
        )
    if loss.reference_path and reference != "precomputed":
        raise LauncherError(f"loss.reference_path is set with loss.reference={reference}: it names a precomputed one")


def _check_streaming(data: DataConfig) -> None:
    refused = [
        (bool(data.sources), "data.sources (a mixture)", "stream one data.path"),
        (bool(data.group_by_length), "data.group_by_length=true", "set data.group_by_length=false"),
    ]
    for present, what, fix in refused:
        if present:
            raise LauncherError(f"data.streaming=true with {what}: a stream reads one set in file order; {fix}")


def _check_packing(data: DataConfig) -> None:
    """data.packing needs the cached lengths, one way of ordering, and a budget that holds any record."""
    refused = [
        (not data.cache, "data.cache=false", "packing plans rows from the cached lengths: set data.cache=true"),
        (bool(data.group_by_length), "data.group_by_length=true", "packing already fills rows: use one of them"),
        (bool(data.streaming), "data.streaming=true", "packing plans rows from the cached lengths: use one of them"),
        (bool(data.sources), "data.sources (a mixture)", "a mixture deals its draws by weight: use one of them"),
    ]
    for present, what, fix in refused:
        if present:
            raise LauncherError(f"data.packing=true with {what}: {fix}")
    budget, longest = pack_length(data), data.max_length
    if budget is None:
        raise LauncherError(
            "data.packing=true needs a row length: set data.pack_length (tokens per packed row), or data.max_length"
        )
    if longest is not None and budget < int(longest):
        raise LauncherError(
            f"data.pack_length={budget} is below data.max_length={longest}: a record may be {longest} tokens; "
            f"raise data.pack_length (e.g. {max(int(longest), 4096)}) or lower data.max_length"
        )


def check_cache_dir(cfg: Config) -> None:
    """The built-in data set and the models built from code (tiny, random) are generated into cache_dir,
    which must be writable."""
    if not (cfg.data.synthetic or str(cfg.model.source) in ("tiny", "random")):
        return
    problem = directory_problem(Path(str(cfg.cache_dir)))
    if problem:
        raise LauncherError(
            f"cache_dir={cfg.cache_dir}: cannot write there ({problem}); set cache_dir= (or VLM_LAUNCHER_CACHE) "
            "to a directory you can write"
        )


def check_records(cfg: Config, *, micro_batch: int, world_size: int, launching: bool) -> None:
    """Read the records here, before any rank starts, so that a bad record is reported once, as an error;
    the first read indexes each data file (launcher.data.index), which the ranks then open instead of
    each parsing the file. For a tiny model always (its vocabulary comes from the data); otherwise when
    the ranks start on this machine (local, torchrun), whose cache_dir they share: under DeepSpeed's
    hostfile or SLURM the data may be where only the ranks see it, and they index it themselves."""
    if cfg.data.synthetic:
        return
    if cfg.data.streaming:  # nothing is read before training: the shard files are listed, once
        stream_files(str(cfg.data.path))
        return
    built = str(cfg.model.source) in ("tiny", "random")  # its tokenizer is trained on the data's words
    if not built and not (launching and cfg.dist.launcher in ("local", "torchrun")):
        return
    cache = Path(str(cfg.cache_dir)).expanduser().absolute()
    announce_indexing(cfg, cache)
    records = read_data(cfg.data, cache).train
    require_one_global_batch(len(records), micro_batch, world_size)


def announce_indexing(cfg: Config, cache: Path) -> None:
    """Before a data file is indexed: how many records, how large, how long (launcher.data.estimate)."""
    sources, eval_source = data_sources(cfg.data, cache)
    for source in [*sources, *([eval_source] if eval_source else [])]:
        cost = index_cost(source.path, source.options, cache / INDEX_DIR)
        if cost is not None and not cost.built:
            log.info("data: %s", cost.line())


def check_local_ranks(dist: DistConfig, device_kind: str) -> None:
    """Ranks started on this machine must each have a device: a GPU each, or on a CPU at least a core each.

    Only for launchers that start the ranks here (local, torchrun); DeepSpeed's hostfile and SLURM
    place ranks on other machines."""
    if dist.launcher not in ("local", "torchrun"):
        return
    nproc = int(dist.nproc_per_node)
    if device_kind == "cuda":
        import torch

        have, what = torch.cuda.device_count(), "GPU(s) visible on this machine (one rank per GPU)"
    elif device_kind == "cpu":
        have, what = usable_cores(), "CPU core(s) this process may use (at least one per rank)"
    else:
        return
    if nproc > have:
        raise LauncherError(
            f"dist.nproc_per_node={nproc} is more than the {have} {what}: use dist.nproc_per_node={have} or fewer"
        )


def check_paths(ds: dict[str, Any]) -> None:
    """NVMe offload needs a directory that exists and that this user can write."""
    zero = ds.get("zero_optimization") or {}
    for which in ("offload_param", "offload_optimizer"):
        block = zero.get(which) or {}
        if block.get("device") != "nvme":
            continue
        path = Path(str(block.get("nvme_path")))
        if not path.is_dir():
            raise LauncherError(
                f"offload.nvme_path={path} does not exist: create it on a local NVMe disk or point to one"
            )
        if not os.access(path, os.W_OK):
            raise LauncherError(f"offload.nvme_path={path} is not writable: pick a directory you can write")


def check_optimizer_and_scheduler(ds: dict[str, Any]) -> None:
    """The optimizer and scheduler blocks name classes DeepSpeed can build, with parameters they accept.

    DeepSpeed's config validation passes both blocks through unread; a wrong type or parameter only
    fails inside `deepspeed.initialize` on every rank, with a traceback. The classes are the ones
    DeepSpeed 0.19 picks (engine._configure_basic_optimizer, _scheduler_from_config); nothing is built."""
    import inspect

    optimizer = ds.get("optimizer")
    if optimizer:
        cls, params = _optimizer_class(optimizer, ds)
        if cls is not None:
            _check_signature(cls, params, f"optimizer (type {optimizer.get('type')})", "optimizer.params")
    scheduler = ds.get("scheduler")
    if scheduler:
        import torch
        from deepspeed.runtime import lr_schedules

        name = str(scheduler.get("type"))
        cls = getattr(lr_schedules, name, None) or getattr(torch.optim.lr_scheduler, name, None)
        if not inspect.isclass(cls):
            raise LauncherError(
                f"scheduler.type={name} is not a scheduler DeepSpeed can build: use one of "
                f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)} (or a torch.optim.lr_scheduler class)"
            )
        _check_signature(cls, dict(scheduler.get("params") or {}), f"scheduler {name}", "scheduler.params")


def _optimizer_class(optimizer: dict[str, Any], ds: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The class DeepSpeed will construct for this optimizer block, and the parameters it gets."""
    import inspect

    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    name = str(optimizer.get("type"))
    params = dict(optimizer.get("params") or {})
    offloaded = ((ds.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if name.lower() in ("adam", "adamw"):
        params.pop("adam_w_mode", None)
        params.pop("fp32_optimizer_states", None)
        if params.pop("torch_adam", False):
            return torch.optim.AdamW, params
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        return (DeepSpeedCPUAdam if offloaded else FusedAdam), params
    if name.lower() == "adagrad":
        return (None if offloaded else torch.optim.Adagrad), params
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return None, params  # LAMB, Lion, MuP, Muon: their own ops or packages; DeepSpeed checks them
    cls = getattr(torch.optim, name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise LauncherError(
            f"optimizer.type={name} is not an optimizer DeepSpeed can build: use AdamW, Adam, Adagrad, Lamb, Lion "
            "(or a torch.optim class, spelt as torch spells it, e.g. SGD)"
        )
    return cls, params


def _check_signature(cls: Any, params: dict[str, Any], what: str, prefix: str) -> None:
    import inspect

    signature = inspect.signature(cls.__init__)
    accepted = set(list(signature.parameters)[2:])  # after self and the optimizer / the parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise LauncherError(
            f"{prefix}.{unknown[0]} is not a parameter of the {what} ({cls.__name__} takes "
            f"{', '.join(sorted(accepted))}): fix or remove it"
        )
    missing = [
        name
        for name, parameter in list(signature.parameters.items())[2:]
        if parameter.default is inspect.Parameter.empty
        and parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        and name not in params
    ]
    if missing:
        raise LauncherError(f"{prefix}.{missing[0]} is required by the {what}: set it")


# DeepSpeed's pydantic model names, and the part of the dict each one parses.
_SECTION_OF_MODEL = {
    "DeepSpeedZeroConfig": "zero_optimization",
    "DeepSpeedZeroOffloadParamConfig": "zero_optimization.offload_param",
    "DeepSpeedZeroOffloadOptimizerConfig": "zero_optimization.offload_optimizer",
    "DeepSpeedBF16Config": "bf16",
    "DeepSpeedFP16Config": "fp16",
}


def validate_with_deepspeed(ds: dict[str, Any]) -> None:
    """Run DeepSpeed's own config parsing (its pydantic models) on the dict, without a process group.

    DeepSpeed assumes world size 1 when no process group exists, so it is shown the per-rank view
    of the batch; the world-size arithmetic was already checked by the builder.
    """
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    probe = copy.deepcopy(ds)
    probe["train_batch_size"] = probe["train_micro_batch_size_per_gpu"] * probe["gradient_accumulation_steps"]
    try:
        DeepSpeedConfig(probe)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        section = _SECTION_OF_MODEL.get(err.title)
        key = f"{section}.{where}" if section else where
        raise LauncherError(f"DeepSpeed rejects {key}: {first['msg']}") from None
    except (AssertionError, ValueError, KeyError, TypeError) as err:
        raise LauncherError(f"DeepSpeed rejects the config: {err}") from None
    check_monitor_packages(ds)


# DeepSpeed's monitors and the package each imports on the ranks once the model has loaded.
MONITOR_PACKAGES = {"comet": "comet_ml", "tensorboard": "tensorboard", "wandb": "wandb"}


def check_monitor_packages(ds: dict[str, Any]) -> None:
    """An enabled DeepSpeed monitor whose package is not installed: refused here, not by every rank after
    the model has loaded."""
    import importlib.util

    for block, package in MONITOR_PACKAGES.items():
        if (ds.get(block) or {}).get("enabled") and importlib.util.find_spec(package) is None:
            raise LauncherError(
                f"DeepSpeed's {block} monitor is enabled ({block}.enabled=true) but the {package} package is not "
                f"installed: pip install {package.replace('_', '-')}, or set {block}.enabled=false"
            )
