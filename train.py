"""Train a vision-language model with DeepSpeed, configured by Hydra.

    python train.py                                        # built-in tiny model and data, CPU
    python train.py deepspeed=z3_offload precision=bf16 dry_run=true
    python train.py -m deepspeed=z0,z2,z3 precision=bf16,fp32
    python train.py resume=outputs/runs/DATE/TIME          # continue a run in its own directory

Kept thin on purpose: nothing heavy is imported before Hydra has parsed the command line, so
`python train.py --cfg job` never loads torch, deepspeed or transformers.
"""

import sys

import hydra
from omegaconf import DictConfig

from launcher.config.schema import register_configs
from launcher.job.resume import resumed_run_dir
from launcher.launch.run import check_output_dir_argument, strip_local_rank_argument

register_configs()
strip_local_rank_argument()
check_output_dir_argument()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from launcher.launch.run import run_job

    return run_job(cfg)


if __name__ == "__main__":
    # A resume is composed from the old run's command line and runs in the old run's directory.
    if (resumed := resumed_run_dir(sys.argv)) is not None:
        from launcher.launch.run import run_resumed

        sys.exit(run_resumed(resumed, sys.argv))
    main()
