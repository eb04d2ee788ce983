"""End of a multirun: the comparison on the terminal and in the sweep directory, and whether a job failed.

Registered as a Hydra callback in `conf/config.yaml`; Hydra calls it once the last job returned. It
records which jobs failed; train.py asks `failed_sweep_line` once Hydra is done and exits non-zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from launcher.compare.render import terminal_table, write_outputs, written_line
from launcher.compare.runs import load_runs
from launcher.core.rundir import RunDir

# (job directory name, error line) of each failed job of the sweep that ended in this process.
_failed: list[tuple[str, str]] = []


# Jobs a stop signal ended (saved and resumable, or stopped before training): not failures.
STOPPED = ("preempted", "interrupted")
# Jobs the device cannot run (launcher.core.errors.DeviceLacks: fp16 on a CPU): named in the table, no failure.
SKIPPED = "skipped"


def failed_jobs(sweep_dir: Path) -> list[tuple[str, str]]:
    """(job directory name, error line) for every job of the sweep that did not complete: failed, or (its
    status as the line) stopped by a signal."""
    failed = []
    for job_dir in sorted(path for path in sweep_dir.iterdir() if path.is_dir()):
        summary = RunDir(job_dir).read_summary()
        if summary is not None and summary.status not in ("completed", SKIPPED):
            failed.append((job_dir.name, summary.status if summary.status in STOPPED else summary.error or "failed"))
    return failed


def failed_sweep_line() -> tuple[str, int] | None:
    """The line a sweep ends with when some of its jobs did not complete (their errors are in the table
    above), and its exit code: 1 when one failed; 143 when the rest were stopped by a signal (preempted:
    each resumes with resume=ITS_DIR), as a single job's preemption exits."""
    if not _failed:
        return None
    failed = [job for job, why in _failed if why not in STOPPED]
    if failed:
        return f"{len(failed)} job(s) of the sweep failed (job {', '.join(failed)}; errors above)", 1
    stopped = ", ".join(job for job, _ in _failed)
    return (
        f"{len(_failed)} job(s) of the sweep were stopped by a signal (job {stopped}; resume each with resume=DIR)",
        143,
    )


class SweepReport(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        rows = load_runs([sweep_dir])
        report = write_outputs(rows, sweep_dir, sweep_dir.name)
        print(f"\n{terminal_table(rows)}\n\n{written_line(report.absolute())}", flush=True)
        _failed[:] = failed_jobs(sweep_dir)  # the table's last lines name each failed run with its error
