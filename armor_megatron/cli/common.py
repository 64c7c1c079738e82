"""Shared command-line plumbing: one-line errors and exit codes."""

from __future__ import annotations

import argparse
import sys
import warnings

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line (``prog: error: ...``) and exit code 2."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


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
