"""Memory planner (report and CLI): what each DeepSpeed preset needs per device, before anything starts.

    python -m launcher.plan model=llava_1_5_7b dist.nproc_per_node=8 plan.gpu_memory_gb=80
    python -m launcher.plan                      # the built-in tiny model on this machine

Takes the same overrides as train.py. The model is built on the meta device from its config (no
weights are read), its parameters are counted per component with the configured freezing, and every
preset x precision is estimated per device: model states (parameters, gradients, fp32 master
weights, Adam states, as ZeRO partitions and offloads them), the optimizer step's fp32 gradients,
communication buffers and activations. `preflight()` estimates only the job about to run.

Each preset x precision is the job `train.py OVERRIDES deepspeed=PRESET precision=DTYPE` would run:
composed by Hydra and planned by `launcher.job.plan_job`, like any job. The arithmetic lives in
`launcher.memory` (pure), the model's counts and shapes in `launcher.model_stats`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.config.compose import compose, compose_typed
from launcher.config.precision import Device, fastest_precisions
from launcher.config.ranges import check_config
from launcher.config.schema import Config, PlanConfig, typed
from launcher.core.errors import LauncherError, one_line
from launcher.job.checks import detect_device
from launcher.job.planning import plan_job, variant_overrides, world_size_of
from launcher.job.spec import HydraJob, Job
from launcher.model.stats import (
    ModelStats,
    RecordShapes,
    model_dir,
    model_stats,
    pack_length,
    planned_at_max_length,
    planned_from_records,
    sequence,
)
from launcher.plan.data import data_lines, record_shapes
from launcher.plan.memory import (
    PRESETS,
    Estimate,
    GiB,
    Layout,
    Row,
    Target,
    estimate,
    fits,
    layout_from_ds_config,
    planned_bytes,
    preference_terms,
    recommend,
)


# ================================================================================ the machine
def target_device(plan: PlanConfig) -> Target:
    """The device planned for: plan.gpu_memory_gb, else the detected accelerator's memory (a CPU: RAM)."""
    import psutil

    device = detect_device()
    ram = int(psutil.virtual_memory().total)
    cpu_bytes = int(plan.cpu_memory_gb * GiB) if plan.cpu_memory_gb else ram
    if device.kind == "cpu" and plan.gpu_memory_gb:
        # Planning a GPU job from a machine without one: assume a current GPU (bf16 and fp16), and
        # check CPU memory only when plan.cpu_memory_gb says how much that machine has.
        kind, precisions = "cuda", fastest_precisions("cuda")
        cpu_bytes = int(plan.cpu_memory_gb * GiB) if plan.cpu_memory_gb else None
        source = f"plan.gpu_memory_gb={plan.gpu_memory_gb:g}"
    else:
        kind = device.kind
        supported = {"bf16": device.bf16, "fp16": device.fp16, "fp32": True}
        precisions = tuple(p for p in fastest_precisions(kind) if supported[p])  # fastest first (fp32 on a CPU)
        if plan.gpu_memory_gb:
            source = f"plan.gpu_memory_gb={plan.gpu_memory_gb:g}"
        else:
            source = f"detected {device.name or device.kind}" + (" (this machine's RAM)" if kind == "cpu" else "")
    if plan.gpu_memory_gb:
        device_bytes = int(plan.gpu_memory_gb * GiB)
    elif kind == "cpu":
        device_bytes = cpu_bytes or ram
    else:
        from deepspeed.accelerator import get_accelerator

        device_bytes = int(get_accelerator().total_memory())
    if plan.precisions:  # an enum list: the schema refused anything else at compose time
        precisions = tuple(p for p in fastest_precisions(kind) if p in plan.precisions)
    return Target(kind, device_bytes, cpu_bytes, precisions, float(plan.headroom), source)


# ================================================================================ configurations
def variant_spec(cfg: Config, overrides: Sequence[str], preset: str, dtype: str, target: Target, hidden: int) -> Job:
    """The job `train.py OVERRIDES deepspeed=PRESET precision=DTYPE` would run, on the target device."""

    variant_args = variant_overrides(overrides, preset, dtype)
    if "nvme" in PRESETS[preset][1:] and not cfg.offload.nvme_path:
        variant_args.append("offload.nvme_path=/local_nvme")  # only the estimate needs a path: not checked here
    hydra = HydraJob(run_dir=Path("."), overrides=tuple(variant_args))
    device = Device(kind=target.kind, bf16=True, fp16=target.kind != "cpu")
    return plan_job(typed(compose(variant_args)), hydra, device=device, hidden_size=hidden, validate=False)


