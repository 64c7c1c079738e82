"""A worker target whose module takes IMPORT_SECONDS to import (test_isolated.py: a worker
replaced after a timeout must have it imported before the next call)."""

import os
import time

IMPORT_SECONDS = 4.0
time.sleep(IMPORT_SECONDS)


def pid():
    return os.getpid()


def sleep_then_pid(seconds):
    time.sleep(seconds)
    return os.getpid()
