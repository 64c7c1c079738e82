"""Graceful preemption: SIGTERM / SIGUSR1 ask the loop to checkpoint and exit for requeue.

SLURM sends SIGUSR1 ahead of the time limit (``#SBATCH --signal=B:USR1@120``) and SIGTERM on
preemption. The handler only records the request; the training loop checks
``requested()`` between steps (agreeing across ranks), saves a checkpoint and exits with
``REQUEUE_EXIT_CODE`` so the sbatch script can ``scontrol requeue`` the job.
"""

from __future__ import annotations

import signal

REQUEUE_EXIT_CODE = 85
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    def __init__(self, signals=SIGNALS):
        self.signals = tuple(signals)
        self.received: int | None = None
        self._previous = {}

    def install(self) -> PreemptionHandler:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()