def plan_rows(
    cfg: Config,
    overrides: Sequence[str],
    stats: ModelStats,
    target: Target,
    *,
    presets: Sequence[str] = tuple(PRESETS),
    precisions: Sequence[str] | None = None,
    shapes: RecordShapes | None = None,
) -> list[Row]:
    """One estimate per preset x precision, for the job's world size, batch and sequence (`shapes`: its
    records', launcher.plan.data.record_shapes)."""
    seq_len, images = sequence(cfg, stats, shapes)
    rows = []
    for preset in presets:
        for dtype in precisions or target.precisions:
            try:
                variant = variant_spec(cfg, overrides, preset, dtype, target, stats.text.hidden)
            except LauncherError as err:
                rows.append(Row(preset, dtype, None, False, one_line(err)))
                continue
            layout = layout_from_ds_config(
                variant.ds_config, world_size=variant.world_size, ranks_per_node=variant.ranks_per_node
            )
            est = estimate(stats, layout, seq_len=seq_len, images=images, **preference_terms(cfg.loss))
            ok, why = fits(est, target)
            rows.append(Row(preset, dtype, est, ok, why))
    return rows


def _sample_source(cfg: Config, shapes: RecordShapes | None) -> str:
    """What the planned sample is, and where its length comes from: the start of the job line's parenthesis."""
    packed = not cfg.plan.seq_len and cfg.data.packing and pack_length(cfg.data) is not None
    if packed:
        budget = "data.pack_length" if cfg.data.pack_length is not None else "data.max_length"
    if planned_from_records(cfg, shapes):
        records = f"the {len(shapes.lengths):,} records of the built data cache"
        if packed:
            return f"packed row ({budget}; the row of the first epoch's plan of {records} with the most images: "
        return f"sample (the longest of {records}; the most images one holds: "
    if packed:
        return f"packed row ({budget}; "
    return f"sample ({'data.max_length; ' if planned_at_max_length(cfg) else ''}"


def deepspeed_reference(stats: ModelStats, layout: Layout) -> tuple[int, int] | None:
    """(GPU, CPU) bytes from DeepSpeed's own estimators, where they apply: ZeRO 2/3, bf16/fp16.

    They assume every parameter trains, mixed precision, 2 P + 18 P / N on the GPU at stage 2
    (16-bit parameters, then 16-bit and fp32 gradients, fp32 master, Adam), and add 4 x largest
    layer at stage 3; the CPU figure includes loading the model (x 1.5 buffer factor).
    """
    if (
        layout.stage not in (2, 3)
        or stats.method != "full"  # adapters on a frozen base: far from the estimators' assumption
        or layout.dtype == "fp32"
        or "nvme" in (layout.offload_optimizer, layout.offload_param)
    ):
        return None
    nodes = -(-layout.world_size // layout.ranks_per_node)
    if layout.stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            stats.total, layout.ranks_per_node, nodes, cpu_offload=layout.offload_optimizer == "cpu"
        )
    else:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            stats.total,
            stats.largest_layer,
            layout.ranks_per_node,
            nodes,
            cpu_offload=layout.offload_optimizer == "cpu",
            cpu_offload_params=layout.offload_param == "cpu",
        )
    return gpu, cpu


# ================================================================================ preflight
def preflight(cfg: Config, spec: Job) -> str | None:
    """One line when the job's configuration is not expected to fit its device, else None.

    Estimates the given DeepSpeed dict only (and, when it does not fit, the presets at the same
    precision, to name the fastest one expected to fit). Problems training would also hit (an
    unreadable model.path) raise LauncherError.
    """
    return preflight_plan(cfg, spec)[0]


