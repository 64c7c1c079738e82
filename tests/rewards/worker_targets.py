"""Functions that test_isolated.py runs inside worker processes ("tests.rewards.worker_targets:...")."""

import os
import time


def pid():
    return os.getpid()


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()


def boom():
    raise ValueError("boom")


def die():
    os._exit(3)


def allocate(megabytes):
    return len(bytearray(megabytes * 1024 * 1024))


def chatty(value):
    print("stray output that must not corrupt the reply pipe")
    return value


def unpicklable():
    return lambda: None


def die_comparing(answer, golds):
    os._exit(9)


def raise_comparing(answer, golds):
    raise ModuleNotFoundError("No module named 'math_verify'")


def rendezvous_then_pid(directory, parties, wait_s):
    """Mark this call in ``directory`` and wait (at most ``wait_s``) until ``parties`` calls have
    marked theirs: calls that return their pid at once were running at the same time."""
    import uuid

    open(os.path.join(directory, uuid.uuid4().hex), "w").close()
    deadline = time.monotonic() + wait_s
    while len(os.listdir(directory)) < parties and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getpid()
