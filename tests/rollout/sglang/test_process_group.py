"""The trainer's weights update group meets an engine that joins as SGLang does.

The engine end is the test double's, built like SGLang 0.5.23's ``init_custom_process_group``
(rendezvous, ``PrefixStore(group_name)``, torch's process-group helper), not from our class:
a difference in rendezvous keys times out here, as it would hang a real broadcast."""

import threading

import pytest
import torch

from armor_megatron.rollout.sglang.process_group import WeightUpdateGroup
from armor_megatron.rollout.sglang.router import free_port
from armor_megatron.rollout.testing.sglang_test_server import _join_weight_update_group


@pytest.mark.timeout(120)
def test_broadcast_reaches_an_engine_that_joins_as_sglang_does():
    import torch.distributed as dist

    port, received = free_port("127.0.0.1"), {}

    def engine(rank):
        try:
            group = _join_weight_update_group("127.0.0.1", port, rank, 2, "armor_weights", "gloo", timeout=30)
            t = torch.zeros(4, dtype=torch.bfloat16)
            dist.broadcast(t, src=0, group=group)
            received[rank] = t
            dist.destroy_process_group(group)
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            received[rank] = e

    joined = threading.Thread(target=engine, args=(1,), daemon=True)
    joined.start()
    group = WeightUpdateGroup("127.0.0.1", port, 0, 2, "armor_weights", "gloo", timeout=30)
    sent = torch.arange(4, dtype=torch.bfloat16)
    group.broadcast(sent)
    joined.join(60)
    group.destroy()
    assert isinstance(received.get(1), torch.Tensor), received.get(1, "the engine never joined")
    assert torch.equal(received[1], sent)
