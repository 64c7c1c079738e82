"""What a ``tensor`` weight push stages at its peak, measured op by op on CPU (glibc's mallinfo2
after every torch op, as tests/launch/test_memory.py measures the log-prob peak), against what the
device-memory ledger charges (`launch.memory.STAGED_BUCKETS` buckets)."""

import pytest
import torch

from armor_megatron.launch.memory import STAGED_BUCKETS
from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig, _TensorSink
from tests import host_memory


def test_the_driver_stages_three_buckets_at_the_peak_of_a_push():
    """The driver's sink (``TensorDelivery``, what `sync_weights` drives on rank 0) gets one export
    bucket at a time, holds the previous one back (it goes last, with the version) and packs the
    one it posts into a flat copy: three buckets at once. No engine is attached: the sink's own
    staging is what is measured (a real engine's copies live in its own process)."""
    if not host_memory.available():
        pytest.skip("needs glibc's mallinfo2")
    bucket_bytes = 16 << 20
    sink = _TensorSink([], WeightSyncConfig(mode="tensor", bucket_bytes=bucket_bytes, device="cpu"), hold_last=True)
    with host_memory.OpPeak() as peak:
        torch.full((bucket_bytes // 16,), 0.0)  # the first op's one-off allocations are not the push's
        peak.rebase()
        for k in range(4):  # as HFWeightExport._deliver_share: a fresh list of full tensors per bucket
            bucket = [(f"layer{k}.w{i}", torch.full((bucket_bytes // 16,), float(k))) for i in range(4)]
            sink.put(bucket)
            del bucket
    staged = peak.bytes / bucket_bytes
    assert sink.pending is not None and len(sink.pending) == 4  # the last bucket, held back for the version
    assert staged == pytest.approx(STAGED_BUCKETS, abs=0.3), staged
