"""Entry point of each rank started by a launcher: `python -m launcher.worker RUN_DIR`.

The Hydra job wrote the run directory (config, DeepSpeed dict, job facts) before starting the ranks;
each rank reads it back, so no rank parses a Hydra command line or makes a directory of its own.
DeepSpeed's launcher appends `--local_rank=N`; it is accepted and ignored (LOCAL_RANK is set too).
A failing rank prints nothing: its error is recorded under RUN_DIR/errors/ (by `train`) and the
launcher shows the first rank's, so the user does not read one traceback per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from launcher.core.errors import LauncherError
from launcher.core.rundir import RunDir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from launcher.core.children import die_with_parent

    die_with_parent()  # a rank outlives neither the launcher nor torch's launcher that started it
    cfg = OmegaConf.load(RunDir(args.run_dir).config)
    from launcher.train.trainer import train

    try:
        train(cfg, args.run_dir)
    except LauncherError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: recorded, no traceback
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
