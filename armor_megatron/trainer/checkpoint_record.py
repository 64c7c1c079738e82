"""Checkpoint bookkeeping: which step the newest checkpoint holds, and that step's metrics as they stood at the save.

A step's checkpoint is written before its log line (the record holds the save's time), so a run
killed in between resumes after a step its log never saw. The checkpoint carries the step's
metrics as they stood at the save (no ``time/*`` of the save and after, no anchor-pool
statistics); a resumed run logs them once, marked ``log/restored_from_checkpoint``, if the metrics
log lacks the step. A preemption signal between steps saves only when the newest checkpoint does
not hold the current step already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from armor_megatron.trainer.metrics_log import StepReporter, scalar_metrics
from armor_megatron.trainer.step_report import StepTimer


class CheckpointRecord:
    """The step the newest checkpoint holds (every rank) and its metrics record (the driver's, checkpointed)."""

    def __init__(self) -> None:
        self.step: int | None = None  # the step whose state the newest checkpoint holds
        self.record: dict[str, Any] | None = None  # {"step", "metrics"}: the trainer state's ``step_record``

    def save(
        self, save: Callable[[], None], step: int, metrics: dict[str, Any], timer: StepTimer, driver: bool
    ) -> None:
        """All ranks, trainer on the device: save ``step``; the driver's state carries its metrics so far."""
        if driver:
            self.record = {"step": step, "metrics": scalar_metrics(metrics)}
        with timer.phase("checkpoint"):
            save()
        self.step = step

    def log_if_lost(self, reporter: StepReporter, step: int) -> None:
        """Driver, on resume: log the checkpointed step's record if the metrics log lacks it (module docstring)."""
        record, self.record = self.record, None
        logger = reporter.logger
        if record is None or record["step"] != step or logger is None or not logger.lacks(step):
            return
        if reporter.should_log(step, record["metrics"]):
            logger.log(step, {**record["metrics"], "log/restored_from_checkpoint": 1.0})
