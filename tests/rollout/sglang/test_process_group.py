"""The trainer's weights update group meets an engine that joins as SGLang does.

The engine end is the test double's, built like SGLang 0.5.23's ``init_custom_process_group``
(rendezvous, ``PrefixStore(group_name)``, torch's process-group helper), not from our class:
a difference in rendezvous keys times out here, as it would hang a real broadcast.

The trainer's end binds its rendezvous port before anyone is told it (``listen``): no port is
picked free, released and bound again later, so no other process can take it in between."""

import socket
import threading

import pytest
import torch

from armor_megatron.rollout.sglang.process_group import WeightUpdateGroup, address_towards, listen
from armor_megatron.rollout.testing.sglang_test_server import _join_weight_update_group


def _engine_end(port, rank, world, name, received):
    import torch.distributed as dist

    try:
        group = _join_weight_update_group("127.0.0.1", port, rank, world, name, "gloo", timeout=30)
        t = torch.zeros(4, dtype=torch.bfloat16)
        dist.broadcast(t, src=0, group=group)
        received[(name, rank)] = t
        dist.destroy_process_group(group)
    except Exception as e:  # noqa: BLE001 - reported by the assert below
        received[(name, rank)] = e


@pytest.mark.timeout(120)
def test_broadcast_reaches_an_engine_that_joins_as_sglang_does():
    store, received = listen(2, timeout=30), {}
    joined = threading.Thread(target=_engine_end, args=(store.port, 1, 2, "armor_weights", received), daemon=True)
    joined.start()
    group = WeightUpdateGroup("127.0.0.1", store.port, 0, 2, "armor_weights", "gloo", timeout=30, store=store)
    sent = torch.arange(4, dtype=torch.bfloat16)
    group.broadcast(sent)
    joined.join(60)
    group.destroy()
    got = received.get(("armor_weights", 1), "the engine never joined")
    assert isinstance(got, torch.Tensor), got
    assert torch.equal(got, sent)


@pytest.mark.timeout(120)
def test_one_engine_joins_groups_of_several_broadcasters_by_name():
    """Two trainer ranks, each rank 0 of its own group, reach the same engine ranks (SGLang keeps
    groups in a dict by name); each group carries only its own broadcaster's tensor."""
    stores = {name: listen(2, timeout=30) for name in ("owner-0", "owner-2")}
    received = {}
    engine = threading.Thread(
        target=lambda: [_engine_end(s.port, 1, 2, name, received) for name, s in stores.items()], daemon=True
    )
    engine.start()
    sent = {}
    for i, (name, store) in enumerate(stores.items()):
        group = WeightUpdateGroup("127.0.0.1", store.port, 0, 2, name, "gloo", timeout=30, store=store)
        sent[name] = torch.full((4,), float(i + 1), dtype=torch.bfloat16)
        group.broadcast(sent[name])
        group.destroy()
    engine.join(60)
    for name in stores:
        assert torch.equal(received[(name, 1)], sent[name]), received.get((name, 1))


def test_the_rendezvous_port_is_held_from_the_moment_it_is_picked():
    store = listen(2, timeout=5)
    with socket.socket() as s, pytest.raises(OSError):  # nobody else can bind it before the engines come
        s.bind(("", store.port))


def test_an_owner_answers_on_the_route_towards_the_engines():
    assert address_towards("127.0.0.1") == "127.0.0.1"
    assert address_towards("localhost") == "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: only the routing table is consulted
        except OSError:
            pytest.skip("no route off this host")
        expected = probe.getsockname()[0]
    assert address_towards("192.0.2.1") == expected


def test_rank_zero_alone_hosts_the_store():
    with pytest.raises(ValueError, match="only rank 0"):
        WeightUpdateGroup("127.0.0.1", 1, 1, 2, "g", "gloo", timeout=5, store=listen(2, timeout=5))
