"""A step's report: phase times, the step's time, the timeline of the batch it trains, and throughput."""

import time

import pytest
import torch

from armor_megatron.trainer.overlap import PendingBatch
from armor_megatron.trainer.step_report import StepReport


def _metrics(report, *, driver=True, overlap=False, lengths=None, tokens=0.0):
    return report.metrics(
        arch=None,
        lengths=lengths,
        trained_tokens=tokens,
        epochs=1,
        world_size=2,
        peak_tflops=None,
        driver=driver,
        overlap=overlap,
    )


def test_phases_add_up_and_the_step_time_covers_them():
    report = StepReport(clock_origin=0.0)
    for name in ("rollout", "update", "rollout"):
        with report.phase(name):
            pass
    m = _metrics(report, lengths=torch.tensor([3, 5]), tokens=4.0)
    assert set(m) >= {"time/rollout", "time/update", "time/step", "perf/tokens_per_s", "perf/tokens_per_gpu_per_s"}
    assert m["time/step"] >= m["time/rollout"] + m["time/update"]
    assert m["perf/tokens_per_s"] == pytest.approx(4.0 / m["time/step"])
    assert m["perf/tokens_per_gpu_per_s"] == pytest.approx(8.0 / m["time/step"] / 2)
    assert "perf/mfu" not in m  # no peak given


def test_without_overlap_the_timeline_shows_the_steps_own_generation():
    origin = time.perf_counter()
    report = StepReport(clock_origin=origin)
    report.generated(PendingBatch(None, {}, 0, begin=origin + 1.0, end=origin + 4.0))
    report.generated(None)  # no generation: nothing added
    with report.update_window():
        pass
    m = _metrics(report)
    assert (m["timeline/rollout_begin"], m["timeline/rollout_end"]) == pytest.approx((1.0, 4.0))
    assert m["time/generation"] == pytest.approx(3.0)
    # the update ran inside the step, which began after the origin
    assert 0.0 <= m["timeline/update_begin"] <= m["timeline/update_end"] <= time.perf_counter() - origin


def test_with_overlap_the_timeline_shows_the_trained_batch_and_counts_every_generation():
    report = StepReport(clock_origin=100.0)
    earlier = PendingBatch(None, {}, 1, begin=90.0, end=95.0)  # generated during the last step
    report.trains(earlier)
    report.generated(PendingBatch(None, {}, 2, begin=101.0, end=103.0))  # the next step's, joined now
    m = _metrics(report, overlap=True)
    assert (m["timeline/rollout_begin"], m["timeline/rollout_end"]) == (-10.0, -5.0)
    assert m["time/generation"] == 2.0
    resumed = StepReport(clock_origin=100.0)
    resumed.trains(PendingBatch(None, {}, 1, begin=0.0, end=3.0))  # restored from a checkpoint: no time
    assert "timeline/rollout_begin" not in _metrics(resumed, overlap=True)


def test_other_ranks_report_no_timeline():
    m = _metrics(StepReport(clock_origin=0.0), driver=False)
    assert not [k for k in m if k.startswith("timeline/") or k == "time/generation"]
    assert {"time/step", "perf/tokens_per_s", "perf/peak_memory_gib"} <= set(m)
