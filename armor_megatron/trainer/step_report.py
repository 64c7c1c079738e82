"""What a training step reports about itself besides its algorithm's metrics: time and throughput.

A `StepReport` lives for one step. The loop times its phases with it (``time/<phase>``, summed
when a phase repeats), tells it which generations ran during the step and which one produced
the batch the step trains, and marks the update's window; `StepReport.metrics` then gives

    time/<phase>, time/step                        every rank
    time/generation, time/overlap_saved,           driver (`trainer.overlap.timing_metrics`)
    time/trainer_idle_frac, time/engine_idle_frac
    timeline/rollout_begin, timeline/rollout_end   driver: the trained batch's generation, and the
    timeline/update_begin, timeline/update_end     update, in seconds since the run's clock origin
    perf/tokens_per_s, perf/*                      every rank (`trainer.throughput`; the peak memory
                                                   is a collective, so every rank asks for them)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from armor_megatron.models.arch import ModelArch
from armor_megatron.trainer.overlap import PendingBatch, timing_metrics
from armor_megatron.trainer.throughput import reset_peak_memory, throughput_metrics

TRAINER_BUSY_PHASES = ("logprobs", "values", "update")  # the trainer's own work; the rest waits or talks


@dataclasses.dataclass
class StepTimer:
    """Wall-clock seconds of a step's phases."""

    times: dict[str, float] = dataclasses.field(default_factory=dict)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added up when a phase repeats)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{name}"] = self.times.get(f"time/{name}", 0.0) + time.perf_counter() - start


class StepReport(StepTimer):
    """One step's phase times, generations and update window; the step's start resets the memory peak.

    Args:
        clock_origin: the run's ``perf_counter`` origin of the ``timeline/*`` metrics.
    """

    def __init__(self, clock_origin: float):
        super().__init__()
        self._origin = clock_origin
        self._started = time.perf_counter()
        self._generated: list[PendingBatch] = []
        self._trained: PendingBatch | None = None  # set with the overlap: a generation of an earlier step
        self._update: tuple[float, float] = (self._started, self._started)
        reset_peak_memory()

    def generated(self, pending: PendingBatch | None) -> None:
        """A generation that ran during this step (None: none did)."""
        if pending is not None:
            self._generated.append(pending)

    def trains(self, pending: PendingBatch) -> None:
        """The generation whose batch this step trains, when not the step's own (the overlap)."""
        self._trained = pending

    @contextmanager
    def update_window(self) -> Iterator[None]:
        """Mark the block as the step's update (``timeline/update_*``)."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._update = (begin, time.perf_counter())

    def metrics(
        self,
        *,
        arch: ModelArch,
        lengths: torch.Tensor | None,
        trained_tokens: float,
        epochs: int,
        world_size: int,
        peak_tflops: float | None,
        driver: bool,
        overlap: bool,
    ) -> dict[str, float]:
        """The step's timing and throughput metrics (module docstring), the step ending now.

        Args:
            arch: the model, for the FLOPs of MFU.
            lengths: [B] tokens per trained row; None when nothing trained.
            trained_tokens: response tokens the update trained on (``train/tokens``).
            epochs: updates over the batch (``train.epochs_per_step``).
            world_size: ranks sharing the step.
            peak_tflops: one device's peak (``launch.gpu_peak_tflops``); None leaves MFU out.
            driver: the driver rank, which alone knows the generations and reports the timeline.
            overlap: ``rollout.overlap: one_step``: the trained batch is the one `trains` named.
        """
        out: dict[str, float] = dict(self.times)
        elapsed = time.perf_counter() - self._started
        out["time/step"] = elapsed
        if driver:
            out.update(self._timeline(elapsed, overlap))
        out["perf/tokens_per_s"] = trained_tokens / max(elapsed, 1e-9)
        out.update(
            throughput_metrics(
                arch,
                lengths,
                step_seconds=elapsed,
                update_seconds=self.times.get("time/update", 0.0),
                epochs=epochs,
                world_size=world_size,
                peak_tflops=peak_tflops,
            )
        )
        return out

    def _timeline(self, elapsed: float, overlap: bool) -> dict[str, float]:
        """Driver: idle fractions and overlap savings, and when the trained batch was generated and trained."""
        busy = sum(self.times.get(f"time/{p}", 0.0) for p in TRAINER_BUSY_PHASES)
        generation = sum(p.generation_s for p in self._generated)
        out = timing_metrics(elapsed, busy, generation, self.times.get("time/rollout", 0.0))
        source = self._trained if overlap else (self._generated[0] if self._generated else None)
        if source is not None and source.begin > 0:
            out["timeline/rollout_begin"] = source.begin - self._origin
            out["timeline/rollout_end"] = source.end - self._origin
        out["timeline/update_begin"], out["timeline/update_end"] = (t - self._origin for t in self._update)
        return out
