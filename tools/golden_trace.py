"""Rewrite tests/trainer/golden_trace.json from a fresh run of the tiny seeded config.

    python tools/golden_trace.py          # about 20 s of CPU time

Run it after a change that is meant to move the numbers, and commit the diff of the JSON beside
the change: what moved, by how much, shows there. What the run is and the tolerances a fresh run
is held to: tests/trainer/golden_trace.py.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    """Run the trace in a temporary directory and write the golden file."""
    sys.path.insert(0, str(ROOT))
    from armor_megatron.megatron import dist as mdist
    from tests.trainer import golden_trace

    os.chdir(ROOT)
    mdist.initialize(mdist.ParallelConfig(), environ={})
    try:
        with tempfile.TemporaryDirectory() as work:
            trace = golden_trace.run_trace(Path(work))
    finally:
        mdist.shutdown()
    changed = golden_trace.differences(golden_trace.read(), trace) if golden_trace.GOLDEN.exists() else ["(new)"]
    golden_trace.write(trace)
    print(
        f"{golden_trace.GOLDEN.relative_to(ROOT)}: {len(trace)} steps written; outside tolerance before: {len(changed)}"
    )
    for line in changed:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
