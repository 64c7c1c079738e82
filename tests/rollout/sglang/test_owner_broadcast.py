"""Owners broadcasting their own buckets to several engines (the TEST DOUBLE, which joins each
group as SGLang 0.5.23 does and serves weight requests one at a time, in arrival order).

The steps are driven here as the Megatron export drives them (announce, join, then rounds of
describe / put), with two owner ranks on threads of this process and the owner-side delivery
unpickled from the driver's, as every trainer rank receives it."""

import contextlib
import pickle
import subprocess
import sys
import threading

import pytest
import torch

from armor_megatron.rollout.engine import WeightUpdateError
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import SGLangClient
from armor_megatron.rollout.sglang.owner_broadcast import OwnerBroadcastDelivery, OwnerGroups
from armor_megatron.rollout.sglang.weight_sync import _post
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import tiny_weights
from tests.processes import stopped_after

pytestmark = [pytest.mark.timeout(180), pytest.mark.double_only]


def _on_threads(fns):
    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def _deliver(delivery, shares: dict[int, list[list]]):
    """The export's coordinated steps for owners ``rank -> [bucket, ...]`` (rank 0: the driver's own)."""
    copy = pickle.loads(pickle.dumps(delivery))  # what the other ranks get
    sinks = {r: (delivery if r == 0 else copy).open(r) for r in shares}
    delivery.conduct_join({r: s.announce() for r, s in sinks.items()})
    _on_threads([s.join for s in sinks.values()])
    delivery.settle()
    rounds = max(len(b) for b in shares.values())
    try:
        for k in range(rounds):
            buckets = {r: b[k] for r, b in shares.items() if k < len(b)}
            delivery.conduct_bucket({r: sinks[r].describe(b) for r, b in buckets.items()}, last=k == rounds - 1)
            _on_threads([lambda r=r, b=b: sinks[r].put(b) for r, b in buckets.items()])
            delivery.settle()
    finally:
        delivery.shutdown()


def _delivery(clients, version, prefix):
    groups = OwnerGroups(prefix=prefix, engine_address="127.0.0.1", world_size=3, backend="gloo", timeout=60)
    return OwnerBroadcastDelivery(
        clients, groups, 1, 1 << 20, version, lambda client, path, body: _post(client, path, body, 60)
    )


def _sessions(clients, path):
    for c in clients:
        _post(c, path, {}, 30)


@contextlib.contextmanager
def _double_process(path):
    """The double as a process of its own, as an engine is (a process registers each group name
    once, so two engines joining one group cannot share a process)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "armor_megatron.rollout.testing.sglang_test_server",
            "--model-path",
            path,
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    with stopped_after(proc):
        line = proc.stdout.readline()
        assert "listening on " in line, line
        yield line.split("listening on ")[1].strip()


@pytest.mark.slow
def test_two_owners_reach_two_engines_each_over_its_own_group(tiny_ckpt):
    path, cfg, _ = tiny_ckpt
    with _double_process(path) as url:
        _two_owners_two_engines(path, cfg, url)


def _two_owners_two_engines(path, cfg, other_url):
    weights = tiny_weights(cfg, seed=3)
    # owner 0 the first half; owner 1 the rest, mixing bf16 and fp32 in one bucket (one request per dtype)
    half = len(weights) // 2
    mine = [weights[:2], weights[2:half]]
    rest = weights[half:]
    theirs = [[(n, t.to(torch.bfloat16) if i >= len(rest) // 2 else t) for i, (n, t) in enumerate(rest)]]
    cast = {n for n, t in theirs[0] if t.dtype == torch.bfloat16}
    server = SGLangTestServer(LocalEngine.from_pretrained(path), model_path=path).start()
    try:
        clients = [SGLangClient(server.url), SGLangClient(other_url)]
        delivery = _delivery(clients, "v1", "armor-two-owners")
        _sessions(clients, "/begin_weight_update")
        _deliver(delivery, {0: mine, 1: theirs})
        _sessions(clients, "/end_weight_update")
        assert delivery.version_sent
        owner_of = {n: 0 for b in mine for n, _ in b} | {n: 1 for b in theirs for n, _ in b}
        assert [c.weight_version() for c in clients] == ["v1", "v1"]
        served = server.engine.model.state_dict()
        for n, t in weights:
            assert torch.equal(served[n], t.to(torch.bfloat16).to(served[n].dtype) if n in cast else t), n
        groups = {}
        for group, names in server.distributed_updates:
            groups.setdefault(group, []).extend(names)
        assert len(groups) == 2  # one group per owner, each carrying that owner's tensors only
        for group, names in groups.items():
            assert {owner_of[n] for n in names} == {int(group.split("-rank")[1].split("-")[0])}
        # the same requests in the same order on every engine
        assert clients[1].get("/test_double/distributed_updates") == [[g, n] for g, n in server.distributed_updates]
        assert len(server.distributed_updates) == 2 + 2  # two buckets; the mixed one split per dtype

        # the next sync reuses the groups: no new join
        again = _delivery(clients, "v2", "armor-two-owners")
        joins = server.requests["/init_weights_update_group"]
        _sessions(clients, "/begin_weight_update")
        _deliver(again, {0: mine, 1: theirs})
        _sessions(clients, "/end_weight_update")
        assert server.requests["/init_weights_update_group"] == joins == 2
        assert [c.weight_version() for c in clients] == ["v2", "v2"]
    finally:
        server.stop()


def test_a_refused_join_fails_the_waiting_owners_at_once(tiny_ckpt):
    path, cfg, _ = tiny_ckpt
    weights = tiny_weights(cfg, seed=3)
    server = SGLangTestServer(LocalEngine.from_pretrained(path), model_path=path).start()
    try:
        server.inject_failures("/init_weights_update_group", 1, status=400)
        client = SGLangClient(server.url)
        groups = OwnerGroups(prefix="armor-x", engine_address="127.0.0.1", world_size=2, backend="gloo", timeout=300)
        delivery = OwnerBroadcastDelivery([client], groups, 1, 1 << 20, "v1", lambda c, p, b: _post(c, p, b, 60))
        sink = delivery.open(0)
        delivery.conduct_join({0: sink.announce()})
        with pytest.raises(WeightUpdateError, match="engines did not join.*injected failure"):
            sink.join()  # told through its rendezvous store, long before the 300 s timeout
        with pytest.raises(WeightUpdateError, match="injected failure"):
            delivery.settle()
        delivery.shutdown()
        assert server.engine.weight_version != "v1" and weights
    finally:
        server.stop()
