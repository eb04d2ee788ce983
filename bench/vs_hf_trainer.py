"""`python train.py` against the Hugging Face Trainer on the same model, data and DeepSpeed dict.

    .venv/bin/python bench/vs_hf_trainer.py --steps 150 --skip 20 --repeats 5
    .venv/bin/python bench/vs_hf_trainer.py --steps 150 --skip 20 --repeats 3 precision=bf16
    .venv/bin/python bench/vs_hf_trainer.py --no-deepspeed     # the Trainer's own AdamW + cosine, no DeepSpeed

Both train the built-in job (tiny_llava on `shapes`; the defaults: ZeRO stage 0, fp32, micro batch 32)
in fresh processes, interleaved A B B A ... The Trainer gets what a `train.py` run wrote: the exact
`ds_config.json` as `TrainingArguments(deepspeed=<dict>)` (so the same DeepSpeed AdamW and
WarmupCosineLR run; `lr_scheduler_type="cosine"` only matters with --no-deepspeed), the same cached
model and processor, the same records, `ConversationDataset` and `Collator` as `data_collator`, one
DataLoader worker (persistent, drop_last), and arguments that match the dict (lr, betas, eps, weight
decay, clipping, warmup and total steps, bf16), which the Trainer checks against it.

With transformers 5.24 + accelerate 1.15 the Trainer's DeepSpeed path runs on this CPU: single-rank
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT in the environment, DeepSpeed finds its CPU
accelerator; fp32 with `use_cpu=False`, bf16 only with `use_cpu=True` (see `trainer_arguments`).

Figures over steps skip+1..steps of each run, medians over runs:
  period     wall from the end of step `skip` to the end of the step before the last (train.py evaluates
             after the last step, before its metrics line), per step: everything a loop does (data,
             forward/backward/step, its own bookkeeping and logging). Samples/s = micro batch / period.
             train.py: the time each
             metrics.jsonl line appears (polled every ms; the same poller runs during the Trainer);
             Trainer: a TrainerCallback's `on_step_end` times.
  step time  train.py's own `perf/step_time_s`; the Trainer's `on_step_begin` -> `on_step_end` (its
             batch is fetched before `on_step_begin`, so this one leaves data loading out).
  peak RSS   the training process's peak resident set size (train.py's summary.json figure; the
             Trainer's at `on_train_end`); DataLoader workers are not included on either side.

The headline ratio is the median of the ratios of neighbouring runs (run i of each contender), which
share the machine's state of the moment; the ratio of the two medians is printed below it. Runs wait
for a quiet machine and are run again when other processes loaded it (as in overhead.py). The mean
training loss of both is printed as a check that they ran the same job (with DeepSpeed they agree to
five digits here). `--work-dir` keeps the timings; `--report WORK_DIR...` prints the table again,
pooling several work directories.

`--data variable` trains both on a generated variable-length set instead (`variable_length_data`:
records of 20 to 400 tokens, images of mixed sizes, 1 to 3 per record), written once to
outputs/bench/variable_data. train.py reads its data cache (data.cache=true, the default; the table
reports when it was built and how long that took); pass `data.cache=false` to measure train.py
decoding in its DataLoader workers, as the Trainer does: the cache's own speed-up is the ratio of
the two train.py figures.

`--hf-worker REF_RUN_DIR --out FILE` runs one Trainer job (what the benchmark starts in a subprocess).
"""

from __future__ import annotations

import copy
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ is not a package
import _common as common

VARIABLE_DATA = Path("outputs/bench/variable_data")
WORDS = [f"w{i}" for i in range(200)]  # the tiny tokenizer learns each as one token


def variable_length_data(out: Path, records: int = 2000, seed: int = 0) -> list[str]:
    """Records of 20 to 400 tokens (the tiny model's: 16 per 32 px image plus ~1 per word), 1 to 3
    images each of 24 to 64 px, the answer naming the images' colours; the train.py overrides that
    read them. Deterministic; written once."""
    import random

    from PIL import Image

    colours = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (225, 205, 30)}
    path = out / "train.json"
    if not path.is_file():
        rng = random.Random(seed)
        (out / "img").mkdir(parents=True, exist_ok=True)
        rows = []
        for index in range(records):
            count = rng.randint(1, 3)
            names = []
            for k in range(count):
                colour = rng.choice(list(colours))
                side = rng.choice([24, 32, 48, 64])
                name = f"{index:05d}_{k}_{colour}_{side}.png"
                Image.new("RGB", (side, side + rng.randint(0, 16)), colours[colour]).save(out / "img" / name)
                names.append(name)
            words = rng.randint(4, 400 - 16 * count - 12)  # the template and answer take ~12 tokens
            question = " ".join(rng.choice(WORDS) for _ in range(words))
            answer = " ".join(name.split("_")[2] for name in names)
            turns = [{"from": "human", "value": "<image>" * count + question}, {"from": "gpt", "value": answer}]
            rows.append({"id": str(index), "images": names, "conversations": turns})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows))
        tmp.rename(path)
    return ["data=llava_json", f"data.path={path.absolute()}", f"data.image_root={(out / 'img').absolute()}"]


