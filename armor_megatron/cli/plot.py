"""``armor-plot``: training vs validation accuracy and per-phase timings of runs, to one PNG.

    armor-plot logs/qwen25-armor logs/qwen25-dapo --out compare.png
    armor-plot logs/run/metrics.jsonl --out run.png --metric anchor/found_rate --metric time/step

Each run is a run directory (``<logging.dir>/<run name>``) or its ``metrics.jsonl``; runs are
overlaid, labelled by their directory name. Each ``--metric KEY`` adds one panel with that key
for every run. Bad input exits 2 with one line. Needs matplotlib (exit 1 and one line without it):
``pip install 'armor_megatron[plot]'``.
"""

from __future__ import annotations

import os
import sys

from armor_megatron.cli.common import EXIT_FAILED, EXIT_OK, OneLineArgumentParser, fail
from armor_megatron.errors import UserInputError

PROG = "armor-plot"
NEEDS_MATPLOTLIB = "armor-plot needs matplotlib (pip install 'armor_megatron[plot]')"


def build_parser() -> OneLineArgumentParser:
    """The ``armor-plot`` argument parser."""
    p = OneLineArgumentParser(prog=PROG, description="Plot accuracy curves and phase timings of runs to a PNG.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR_OR_METRICS_JSONL")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.add_argument(
        "--metric", action="append", default=[], metavar="KEY", help="extra panel for this metric key (repeatable)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``armor-plot``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from armor_megatron.trainer.plotting import load_run, plot_runs, unique_labels

    if not args.out.lower().endswith(".png"):
        return fail(PROG, f"--out must name a .png file, got {args.out}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        return fail(PROG, f"--out directory does not exist: {out_dir}")
    try:
        runs = [load_run(run) for run in args.runs]
    except UserInputError as err:  # anything else is a bug: its traceback stays
        return fail(PROG, str(err))
    known = set().union(*(run.keys() for run in runs))
    unknown = [key for key in args.metric if key not in known]
    if unknown:
        return fail(PROG, f"unknown --metric {', '.join(unknown)}: no run logged it")
    unique_labels(runs)
    try:
        import matplotlib  # noqa: F401 - the optional extra; checked before drawing
    except ImportError:
        print(NEEDS_MATPLOTLIB, file=sys.stderr)
        return EXIT_FAILED
    plot_runs(runs, args.out, args.metric)
    print(f"wrote {args.out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return EXIT_OK
