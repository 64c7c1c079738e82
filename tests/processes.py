"""Processes a test starts are stopped whatever its outcome: ``with stopped_after(Popen(...)) as proc``.

`kill_tree` kills a process and every process it started (listed before any is killed, so none
escapes by being re-parented) and reaps them; a process that already exited is left as it is.
psutil's ``Process`` objects refuse to signal a pid that was reused since they were made.
tests/conftest.py fails the run when a child of the pytest process outlives the tests anyway.
"""

from __future__ import annotations

import contextlib
import subprocess

import psutil


def kill_tree(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGKILL `proc` and its descendants, then wait for them (and reap `proc`). Nothing when `proc`
    was reaped already: its pid may belong to another process by now."""
    if proc.poll() is not None:
        return
    try:
        root = psutil.Process(proc.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(family, timeout=timeout)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)


@contextlib.contextmanager
def stopped_after(proc: subprocess.Popen):
    """Yield `proc`; on leaving (a failed assertion included) kill it and its descendants if alive."""
    try:
        yield proc
    finally:
        kill_tree(proc)
