"""Entry point of each rank started by a launcher: `python -m launcher.launch.worker RUN_DIR`.

The launcher wrote the run directory (job.json: the job, planned) before starting the ranks; each rank
reads it back, so no rank parses a Hydra command line or makes a directory of its own. DeepSpeed's
launcher appends `--local_rank=N`; it is accepted and ignored (LOCAL_RANK is set too). A failing rank
prints nothing: its error is recorded under RUN_DIR/errors/ (by `train`) and the launcher shows the
first rank's, so the user does not read one traceback per rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from launcher.core.children import die_with_parent, exit_without_teardown
from launcher.core.errors import LauncherError
from launcher.core.signals import recording_stop_signals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    die_with_parent()  # a rank outlives neither the launcher nor torch's launcher that started it
    from launcher.job.spec import read_job
    from launcher.train.ops import use_interpreter_ninja
    from launcher.train.trainer import train

    use_interpreter_ninja()  # the ninja that builds DeepSpeed's ops: one for every shell (launcher.train.ops)
    try:
        train(read_job(args.run_dir), args.run_dir)
    except LauncherError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        return err.exit_code
    except KeyboardInterrupt:  # Ctrl-C reaches every process of the terminal's group: recorded, no traceback
        return 130
    return 0


if __name__ == "__main__":
    with exit_without_teardown():  # the rank's end: ~1.6 CPU s sooner (launcher.core.children)
        # From the first line: a stop while this rank starts (torch's import, the model) ends it after one step.
        with recording_stop_signals():
            code = main()
        sys.exit(code)
