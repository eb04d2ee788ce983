"""Train a vision-language model with DeepSpeed, configured by Hydra.

    python train.py                                        # built-in tiny model and data, CPU
    python train.py deepspeed=z3_offload precision=bf16 dry_run=true
    python train.py -m deepspeed=z0,z2,z3 precision=bf16,fp32
    python train.py resume=outputs/runs/DATE/TIME          # continue a run in its own directory

The command line's edge: what it prints and its exit code. The job itself is
`launcher.launch.run.run_job`, which returns an outcome. Kept thin on purpose: nothing heavy is imported
before Hydra has parsed the command line, so `python train.py --cfg job` never loads torch, deepspeed or
transformers.
"""

import os
import sys

# First, before anything slow: from here on a stop signal (SIGTERM, SIGINT, SIGHUP, ...) is remembered, and the
# job ends "interrupted" with a summary instead of dying silently in an import (launcher.core.signals).
from launcher.core.signals import pause_for_test, record_stop_signals_from_now

if __name__ == "__main__":
    record_stop_signals_from_now()

import hydra
from omegaconf import DictConfig

from launcher.config.schema import register_configs
from launcher.launch.cli import composition_refused, local_rank_dropped, refused_run_dir, slurm_missing

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from launcher.job.spec import HydraJob
    from launcher.launch.run import run_job

    job = HydraJob.from_hydra()
    outcome = run_job(cfg, job)
    for line, to_stderr in outcome.lines():
        print(line, file=sys.stderr if to_stderr else sys.stdout, flush=True)
    if outcome.exit_code and not job.multirun:  # a sweep records a failed job and goes on
        sys.exit(outcome.exit_code)
    return outcome.objective


if __name__ == "__main__":
    pause_for_test("start")  # the tests' stop signals land here, before Hydra (a no-op otherwise)
    if (local_rank := local_rank_dropped(sys.argv)) is not None:  # run by DeepSpeed's launcher itself
        os.environ.setdefault("LOCAL_RANK", local_rank)
    if (refused := composition_refused(sys.argv)) is not None:  # one line, where Hydra would print a dump
        print(f"error: {refused}", file=sys.stderr)
        sys.exit(1)
    if (refused := slurm_missing(sys.argv) or refused_run_dir(sys.argv)) is not None:
        print(f"error: {refused}", file=sys.stderr)
        sys.exit(2)
    from launcher.core.children import exit_without_teardown

    with exit_without_teardown():  # the end: ~1.6 CPU s sooner, without the interpreter's teardown
        main()
        from launcher.compare.sweep import failed_sweep_line

        if (ended := failed_sweep_line()) is not None:  # the end of a sweep, one of whose jobs did not complete
            line, code = ended
            print(f"error: {line}", file=sys.stderr)
            sys.exit(code)
