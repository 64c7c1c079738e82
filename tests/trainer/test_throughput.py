import pytest
import torch

from armor_megatron.models.flops import train_flops
from armor_megatron.trainer.throughput import throughput_metrics
from tests.models.test_flops import DENSE


def test_tokens_per_gpu_and_mfu_by_hand():
    lengths = torch.tensor([10, 3])
    m = throughput_metrics(
        DENSE, lengths, step_seconds=2.0, update_seconds=0.5, epochs=2, world_size=1, peak_tflops=1e-6
    )
    assert m["perf/tokens_per_gpu_per_s"] == pytest.approx(13 / 2.0)
    # 2 epochs of Σ s·F(s) FLOPs in 0.5 s against a peak of 1e6 FLOP/s
    assert m["perf/mfu"] == pytest.approx(2 * train_flops(DENSE, [10, 3]) / (0.5 * 1e6))
    assert m["perf/peak_memory_gib"] > 0


def test_no_mfu_without_a_configured_peak_and_nothing_when_nothing_trained():
    m = throughput_metrics(
        DENSE, torch.tensor([4]), step_seconds=1, update_seconds=1, epochs=1, world_size=2, peak_tflops=None
    )
    assert m["perf/tokens_per_gpu_per_s"] == pytest.approx(2.0) and "perf/mfu" not in m
    skipped = throughput_metrics(DENSE, None, step_seconds=1, update_seconds=0, epochs=1, world_size=1, peak_tflops=9.0)
    assert set(skipped) == {"perf/peak_memory_gib"}