def preflight_plan(cfg: Config, spec: Job, *, from_records: bool = True) -> tuple[str | None, int]:
    """preflight()'s line, and the planner's bytes per rank for the job (`planned_bytes`): what the run
    records beside its measured peak (summary.json's planned_memory_bytes). From the records of the job's data
    cache where it is built (`from_records=False`: as if it were not)."""
    stats = model_stats(cfg, path=spec.model_path)  # the job's model, already resolved (None: resolved here)
    target = target_device(cfg.plan)
    model_path = spec.model_path or model_dir(cfg)
    shapes = record_shapes(cfg, model_path) if from_records else None
    est, seq_len = _job_estimate(cfg, spec, stats, shapes)
    planned = planned_bytes(est, target.kind)
    ok, why = fits(est, target)
    if ok:
        return None, planned
    rows = plan_rows(cfg, spec.hydra.overrides, stats, target, precisions=(est.layout.dtype,), shapes=shapes)
    best = recommend(rows, target.kind)
    if best is not None:
        advice = f"expected to fit: {_choice(cfg, best)}"
    else:
        advice = "no preset is expected to fit: lower train.micro_batch_size or data.max_length, or add ranks"
    line = (
        f"memory plan: {est.layout.describe()} {why} (model states {est.states.on_device / GiB:.1f}"
        + (f", reference copy {est.reference / GiB:.1f}" if est.reference else "")
        + f", activations "
        f"{est.activations / GiB:.1f} at micro batch {est.layout.micro_batch} x {seq_len} tokens, buffers "
        f"{(est.step + est.buffers) / GiB:.1f}); usable: {target.usable_device / GiB:.1f} GiB of "
        f"{target.device_bytes / GiB:.1f} ({target.source}, plan.headroom={target.headroom:g}); {advice}; "
        "python -m launcher.plan with the same overrides prints every preset"
        + _before_the_cache(cfg, model_path, shapes, seq_len)
    )
    return line, planned


def _before_the_cache(cfg: Config, model_path: str, shapes: RecordShapes | None, seq_len: int) -> str:
    """What the preflight's line adds when it planned every sample at an assumed length only because the
    job's data cache is not built yet: once it is, the plan reads the records' own (a processor that is a hub
    id is not fetched for a plan, so its records are never read here: nothing to add then)."""
    data, local = cfg.data, str(cfg.model.source) == "tiny" or Path(model_path).expanduser().is_dir()
    if shapes is not None or cfg.plan.seq_len or cfg.plan.text_tokens or not data.cache or data.streaming or not local:
        return ""
    if data.packing and pack_length(data) is not None:  # a row is full either way: its images are what was assumed
        assumed = f"packed rows of {seq_len} tokens holding records of plan.text_tokens' default length"
    elif planned_at_max_length(cfg):
        assumed = f"{seq_len} tokens a sample (data.max_length)"
    else:
        assumed = f"{seq_len} tokens a sample (plan.text_tokens' default and its images' tokens)"
    return (
        f"; the data cache is not built yet, so the plan assumed {assumed}: python -m launcher.prepare with the "
        "same overrides builds it, and the plan then reads the records"
    )


def planned_from_cache(cfg: Config, spec: Job, shapes: RecordShapes) -> int | None:
    """The planner's bytes per rank for the job from the records of the data cache it trains from, once
    that is built: a first run's preflight planned before its cache existed (at data.max_length, or
    plan.text_tokens), and a model whose processor is a hub id is never planned from its records before
    its ranks load it. None when the records do not decide the plan (plan.seq_len or plan.text_tokens set)."""
    if not planned_from_records(cfg, shapes):
        return None
    stats = model_stats(cfg, path=spec.model_path)
    est, _ = _job_estimate(cfg, spec, stats, shapes)
    return planned_bytes(est, target_device(cfg.plan).kind)


def _job_estimate(cfg: Config, spec: Job, stats: ModelStats, shapes: RecordShapes | None) -> tuple[Estimate, int]:
    """The estimate of the job's own DeepSpeed dict, and the tokens per sample it planned."""
    seq_len, images = sequence(cfg, stats, shapes)
    layout = layout_from_ds_config(spec.ds_config, world_size=spec.world_size, ranks_per_node=spec.ranks_per_node)
    return estimate(stats, layout, seq_len=seq_len, images=images, **preference_terms(cfg.loss)), seq_len


# ================================================================================ the report
def _unit(rows: Sequence[Row]) -> tuple[str, int]:
    """GiB, or MiB for tables whose largest figure is under 1 GiB (tiny models)."""
    largest = max((row.estimate.device_total for row in rows if row.estimate), default=0)
    return ("GiB", GiB) if largest >= GiB else ("MiB", 2**20)


def _amount(value: int | None, unit: int) -> str:
    return "-" if value is None else f"{value / unit:.2f}"


