"""Autotuner: measure the configurations that may fit, pick the fastest that does, show the trade-off.

    python -m launcher.tune model.hidden_size=512 dist.nproc_per_node=2 tune.memory_gb=1.2
    python -m launcher.tune tune.presets=[z0,z2,z3] tune.micro_batch_sizes=[4,8,16] tune.precisions=[fp32]
    python -m launcher.tune ... tune.prune=false tune.early_skip=false   # exhaustive: measure every candidate

Takes train.py's overrides (the job to tune) and `tune.*` (the search, docs/tune.md). The space is
ZeRO preset (stage and offload) x precision x micro batch size (gradient accumulation adjusted so
the global batch stays the job's) x gradient checkpointing (x attention implementation, when
`tune.attn_implementations` lists several; x batching, padded, grouped by length or packed per row
length, when `tune.batching` lists them; x kernels, torch's or liger's, when `tune.kernels` lists them).
Candidates are compared by real (non-padding) tokens/s.
Each candidate is planned first; one predicted above the memory budget by more than `tune.margin` is
pruned. The rest run one at a time, each as `python train.py OVERRIDES CANDIDATE` in a child process
(same data order, same seed) for
`tune.warmup_steps` + `tune.measure_steps` steps, and are stopped once measured. A rank above the
budget (a CPU: its resident set size, polled; a GPU: CUDA out of memory too) ends its candidate as
"does not fit"; a crash is recorded with its one-line error; first losses that differ from the
reference candidate's mark it "wrong". The tune directory gets tune.md/tune.csv (sorted by speed),
tune.png (real tokens/s against peak memory, Pareto front marked), experiment/best.yaml (with
best.yaml beside it) for `python train.py hydra.searchpath=[file://TUNE_DIR] experiment=best`,
and, with logger=wandb, one W&B run per candidate in one group plus a report run with a Table.

Why a program of its own rather than `train.py -m +experiment=autotune`: a Hydra sweep launches a
fixed list of jobs, while the tuner decides what to run from what it has measured (pruning with
calibrated predictions, stopping dominated candidates) and owns its children's memory budget.

The decisions (space, prediction, pruning, dominance, loss check, Pareto front, pick, reports) are
pure functions below; running children, polling their memory and logging are at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from launcher.config.compose import compose
from launcher.config.ranges import check_config
from launcher.config.schema import TRAINABLE, Config, plain, typed
from launcher.core import credentials
from launcher.core.errors import Interrupted, LauncherError, error_line, one_line
from launcher.core.overrides import override_key
from launcher.core.rundir import RunDir
from launcher.core.signals import STOP_SIGNALS, handling, name
from launcher.job.checks import check_data
from launcher.job.planning import plan_job, training_length
from launcher.job.spec import HydraJob, Job
from launcher.launch.base import TRAIN_SCRIPT
from launcher.model.kernels import check_kernels
from launcher.model.stats import RecordShapes, heaviest_stage, model_dir, model_stats, pack_length, sequence
from launcher.plan.memory import PRESETS, Target, estimate, layout_from_ds_config, planned_bytes, preference_terms
from launcher.plan.report import target_device
from launcher.tracking.naming import has_credentials, resolve_mode
from launcher.tracking.wandb_run import WandbRun
from launcher.tune.decide import (
    GiB,
    MiB,
    Result,
    contenders,
    loss_mismatches,
    merge_rerun,
    noise_lines,
    pick,
    planner_lines,
    prune_reason,
    skip_reason,
)
from launcher.tune.report import CSV_COLUMNS, Tuning, describe, table_rows, write_outputs, write_plot
from launcher.tune.runner import own_cpu_s, run_candidate
from launcher.tune.space import base_overrides, default_micro_batch_sizes, search_space

# ================================================================================ the whole tuning
_STATS: dict[str, Any] = {}


def planned_memory(
    candidate_cfg: Config, job: Job, target: Target, shapes: RecordShapes | None = None
) -> tuple[int, dict[str, int]]:
    """The planner's bytes per rank for a candidate's job, and its components (on a CPU the offloaded
    states share the rank's memory: they count). `shapes`: the records' tokens and images (the data cache
    the tuner prepared), else the planner's assumptions (data.max_length)."""
    key = json.dumps([plain(candidate_cfg.model), plain(candidate_cfg.method)], sort_keys=True, default=str)
    if key not in _STATS:  # building the meta model takes a moment; candidates share a few
        _STATS[key] = model_stats(candidate_cfg)
    stats = _STATS[key]
    seq_len, images = sequence(candidate_cfg, stats, shapes)
    layout = layout_from_ds_config(job.ds_config, world_size=job.world_size, ranks_per_node=job.ranks_per_node)
    est = estimate(stats, layout, seq_len=seq_len, images=images, **preference_terms(candidate_cfg.loss))
    total = planned_bytes(est, target.kind)
    components = {
        "model states": total - est.activations - est.step - est.buffers,  # with what a CPU keeps for them
        "activations": est.activations,
        "step+buffers": est.step + est.buffers,
    }
    return total, components


def tune(
    overrides: Sequence[str], *, echo: Callable[[str], None] = print, written: Callable[[Path], None] = lambda _: None
) -> Tuning:
    """Plan, prune, measure and report; returns the tuning (its pick: `pick(t.results)`). `written` is told the
    tuning's directory once its tune.md exists (kept up to date from then on)."""
    cfg = typed(compose(overrides))
    check_config(cfg, tuner=True)
    t = _tuning(cfg, overrides, lambda: _prepared_shapes(cfg, echo))
    echo(t.space_line)
    write_outputs(t)
    written(t.directory)
    tc = cfg.tune
    for index, result in enumerate(t.results, start=1):
        where = f"[{index}/{len(t.results)}]"
        if result.status != "not run":
            echo(f"{where} {result.name}: {result.status}: {result.note}")
            continue
        reason, status = None, "pruned"
        if tc.prune:
            reason = prune_reason(result.candidate, result.planned, t.results, t.budget, float(tc.margin))
        if reason is None and tc.early_skip:
            reason, status = skip_reason(result.candidate, t.results), "skipped"
        if reason is not None:
            result.status, result.note = status, reason
            echo(f"{where} {result.name}: {status}: {reason}")
        else:
            run_candidate(t, result, tc)
            wrong = loss_mismatches(t.results, float(tc.loss_tolerance), float(tc.low_precision_loss_tolerance))
            if result.name in wrong and result.status == "fits":
                result.status, result.note = "wrong", wrong[result.name]
            echo(f"{where} {describe(result)}")
        write_outputs(t)
    confirm(t, tc, echo)
    t.wall_s = round(time.time() - t.started, 1)
    t.cpu_s = round(sum(r.cpu_s or 0 for r in t.results) + own_cpu_s(), 1)
    best = pick(t.results)
    if best is not None:
        write_outputs(t)
        t.best_check = check_best(t, best)
    write_outputs(t)
    return t


def confirm(t: Tuning, tc: Any, echo: Callable[[str], None]) -> None:
    """Measure the fastest candidates again, in turn (A, B, C, A, B, C, ...), none stopped as dominated:
    each becomes the median of its runs, and tune.md says whether the pick stands clear of the next."""
    top = contenders(t.results, int(tc.confirm_top))
    if int(tc.confirm_runs) < 1 or len(top) < 2:
        return
    echo(
        f"confirm: {', '.join(r.name for r in top)} run {int(tc.confirm_runs)} more time(s) each, in turn "
        "(tune.confirm_runs, tune.confirm_top): one run on a busy machine can mislead"
    )
    measuring = dataclasses.replace(tc, early_skip=False)
    for number in range(2, int(tc.confirm_runs) + 2):
        for result in top:
            if result.status not in ("fits", "dominated"):  # a rerun that did not fit ends its candidate
                continue
            rerun = Result(result.candidate, planned=result.planned, components=result.components)
            run_candidate(t, rerun, measuring, run_name=f"{result.name}-run{number}")
            merge_rerun(result, rerun)
            echo(f"[confirm {number}] {describe(rerun)}")
            write_outputs(t)
    for line in noise_lines(t.results):
        echo(f"confirm: {line}")


def _prepared_shapes(cfg: Config, echo: Callable[[str], None]) -> RecordShapes | None:
    """The job's data prepared as its candidates would find it (`python -m launcher.prepare`: the record index
    and the data cache, built once here rather than by the first candidate), and the tokens and images of
    its records read from the cache it built or found: what the candidates are planned by. None without a
    data cache (data.cache=false, streaming): then they are planned at data.max_length."""
    if not cfg.data.cache or cfg.data.streaming:
        return None
    from launcher.data.cache import Part
    from launcher.job.data import prepare
    from launcher.model.loading import load_processor
    from launcher.plan.data import cache_shapes

    started = time.perf_counter()
    _, caches = prepare(cfg, Part())
    info = caches["train"]
    # The processor prepare() used (a hub id's too: fetched there, then from the hub's own cache)
    processor = load_processor(model_dir(cfg), min_pixels=cfg.model.min_pixels, max_pixels=cfg.model.max_pixels)
    shapes = cache_shapes(info.path, processor)
    echo(
        f"tune: data cache {'built' if info.built else 'found'} ({info.records:,} train records, "
        f"{time.perf_counter() - started:.1f} s): candidates are planned from their lengths (the longest "
        f"{int(shapes.lengths.max()):,} tokens, the mean {float(shapes.lengths.mean()):,.0f})"
    )
    return shapes


def _tuning(
    cfg: Config, overrides: Sequence[str], shapes_of: Callable[[], RecordShapes | None] = lambda: None
) -> Tuning:
    """The tuning of the job `overrides` describes: its space, its budget, each candidate planned (from its
    records' tokens and images when `shapes_of` gives them: called once the space is known to be sound, so a
    refused setting costs no data preparation)."""
    tc = cfg.tune
    tunes_attention = bool(tc.attn_implementations)
    batchings = _batchings(cfg)
    # The job as given (its own batch sizes) sets the global batch every candidate keeps.
    job = plan_job(cfg, HydraJob(run_dir=Path("."), overrides=tuple(overrides)), validate=False)
    world_size, global_batch = job.world_size, job.global_batch
    target = target_device(cfg.plan)
    presets = [str(p) for p in (tc.presets or [p for p in PRESETS if p != "z3_nvme"])]
    precisions = [str(p) for p in (tc.precisions or target.precisions)]
    if "fp16" in precisions and target.kind == "cpu":
        precisions.remove("fp16")  # refused on a CPU (train.py says so); not a candidate
    micros = [int(m) for m in (tc.micro_batch_sizes or default_micro_batch_sizes(job.micro_batch))]
    attentions: list[str | None] = [str(a) for a in tc.attn_implementations] if tunes_attention else [None]
    checkpointing = [bool(b) for b in tc.gradient_checkpointing]
    kernels = _kernels(cfg, job.device.kind)
    candidates, left_out = search_space(
        presets,
        precisions,
        micros,
        checkpointing,
        attentions,
        global_batch=global_batch,
        world_size=world_size,
        batchings=batchings,
        kernels=kernels,
    )
    if not candidates:
        raise LauncherError(
            f"tune: no candidate: {'; '.join(left_out) or 'an empty list in tune.*'}; give tune.micro_batch_sizes that "
            f"divide {global_batch // world_size} (the global batch {global_batch} over {world_size} rank(s))"
        )
    if tc.memory_gb is not None:
        budget, source = int(float(tc.memory_gb) * GiB), f"tune.memory_gb={tc.memory_gb:g}"
    else:
        per_rank = target.usable_device // (job.ranks_per_node if target.kind == "cpu" else 1)
        budget, source = per_rank, f"the planner's usable memory ({target.source}, plan.headroom={target.headroom:g})"
    directory = Path(tc.dir or time.strftime("outputs/tune/%Y-%m-%d/%H-%M-%S")).expanduser()
    if (directory / "tune.md").exists():
        raise LauncherError(f"tune.dir={directory} already holds a tuning (tune.md): choose a new directory")
    base = base_overrides(
        overrides,
        tunes_attention=tunes_attention,
        tunes_batching=bool(tc.batching),
        tunes_pack_length=bool(tc.pack_lengths),
        tunes_kernels=bool(tc.kernels),
    )
    t = Tuning(
        directory, base, global_batch, world_size, budget, source, left_out=left_out, device_kind=job.device.kind
    )
    shapes = shapes_of()
    t.results = [_planned(base, candidate, global_batch, target, shapes) for candidate in candidates]
    heaviest = heaviest_stage(cfg)
    if heaviest is not None:
        t.trial_overrides = [
            "train.stages=null",
            *(f"model.freeze_{part}={str(part not in heaviest).lower()}" for part in TRAINABLE),
        ]
    # Candidates run without W&B and preflight; the pick's best.yaml runs the job as the user gave it.
    t.best_extra = [o for o in overrides if override_key(o).split(".")[0] in ("logger", "preflight")]
    t.space_line = (
        f"tune: {len(candidates)} candidates ({len(presets)} presets x {len(precisions)} precisions x "
        f"{len({c.micro for c in candidates})} micro batch sizes x {len(checkpointing)} checkpointing"
        + (f" x {len(attentions)} attention" if tunes_attention else "")
        + (f" x {len(batchings)} batching" if tc.batching else "")
        + (f" x {len(kernels)} kernels" if tc.kernels else "")
        + f"), global batch {global_batch} on {world_size} rank(s); budget {budget / MiB:.0f} MiB per rank ({source}); "
        f"writing {directory}"
    )
    return t


def _kernels(cfg: Config, device_kind: str) -> list[str | None]:
    """tune.kernels as the candidates' model.kernels ([None]: the job's own), refused in one line before anything
    runs where one cannot run on this machine (liger: CUDA, the package, not beside model.compile)."""
    kinds = [str(kind) for kind in dict.fromkeys(cfg.tune.kernels or [])]
    for kind in kinds:
        try:
            check_kernels(SimpleNamespace(kernels=kind, compile=cfg.model.compile), device_kind, launching=True)
        except LauncherError as error:
            raise LauncherError(f"tune.kernels=[{','.join(kinds)}]: {error}") from None
    return list(kinds) or [None]


def _batchings(cfg: Config) -> list[tuple[str | None, int | None]]:
    """tune.batching x tune.pack_lengths as (pad | group | pack, row length): a row length per packed
    candidate, none for the others; [(None, None)]: the job's own batching."""
    tc = cfg.tune
    kinds = [str(kind) for kind in tc.batching or []]
    if tc.pack_lengths and "pack" not in kinds:
        raise LauncherError(
            f"tune.pack_lengths={list(tc.pack_lengths)} without pack in tune.batching: row lengths are for packed "
            "candidates; add pack (e.g. tune.batching=[group,pack]) or drop tune.pack_lengths"
        )
    if "pack" in kinds and not tc.pack_lengths and pack_length(cfg.data) is None:
        raise LauncherError(
            "tune.batching has pack but no row length: set tune.pack_lengths (e.g. [2048,4096]), or "
            "data.pack_length (or data.max_length)"
        )
    if not kinds:
        return [(None, None)]
    batchings: list[tuple[str | None, int | None]] = []
    for kind in dict.fromkeys(kinds):
        if kind == "pack" and tc.pack_lengths:
            batchings += [(kind, int(n)) for n in dict.fromkeys(tc.pack_lengths)]
        else:
            batchings.append((kind, None))
    return batchings


def _planned(
    base: list[str], candidate: Any, global_batch: int, target: Target, shapes: RecordShapes | None = None
) -> Result:
    """A candidate with the planner's estimate and the DeepSpeed dict of its job (train.max_steps as given,
    not the measurement's few steps: what best.yaml must reproduce), or why it cannot be planned."""
    result = Result(candidate)
    try:
        candidate_cfg = typed(compose([*base, *candidate.overrides(global_batch)]))
        check_data(candidate_cfg.data)  # e.g. packing with a stream: refused as train.py would
        # A length in epochs counted in steps as train.py counts it (the schedule's steps are in the DeepSpeed
        # dict best.yaml must reproduce); a packed candidate of such a job is refused as train.py would.
        candidate_cfg, _ = training_length(candidate_cfg)
        candidate_job = plan_job(candidate_cfg, HydraJob(run_dir=Path(".")), validate=False)
        result.planned, result.components = planned_memory(candidate_cfg, candidate_job, target, shapes)
        # As train.py writes it: credentials left out, JSON types.
        result.ds_config = json.loads(json.dumps(credentials.split(candidate_job.ds_config)[0]))
    except (LauncherError, HydraException, OmegaConfBaseException) as err:
        result.status, result.note = "failed", one_line(err)  # e.g. a preset this method refuses
    return result


def check_best(t: Tuning, best: Result) -> str:
    """Compose best.yaml as train.py would (a dry run) and compare its DeepSpeed dict with the candidate's."""
    check_dir = t.directory / "best_check"
    command = [
        sys.executable,
        str(TRAIN_SCRIPT),
        f"hydra.searchpath=[file://{t.directory.resolve()}]",
        "experiment=best",
        "dry_run=true",
        f"hydra.run.dir={check_dir}",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    try:
        produced = json.loads(RunDir(check_dir).ds_config.read_text())
    except (OSError, ValueError):
        return f"NOT verified: the dry run of best.yaml failed ({error_line(done.stderr)})"
    if best.ds_config is None:
        return "not verified: the candidate's ds_config.json is missing"
    if produced == best.ds_config:
        return "verified: a dry run of best.yaml writes the candidate's ds_config.json exactly"
    differing = sorted(k for k in set(produced) | set(best.ds_config) if produced.get(k) != best.ds_config.get(k))
    return f"NOT verified: its ds_config.json differs from the candidate's in {', '.join(differing)}"


# ================================================================================ W&B
def log_to_wandb(t: Tuning, overrides: Sequence[str]) -> str | None:
    """One W&B run per candidate that ran, in one group, and a report run with the Table and the
    picture; the report run's directory, or None when W&B is off."""
    cfg = typed(compose(overrides))
    if cfg.logger.name == "none" or not cfg.logger.enabled:
        return None
    # W&B prints a block per run (unless WANDB_SILENT=false): the tuner prints where the runs are instead.
    mode = resolve_mode(str(cfg.logger.mode), os.environ, has_credentials())
    if mode == "disabled":
        return None
    project = str(cfg.logger.project or "vlm-ds-launcher")
    group = f"tune-{t.directory.parent.name}-{t.directory.name}"
    wandb_dir = t.directory / "wandb_runs"
    for result in t.results:
        if result.status in ("pruned", "skipped", "not run"):
            continue
        run = WandbRun.start(
            wandb_dir / result.name,
            project=project,
            entity=cfg.logger.entity,
            mode=mode,
            group=group,
            name=result.name,
            tags=["tune", result.status.replace(" ", "_")],
            config={
                "candidate": result.candidate.__dict__,
                "overrides": result.candidate.overrides(t.global_batch),
                "ds_config": result.ds_config or {},
            },
        )
        summary = {k: v for k, v in table_rows([result], t.global_batch)[0].items() if v is not None}
        run.finish(summary, hint=False)
    run = WandbRun.start(
        wandb_dir / "report",
        project=project,
        entity=cfg.logger.entity,
        mode=mode,
        group=group,
        name="tune-report",
        tags=["tune", "report"],
        config={"budget_mib": t.budget / MiB, "global_batch": t.global_batch, "world_size": t.world_size},
    )
    rows = table_rows(t.results, t.global_batch)
    run.log_table("tune/candidates", list(CSV_COLUMNS), [[row[c] for c in CSV_COLUMNS] for row in rows])
    if (t.directory / "tune.png").exists():
        run.log_image("tune/throughput_vs_memory", t.directory / "tune.png")
    best = pick(t.results)
    run.finish(
        {"pick": best.name if best else None, "pick_tokens_per_s": best.tokens_per_s if best else None}, hint=False
    )
    if mode == "offline":
        return f"{wandb_dir} (offline; upload with `wandb sync {wandb_dir}/*/wandb/offline-run-*`)"
    return str(wandb_dir)


# ================================================================================ command line
def _stop_handler(written: list[Path]) -> Callable[[int, object], None]:
    """A stop signal's one line: where tune.md holds what was measured, or that nothing was (a stop while the
    data is prepared or the candidates are planned)."""

    def stopped(signum: int, _frame: object) -> None:
        if written:
            raise Interrupted(f"tune: stopped by {name(signum)}; {written[-1] / 'tune.md'} holds what was measured")
        raise Interrupted(f"tune: stopped by {name(signum)} before any candidate ran; nothing was measured")

    return stopped


def main(argv: Sequence[str] | None = None) -> int:
    overrides = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    try:
        # A stop signal between candidates (composing, planning, reporting) ends the tuning in one line; during
        # a candidate, run_job forwards it to the ranks and the tuner stops once that candidate has stopped.
        written: list[Path] = []
        with handling(STOP_SIGNALS, _stop_handler(written)):
            t = tune(overrides, written=written.append)
            write_plot(t, t.directory / "tune.png")  # tune() wrote the tables and best.yaml already
            wandb_dir = log_to_wandb(t, overrides)
    except (HydraException, OmegaConfBaseException) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 1
    except LauncherError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return err.exit_code
    best = pick(t.results)
    for line in planner_lines(t.results):
        print(f"planner: {line}")
    print(f"tune: {t.directory / 'tune.md'} ({t.wall_s:.0f} s)" + (f"; W&B: {wandb_dir}" if wandb_dir else ""))
    if best is None:
        print(
            f"error: no candidate fits the budget of {t.budget / MiB:.0f} MiB per rank ({t.budget_source}): raise "
            f"tune.memory_gb, add ranks or widen the space; see {t.directory / 'tune.md'}",
            file=sys.stderr,
        )
        return 1
    print(f"pick: {describe(best)}")
    print(f"  {t.command_line(best)}")
    print(f"  best.yaml {t.best_check}")
    return 0
