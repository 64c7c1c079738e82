"""A worker target whose import blocks until the test opens a gate (test_isolated.py: a worker
replaced after a timeout must have the module imported before the next call, and the failed call
must not wait for that import).

``IMPORT_GATE`` names a directory: each import appends ``<pid>`` to ``imports.log`` once it has
passed the gate (the file ``open`` in that directory), so the test sees which processes imported
the module, and when, without measuring time.
"""

import os
import time

GATE_ENV = "ARMOR_TEST_IMPORT_GATE"
GATE_WAIT_S = 90.0  # bounded: a test that forgets to open the gate fails instead of hanging


def _wait_at_the_gate() -> None:
    gate = os.environ[GATE_ENV]
    deadline = time.monotonic() + GATE_WAIT_S
    while not os.path.exists(os.path.join(gate, "open")) and time.monotonic() < deadline:
        time.sleep(0.02)
    with open(os.path.join(gate, "imports.log"), "a") as f:
        f.write(f"{os.getpid()}\n")


_wait_at_the_gate()


def pid():
    return os.getpid()


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()
