"""`python -m areal.report RUN_DIR [RUN_DIR ...] [--out DIR]`: pictures of finished or running runs.

    RUN_DIR/{metrics,batches}.jsonl, events/ --data.py--> series --plots.py--> RUN_DIR/report/*.png
    several RUN_DIRs --> also compare.png in --out (default: their common parent/report-compare)

Prints a summary per run: steps, final reward (mean of the last 10 steps) and best, median
throughput, and the share of time each lane (server, trainer rank) spent waiting.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from areal.report.data import NotARunError, Run, format_summary, load_run, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m areal.report",
        description="Write a run's figures (PNG) into RUN_DIR/report/; given several runs, "
        "also a side-by-side comparison.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="experiment directories")
    parser.add_argument(
        "--out", help="where compare.png goes (default: the runs' common parent/report-compare)"
    )
    args = parser.parse_args(argv)
    try:
        runs = [load_run(p) for p in args.runs]
    except NotARunError as e:
        print(f"areal.report: {e}", file=sys.stderr)
        return 2
    _unique_labels(runs)
    from areal.report.plots import write_compare_figure, write_run_figures  # matplotlib: slow

    for run in runs:
        written = write_run_figures(run, run.path / "report")
        print(format_summary(summary(run)))
        print(f"  figures: {', '.join(p.name for p in written)} in {run.path / 'report'}")
        if not run.events:
            print("  (no events/: no timeline; runs record them unless stats.events=false)")
    if len(runs) > 1:
        parent = Path(os.path.commonpath([r.path.resolve() for r in runs]))
        out = Path(args.out) if args.out else parent / "report-compare"
        print(f"comparison: {write_compare_figure(runs, out)}")
    return 0


def _unique_labels(runs: list[Run]) -> None:
    """Runs of the same experiment and trial name (from different roots) get their paths."""
    labels = [r.label for r in runs]
    for r in runs:
        if labels.count(r.label) > 1:
            r.label = str(r.path)


if __name__ == "__main__":
    sys.exit(main())
