"""Rerun the main job and rewrite what the documentation quotes of its output.

    python tools/quoted_outputs.py            # runs `python examples/tiny_cpu.py` (~3 minutes on 2 idle cores)
    python tools/quoted_outputs.py --from-log outputs/tiny/main_job.log   # rewrite from a finished run's log

The main job's last line (``val_acc_start=… minutes=…``) is quoted, indented as a code block, in
README.md; the quoted line is replaced by the line the run printed. The log of the run is kept as
``<out>/main_job.log``, its figure is ``<out>/curves.png``. (docs/evidence.md quotes the study's
runs as they were measured, at the commits it names; the study's own command reruns them.)

What may differ on another machine: ``minutes`` (wall time: the CPU and what else runs on it).
The accuracies and shares come from seeded CPU runs and repeat on a machine with the same torch
build; another torch release, or a CPU whose kernels sum in another order (AVX-512 against AVX2),
may change the last bits of a step, which 200 RL steps can grow into other figures.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUOTING = ("README.md",)
LINE = re.compile(r"^val_acc_start=\S+ dapo_val_peak=.* minutes=\S+$", re.MULTILINE)
QUOTED = re.compile(r"^(    )val_acc_start=\S+ dapo_val_peak=.* minutes=\S+$", re.MULTILINE)


def last_line(log: str) -> str:
    """The main job's result line in ``log`` (its last one)."""
    found = LINE.findall(log)
    if not found:
        raise SystemExit("quoted_outputs: the run printed no `val_acc_start=… minutes=…` line (see its log)")
    return found[-1]


def rewrite(text: str, line: str) -> tuple[str, int]:
    """``text`` with every quoted result line replaced by ``line``; and how many were."""
    return QUOTED.subn(lambda m: m.group(1) + line, text)


def main(argv: list[str] | None = None) -> int:
    """Run the main job (or read its log), then rewrite the quoted line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outputs/tiny", help="the main job's working directory")
    parser.add_argument("--from-log", help="take the line from this log instead of running the job")
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    if args.from_log:
        with open(args.from_log, encoding="utf-8") as f:
            log = f.read()
    else:
        cmd = [sys.executable, os.path.join("examples", "tiny_cpu.py"), "--out", args.out]
        print("+ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "main_job.log"), "w", encoding="utf-8") as f:
            f.write(log)
        if proc.returncode:
            sys.stderr.write(log[-3000:])
            return proc.returncode
    line = last_line(log)
    for path in QUOTING:
        with open(path, encoding="utf-8") as f:
            text, count = rewrite(f.read(), line)
        if count == 0:
            raise SystemExit(f"quoted_outputs: {path} quotes no result line")
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(f"{path}.tmp", path)
        print(f"{path}: {count} quoted line(s) rewritten")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
