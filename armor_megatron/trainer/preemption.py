"""Graceful preemption: SIGTERM / SIGUSR1 ask the loop to checkpoint and exit for requeue.

SLURM sends SIGUSR1 ahead of the time limit (``#SBATCH --signal=B:USR1@120``) and SIGTERM on
preemption. The handler records the request; the training loop checks ``requested()`` between
steps (agreeing across ranks), saves a checkpoint and exits with ``REQUEUE_EXIT_CODE`` so the
sbatch script can ``scontrol requeue`` the job. A step cannot keep it waiting: the handler also
stops the reward calls in flight (``on_signal``), a step whose rollout they stop is abandoned,
and the loop saves the state of the last step it completed.

A signal that arrives while the run is still being built is not fatal either: the CLI calls
`record_early_signals` first, and the loop's handler takes such a signal over when installed
(the reward calls of the first step are refused, so the run checkpoints the state it started
from). Installing also unblocks the signals, which a process may have inherited blocked.

Helpers (megatron's checkpoint writers, reward workers) are started with the signals blocked,
so a signal to the whole process group, as SLURM sends it, leaves them working.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

REQUEUE_EXIT_CODE = 85
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_early: list[int] = []  # signals recorded before a PreemptionHandler was installed


def record_early_signals(signals: Iterable[int] = SIGNALS) -> None:
    """Record (instead of dying of) ``signals`` until a `PreemptionHandler` takes over."""
    for sig in signals:
        signal.signal(sig, _record_early)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def _record_early(signum: int, frame: FrameType | None) -> None:
    _early.append(signum)


class PreemptionHandler:
    """Records a preemption signal (SIGTERM, SIGUSR1) so the loop can checkpoint and stop.

    ``on_signal()``, if given, runs at once in the handler (it must be signal-safe: set a flag,
    write to a pipe): the loop stops the reward calls in flight with it, so a step stuck in a
    verifier ends now rather than never.
    """

    def __init__(self, signals: Iterable[int] = SIGNALS, on_signal: Callable[[], None] | None = None) -> None:
        self.signals = tuple(signals)
        self.received: int | None = None
        self.on_signal = on_signal
        self._previous: dict[int, Any] = {}

    def install(self) -> PreemptionHandler:
        """Install the handlers (a signal received before them counts); returns self."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        if _early:
            self._handle(_early[-1], None)
            _early.clear()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.signals)
        return self

    def uninstall(self) -> None:
        """Restore the previous signal handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if self.on_signal is not None:
            self.on_signal()

    def requested(self) -> bool:
        """Whether a preemption signal arrived."""
        return self.received is not None

    def __enter__(self) -> PreemptionHandler:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


class Preempted(Exception):
    """Raised after the preemption checkpoint is written; the CLI exits with the requeue code."""


def signal_name(signum: int | None) -> str:
    """``SIGUSR1``; a number that names no signal (on this rank: another rank got it) as is."""
    if signum is None:
        return "a preemption signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
