"""End of a multirun: the comparison on the terminal and in the sweep directory; fail if any job failed.

Registered as a Hydra callback in `conf/config.yaml`; Hydra calls it once the last job returned.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from launcher.core.rundir import SUMMARY_FILE, read_json


def failed_jobs(sweep_dir: Path) -> list[tuple[str, str]]:
    """(job directory name, error line) for every job of the sweep that did not complete."""
    failed = []
    for summary_path in sorted(sweep_dir.glob(f"*/{SUMMARY_FILE}")):
        summary = read_json(summary_path)
        if summary.get("status") != "completed":
            failed.append((summary_path.parent.name, summary.get("error") or summary.get("status", "?")))
    return failed


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from launcher.compare.compare import load_runs, terminal_table, write_outputs, written_line

        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = load_runs([sweep_dir])
        report = write_outputs(rows, sweep_dir, sweep_dir.name)
        print(f"\n{terminal_table(rows)}\n\n{written_line(report.absolute())}", flush=True)
        failed = failed_jobs(sweep_dir)
        if failed:  # the table's last lines name each failed run with its error
            jobs = ", ".join(job for job, _ in failed)
            print(f"error: {len(failed)} job(s) of the sweep failed (job {jobs}; errors above)", file=sys.stderr)
            sys.exit(1)
