"""Shared command-line plumbing: one-line errors and exit codes."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line (``prog: error: ...``) and exit code 2."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")

    def parse_with_overrides(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """``parse_args``, with the ``section.key=value`` overrides and the flags in any order.

        argparse gives a ``nargs="*"`` positional only its first run of words, so the overrides after
        a flag (``--config X --check a.b=1``) would be unrecognized; every word left over that is not
        a flag joins ``overrides``, in the order given (a later override of a key wins). An unknown
        flag, or a stray word of a (sub)command without overrides, is still refused in one line.
        """
        args, rest = self.parse_known_args(argv)
        takes_overrides = hasattr(args, "overrides")  # a subcommand without them leaves none of its words over
        stray = [word for word in rest if word.startswith("-") or not takes_overrides]
        if stray:
            self.error(f"unrecognized arguments: {' '.join(stray)}")
        if rest:
            args.overrides = [*args.overrides, *rest]
        return args


def fail(prog: str, message: str, code: int = EXIT_BAD_INPUT) -> int:
    """Print ``prog: error: message`` to stderr and return the exit code ``code``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def quiet_third_party_warnings() -> None:
    """Silence third-party warnings no command user can act on.

    megatron-core and torch.distributed.checkpoint warn about missing GPU extras, deprecations
    and single-process saving on every run; none of it is actionable for the user of a command.
    """
    for module in ("megatron", "torch.distributed"):
        warnings.filterwarnings("ignore", category=UserWarning, module=module)
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
