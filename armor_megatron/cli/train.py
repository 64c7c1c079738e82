"""``armor-train --config FILE [section.key=value ...] [--check]``."""

from __future__ import annotations

import sys

import yaml

from armor_megatron.cli.common import EXIT_OK, OneLineArgumentParser, fail
from armor_megatron.config import ConfigError, load_config, to_dict

PROG = "armor-train"


def build_parser() -> OneLineArgumentParser:
    parser = OneLineArgumentParser(prog=PROG, description="Run ARMOR RL post-training from a YAML config.")
    parser.add_argument("--config", required=True, help="YAML run config (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="dotted config overrides")
    parser.add_argument("--check", action="store_true", help="validate, print the resolved config and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        return fail(PROG, f"config: {err}")
    if args.check:
        yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
        print(f"{PROG}: config OK ({args.config})", file=sys.stderr)
        return EXIT_OK
    return fail(PROG, "the training loop is not part of this release yet; use --check to validate a config")


if __name__ == "__main__":
    sys.exit(main())
