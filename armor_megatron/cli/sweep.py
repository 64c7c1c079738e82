r"""``armor-sweep`` (or ``python tools/sweep.py``): expand a config grid into a SLURM job array.

    armor-sweep --config configs/qwen25_math_7b_dapo_armor.yaml --out sweeps/alpha-tau \
        --grid alpha=0.875,0.9375 --grid tau=80,160 --grid seed=1,2 --max-parallel 4 [--dry-run | --submit]

Naming and file layout: `armor_megatron.launch.sweep`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from armor_megatron.cli.common import OneLineArgumentParser, fail
from armor_megatron.cli.slurm import run_or_print
from armor_megatron.errors import UserInputError
from armor_megatron.launch.plan import LAUNCHERS
from armor_megatron.launch.sbatch import DEFAULT_LOG_DIR, TEMPLATE
from armor_megatron.launch.sweep import (
    add_grid_key,
    describe_values,
    parse_grid,
    plan_sweep,
    read_grid_file,
    write_sweep,
)

PROG = "armor-sweep"


def build_parser() -> OneLineArgumentParser:
    """The ``armor-sweep`` argument parser."""
    parser = OneLineArgumentParser(prog=PROG, description="Expand a config grid into a SLURM job array.")
    parser.add_argument("--config", required=True, help="base YAML run config")
    parser.add_argument("--out", required=True, help="sweep directory (configs/, manifest.json)")
    parser.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="repeatable; alpha, tau, G, seed or a dotted key",
    )
    parser.add_argument("--grid-file", help="YAML mapping key -> list of values")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="fixed overrides for every run")
    parser.add_argument("--max-parallel", type=int, default=None, help="array tasks running at once (--array=0-N%%M)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="srun")
    parser.add_argument("--template", default=TEMPLATE)
    parser.add_argument("--log-dir", default=DEFAULT_LOG_DIR)
    parser.add_argument("--signal-grace", type=int, default=120)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the runs and the sbatch command, write nothing")
    mode.add_argument("--submit", action="store_true", help="write, then run the sbatch command")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``armor-sweep``; returns the exit code."""
    args = build_parser().parse_with_overrides(argv)
    try:
        grid = read_grid_file(args.grid_file) if args.grid_file else {}
        for key, values in parse_grid(args.grid).items():
            add_grid_key(grid, key, values)
        sweep = plan_sweep(
            args.config,
            grid,
            args.out,
            fixed_overrides=args.overrides,
            max_parallel=args.max_parallel,
            launcher=args.launcher,
            template=args.template,
            log_dir=args.log_dir,
            signal_grace_s=args.signal_grace,
        )
        for run in sweep.runs:
            print(f"{run.index}\t{run.name}\t{describe_values(run.values)}")
        if not args.dry_run:
            write_sweep(sweep, overwrite=args.overwrite)
            print(f"# wrote {len(sweep.runs)} configs and {os.path.join(sweep.out_dir, 'manifest.json')}")
    except UserInputError as err:
        return fail(PROG, str(err))
    return run_or_print(PROG, list(sweep.sbatch), dry_run=not args.submit, make_dirs=[args.log_dir])


if __name__ == "__main__":
    sys.exit(main())
