"""Train a vision-language model with DeepSpeed, configured by Hydra.

    python train.py                                        # built-in tiny model and data, CPU
    python train.py deepspeed=z3_offload precision=bf16 dry_run=true
    python train.py -m deepspeed=z0,z2,z3 precision=bf16,fp32

Kept thin on purpose: nothing heavy is imported before Hydra has parsed the command line, so
`python train.py --cfg job` never loads torch, deepspeed or transformers.
"""

import hydra
from omegaconf import DictConfig

from launcher.entry import apply_resume_argument, check_output_dir_argument, strip_local_rank_argument
from launcher.schema import register_configs

register_configs()
strip_local_rank_argument()
apply_resume_argument()
check_output_dir_argument()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    from launcher.entry import run_job

    return run_job(cfg)


if __name__ == "__main__":
    main()
