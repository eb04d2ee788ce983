"""torch's launcher (`torchrun`), without its failure report: `python -m launcher.torchrun ARGS`.

When a rank fails, torchrun stops the others (within a bounded time) and then prints a report and its
own traceback; the ranks have already recorded their errors under `run_dir/errors/`, and the
launcher shows the first one as one line. HYDRA_FULL_ERROR=1 keeps torchrun's output as it is.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    import torch.distributed.elastic.multiprocessing.api as elastic_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torch's agent turns SIGTERM/SIGINT/SIGHUP/SIGQUIT into an exception that kills the ranks within seconds
    # (and a traceback): a stop signal to the whole group (Ctrl-C, `timeout`, SLURM) must let them save. The
    # launcher forwards stops as a file the ranks read; they reach the ranks themselves too.
    elastic_api._terminate_process_handler = _leave_the_stop_to_the_ranks
    verbose = os.environ.get("HYDRA_FULL_ERROR") == "1"
    if not verbose:
        # "Sending process N closing signal SIGTERM", "failed (exitcode: 1) local_rank: ..."
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        if verbose:
            raise
        codes = [failure.exitcode for failure in err.failures.values()]
        if 2 in codes:
            return 2
        # The first failure is the cause: torchrun lists the ranks it then stopped itself (SIGTERM) too.
        first = err.get_first_failure()[1].exitcode
        # A rank ended by a signal (the out-of-memory killer's SIGKILL): 128 + N, as a shell reports it.
        return 128 - first if first < 0 else 1
    return 0


def _leave_the_stop_to_the_ranks(_signum: int, _frame: object) -> None:
    """torch's agent's handler of the stop signals, replaced: the agent goes on waiting for its ranks."""


if __name__ == "__main__":
    from launcher.core.children import exit_without_teardown

    with exit_without_teardown():  # its end without the interpreter's teardown (~0.5 CPU s)
        sys.exit(main())
