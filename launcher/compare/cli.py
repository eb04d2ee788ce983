"""Compare the runs of a sweep: one table, one picture, so a person can pick a configuration.

Usage::

    python -m launcher.compare outputs/multirun/2026-11-29/15-30-00         # a sweep directory
    python -m launcher.compare outputs/2026-11-29/10-00-00 outputs/2026-11-29/11-00-00  # runs
    python -m launcher.compare --wandb ENTITY/PROJECT --group GROUP          # the same, from W&B

Rows are runs, sorted by throughput (samples/s, highest first; failed runs last), each named by the
settings that tell it apart (``deepspeed=z2,precision=bf16``, `run_names`). Columns are the
config-group choices (and other overrides) that differ between the runs, then status, steps, losses,
accuracy, throughput, peak memory and wall time. Written next to the runs (into a sweep directory, or
the directory holding the given runs; ``--out`` elsewhere): ``compare.md`` (table, failed runs with
their error line, the picture), ``compare.csv`` (raw numbers, bytes and seconds) and ``compare.png``
(train/loss curves, throughput and peak-memory bars per configuration).

Local runs are read only from files the job writes (``summary.json``, ``metrics.jsonl``,
``.hydra/overrides.yaml``, ``.hydra/hydra.yaml``), so a copy of ``outputs/`` is enough. A run
directory without ``summary.json`` (a job killed hard) is listed as "incomplete", with whatever its
``metrics.jsonl`` holds.

The W&B path (`fetch_wandb_rows`) uses W&B's public API as documented for wandb 0.31:
``wandb.Api().runs("entity/project", filters={"group": GROUP})``, each run's ``summary_metrics``
(written by `launcher.wandb_logger.WandbRun.finish` with summary.json's keys), ``tags``
(``group=choice``) and ``scan_history(keys=["trainer/step", "train/loss"])`` for the curves. It needs
network access and credentials and is NOT exercised against a server in this repository's tests;
only the conversion of API run objects into rows (`row_from_wandb_run`) is tested, with stand-ins.
Everything after fetching rows is shared with the local path.

This module imports neither torch nor wandb at import time; matplotlib is imported only to draw.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from launcher.compare.render import count_line, default_out_dir, terminal_table, write_outputs, written_line
from launcher.compare.runs import NotARunError, fetch_wandb_rows, is_run_dir, load_runs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.compare",
        description=(
            "Compare training runs: a table (rows = runs sorted by samples/s, failed last; columns = "
            "the choices that differ) in the terminal, and compare.md, compare.csv, compare.png on disk."
        ),
    )
    parser.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="PATH",
        help="a multirun sweep directory (its job subdirectories are the runs) or run directories",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=(
            "where to write compare.md/.csv/.png. Default: the sweep directory when PATH is a single "
            "sweep directory; otherwise the directory that holds all the given runs (their common parent); "
            "with --wandb the current directory. The last line printed says where they went"
        ),
    )
    parser.add_argument(
        "--wandb",
        metavar="ENTITY/PROJECT",
        help="read the runs from W&B's public API instead of from disk (needs network and credentials)",
    )
    parser.add_argument("--group", help="with --wandb: only the runs of this W&B group (e.g. the sweep)")
    parser.add_argument("--no-plot", action="store_true", help="skip compare.png (and matplotlib)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for paths that are not runs, with one line on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if bool(args.paths) == bool(args.wandb):
        parser.error("give run/sweep directories or --wandb ENTITY/PROJECT (one of the two)")
    if args.group and not args.wandb:
        parser.error("--group only applies with --wandb")

    if args.wandb:
        try:
            rows = fetch_wandb_rows(args.wandb, args.group)
        except Exception as exc:
            print(f"compare: error: cannot read runs from W&B {args.wandb}: {exc}".splitlines()[0], file=sys.stderr)
            return 1
        if not rows:
            print(f"compare: error: no W&B runs in {args.wandb} group {args.group!r}", file=sys.stderr)
            return 2
        title = f"{args.wandb} {args.group or ''}".strip()
        out_dir = args.out or Path.cwd()
    else:
        try:
            rows = load_runs(args.paths)
        except NotARunError as exc:
            print(f"compare: error: {exc}", file=sys.stderr)
            return 2
        single_sweep = len(args.paths) == 1 and not is_run_dir(args.paths[0])
        title = args.paths[0].resolve().name if single_sweep else count_line(rows)
        out_dir = args.out or default_out_dir(args.paths)

    print(terminal_table(rows))
    try:
        md_path = write_outputs(rows, out_dir, title, plot=not args.no_plot)
    except OSError as exc:
        print(f"compare: error: cannot write to {out_dir}: {exc}", file=sys.stderr)
        return 1
    print("\n" + written_line(md_path.absolute(), plot=not args.no_plot))
    return 0
