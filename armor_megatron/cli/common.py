"""Shared command-line plumbing: one-line errors and exit codes."""

from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage problem as one line (``prog: error: ...``) and exit code 2."""

    def error(self, message: str):  # noqa: D102 - argparse API
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def fail(prog: str, message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code