def trainer_arguments(ds_config: dict[str, Any], cfg: Any, output_dir: Path, *, deepspeed: bool) -> Any:
    """TrainingArguments that match the DeepSpeed dict (the Trainer refuses mismatches)."""
    from transformers import TrainingArguments

    optimizer = ds_config["optimizer"]["params"]
    scheduler = ds_config["scheduler"]["params"]
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    return TrainingArguments(
        output_dir=str(output_dir),
        deepspeed=copy.deepcopy(ds_config) if deepspeed else None,
        # Without DeepSpeed the Trainer needs use_cpu on a CPU. With it, fp32 runs with use_cpu=False
        # (accelerate's DEEPSPEED state); bf16 is refused unless use_cpu=True ("Your setup doesn't
        # support bf16/gpu. You need to assign use_cpu if you want to train the model on CPU."); then
        # TrainingArguments' own state says MULTI_CPU, yet the Trainer's Accelerator still runs
        # DeepSpeed (the table prints its distributed type and the engine it built).
        use_cpu=bf16 or not deepspeed,
        per_device_train_batch_size=ds_config["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=ds_config["gradient_accumulation_steps"],
        max_steps=scheduler["total_num_steps"],
        learning_rate=optimizer["lr"],
        adam_beta1=optimizer["betas"][0],
        adam_beta2=optimizer["betas"][1],
        adam_epsilon=optimizer["eps"],
        weight_decay=optimizer["weight_decay"],
        max_grad_norm=ds_config["gradient_clipping"],
        warmup_steps=scheduler["warmup_num_steps"],
        lr_scheduler_type="cosine",
        optim="adamw_torch",
        bf16=bf16,
        seed=int(cfg.train.seed),
        dataloader_num_workers=int(cfg.data.num_workers),
        dataloader_persistent_workers=int(cfg.data.num_workers) > 0,
        dataloader_drop_last=True,
        dataloader_pin_memory=False,
        remove_unused_columns=False,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10**9,
        disable_tqdm=True,
    )


def hf_worker(ref_run: Path, steps: int, out: Path, *, deepspeed: bool) -> None:
    """Train with transformers.Trainer; step times, peak RSS and what ran written to `out` as JSON."""
    common.single_rank_env()
    from transformers import Trainer, TrainerCallback

    from launcher.data.collate import Collator
    from launcher.data.records import ConversationDataset
    from launcher.model.loading import load_model_and_processor

    cfg, ds_config, records, model_dir = common.reference_inputs(ref_run)
    if ds_config["scheduler"]["params"]["total_num_steps"] != steps:
        raise SystemExit(f"{ref_run} was planned for a different number of steps than --steps={steps}")
    model, processor = load_model_and_processor(model_dir)
    model.config.use_cache = False

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []
            self.peak = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            self.end.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            self.peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    times = StepTimes()
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as output_dir:
        trainer = Trainer(
            model=model,
            args=trainer_arguments(ds_config, cfg, Path(output_dir), deepspeed=deepspeed),
            train_dataset=ConversationDataset(records),
            data_collator=Collator(processor),
            callbacks=[times],
        )
        result = trainer.train()
    out.write_text(
        json.dumps(
            {
                "step_times": [end - begin for begin, end in zip(times.begin, times.end, strict=True)],
                "step_ends": times.end,
                "peak_bytes": times.peak,
                "engine": type(trainer.model_wrapped).__name__,
                "deepspeed": trainer.is_deepspeed_enabled,
                "distributed_type": str(trainer.accelerator.distributed_type),
                "optimizer": type(getattr(trainer.model_wrapped, "optimizer", trainer.optimizer)).__name__,
                "train_loss": result.training_loss,
            }
        )
    )


def steady(run: dict[str, Any], skip: int, micro: int) -> dict[str, float]:
    per_step = common.period(run["step_ends"], skip)
    return {
        "period_s": per_step,
        "step_s": statistics.fmean(run["step_times"][skip:]),
        "samples_per_sec": micro / per_step,
        "peak_mib": run["peak_bytes"] / 2**20,
        "foreign_cpu": run.get("foreign_cpu", float("nan")),
    }


def main() -> None:
    parser = common.benchmark_parser(
        __doc__.splitlines()[0],
        repeats=3,
        worker_flag="--hf-worker",
        foreign_cpu_help="as in overhead.py: wait for, and re-run when, other processes use this share of the CPU "
        "(0: off)",
        options=lambda parser: (
            parser.add_argument("--no-deepspeed", action="store_true", help="the Trainer without DeepSpeed (fallback)"),
            parser.add_argument("--data", choices=["builtin", "variable"], default="builtin", help="see above"),
        ),
    )
    args = common.parse_args(parser)
    if args.data == "variable" and not args.worker:
        args.overrides = [*variable_length_data(VARIABLE_DATA), *args.overrides]
    if args.worker:
        hf_worker(args.worker, args.steps, args.out, deepspeed=not args.no_deepspeed)
        return
    if args.report:
        report(args.report, args.skip)
        return

    with common.work_dir(args.work_dir, "bench-vs-hf-") as work:
        seconds = common.run_interleaved(
            work,
            args,
            worker_flag="--hf-worker",
            worker_name="hf",
            worker_extra=["--no-deepspeed"] if args.no_deepspeed else [],
            progress=lambda run, elapsed: f"done at {elapsed:.0f} s",
        )
        print(f"\n{seconds:.0f} s in all. ", end="")
        report([work], args.skip)


def report(works: list[Path], skip: int) -> None:
    """The table, from the timings runs of this benchmark kept in `works` (pooled when several)."""
    ds_config = json.loads((works[0] / "train_py_0" / "ds_config.json").read_text())
    micro = ds_config["train_micro_batch_size_per_gpu"]
    train_runs, hf_runs = common.load_paired_runs(works, "hf")
    a = [steady(run, skip, micro) for run in train_runs]
    b = [steady(run, skip, micro) for run in hf_runs]
    hf_info = hf_runs[0]
    label = "HF Trainer + DeepSpeed" if hf_info["deepspeed"] else "HF Trainer, no DeepSpeed (torch AdamW, use_cpu)"
    zero = ds_config["zero_optimization"]["stage"]
    precision = "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32"
    steps = len(hf_info["step_ends"])
    print(
        f"ZeRO stage {zero}, {precision}, micro batch {micro}; {len(a)} and {len(b)} runs, steps {skip + 1}-{steps}, "
        f"interleaved; medians over runs. The Trainer ran a {hf_info['engine']} with {hf_info['optimizer']} "
        f"({hf_info['distributed_type']}).\n"
    )
    print("| contender | samples/s (period) | period ms | step time ms | peak RSS MiB |")
    print("|---|---|---|---|---|")
    for name, rows in (("`python train.py`", a), (label, b)):
        speed, peak = common.median_of(rows, "samples_per_sec"), common.median_of(rows, "peak_mib")
        period_ms, step_ms = (common.median_of(rows, key) * 1e3 for key in ("period_s", "step_s"))
        print(f"| {name} | {speed:.0f} | {period_ms:.1f} | {step_ms:.1f} | {peak:.0f} |")
    paired = common.paired_ratios(a, b, "samples_per_sec")
    memory = common.paired_ratios(a, b, "peak_mib")
    print(
        f"| **train.py / Trainer** (median of paired ratios) | {statistics.median(paired):.3f} | | | "
        f"{statistics.median(memory):.3f} |"
    )
    speed = common.median_of(a, "samples_per_sec") / common.median_of(b, "samples_per_sec")
    peak = common.median_of(a, "peak_mib") / common.median_of(b, "peak_mib")
    print(f"| ratio of the medians | {speed:.3f} | | | {peak:.3f} |")
    print(f"\npaired throughput ratios (run i of each): {', '.join(f'{r:.3f}' for r in paired)}")
    cache = train_runs[0]["summary"].get("data_cache")
    if cache:
        when = "built by the first run" if cache["built"] else "reused (built by an earlier run)"
        print(f"train.py's data cache: {when} in {cache['build_s']:.1f} s, before its first step")
    else:
        print("train.py read its data without the cache (data.cache=false)")
    if all("loss" in run for run in train_runs):
        ours = statistics.fmean(train_runs[0]["loss"])
        print(
            f"mean training loss over the steps (equal when both ran the same job): train.py {ours:.5f}, "
            f"Trainer {hf_info['train_loss']:.5f}"
        )
    for name, rows in (("train.py", a), ("Trainer", b)):
        speeds = ", ".join(f"{row['samples_per_sec']:.0f}" for row in rows)
        loads = ", ".join(f"{row['foreign_cpu']:.0%}" for row in rows)
        print(f"{name}: samples/s per run {speeds}; CPU share other processes used {loads}")


if __name__ == "__main__":
    main()