def format_table(rows: Sequence[Row], stats: ModelStats, *, markdown: bool = False, reference: bool = True) -> str:
    """The estimates as an aligned text table (or Markdown), one row per preset x precision."""
    _, unit = _unit(rows)
    header = ["preset", "dtype", "model states", "activations", "step+buffers", "device total", "CPU/node", "fits"]
    if reference:
        header.append("DeepSpeed's estimate device/CPU")

    def amount(value: int | None) -> str:
        return _amount(value, unit)

    table = [header]
    for row in rows:
        est = row.estimate
        if est is None:
            table.append([row.preset, row.dtype, "-", "-", "-", "-", "-", f"not valid: {row.why}"] + ([""] * reference))
            continue
        line = [
            row.preset,
            row.dtype,
            amount(est.states.on_device + est.reference),  # a live reference copy's weights with the policy's
            amount(est.activations),
            amount(est.step + est.buffers),
            amount(est.device_total),
            amount(est.cpu_per_node) + (f" (+{amount(est.nvme_per_node)} NVMe)" if est.nvme_per_node else ""),
            "yes" if row.fits else "no",
        ]
        if reference:
            ds_ref = deepspeed_reference(stats, est.layout)
            line.append("-" if ds_ref is None else f"{amount(ds_ref[0])} / {amount(ds_ref[1])}")
        table.append(line)
    if markdown:
        lines = ["| " + " | ".join(cells) + " |" for cells in table]
        lines.insert(1, "|" + "|".join("---" for _ in header) + "|")
        return "\n".join(lines)
    widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table)


def report(cfg: Config, overrides: Sequence[str] = ()) -> str:
    """The planner's whole output for a composed config: model, data, assumptions, table, recommendation."""
    path = model_dir(cfg)
    stats = model_stats(cfg, path=path)
    target = target_device(cfg.plan)
    shapes = record_shapes(cfg, path)
    rows = plan_rows(cfg, overrides, stats, target, shapes=shapes)
    seq_len, images = sequence(cfg, stats, shapes)
    world_size = world_size_of(cfg)
    components = ", ".join(
        f"{name} {count / 1e6:,.1f}M{' (frozen)' if name in stats.frozen else ''}"
        for name, count in stats.components.items()
    )
    micro = next((row.estimate.layout.micro_batch for row in rows if row.estimate), None)
    if target.kind == "cpu":
        cpu = "the same memory (ranks and offloaded states share it)"
    elif target.cpu_bytes is None:
        cpu = "not checked (set plan.cpu_memory_gb)"
    else:
        cpu = f"{target.cpu_bytes / GiB:.1f} GiB"
    lines = [
        f"model {stats.name}: {stats.total / 1e6:,.1f}M parameters ({components}); "
        f"{stats.trainable / 1e6:,.1f}M trainable (method={cfg.method.name})",
        f"job: {world_size} rank(s), {cfg.dist.nproc_per_node} per node; micro batch {micro}; "
        f"{seq_len} tokens per {_sample_source(cfg, shapes)}{images} image(s) x {stats.image_tokens} image tokens)",
        f"device: {target.device_bytes / GiB:.1f} GiB ({target.source}); CPU per node: {cpu}; "
        f"fits = within {1 - target.headroom:.0%} (plan.headroom={target.headroom:g})",
        *data_lines(cfg, path),
        f"{_unit(rows)[0]} per device unless noted; model states = parameters, gradients, fp32 master weights, "
        "Adam states (the part on the device)",
        "",
        format_table(rows, stats, markdown=bool(cfg.plan.markdown)),
        "",
    ]
    best = recommend(rows, target.kind)
    if best is None:
        lines.append(
            "recommendation: nothing is expected to fit; lower train.micro_batch_size or data.max_length, or add ranks"
        )
    else:
        lines.append(
            f"recommendation: {_choice(cfg, best)} (the fastest expected to fit: "
            f"{_amount(best.estimate.device_total, _unit(rows)[1])} {_unit(rows)[0]} per device"
            + (
                "; offload.nvme_path: a fast local disk of yours, where the states are swapped)"
                if _nvme(cfg, best)
                else ")"
            )
        )
    return "\n".join(lines)


def _choice(cfg: Config, best: Row) -> str:
    """The overrides that run the recommended row, with the knob a preset cannot run without (z3_nvme: a
    fast local disk for the swapped states) when the command line does not give it."""
    choice = f"deepspeed={best.preset} precision={best.dtype}"
    return choice + " offload.nvme_path=/local_nvme" if _nvme(cfg, best) else choice


def _nvme(cfg: Config, best: Row) -> bool:
    """The row swaps states to a disk, and the command line names none."""
    return "nvme" in PRESETS[best.preset][1:] and not cfg.offload.nvme_path


def main(argv: Sequence[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    try:
        cfg = compose_typed(overrides)
        check_config(cfg)
        print(report(cfg, overrides))
    except LauncherError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
