"""Weight sync from a sharded Megatron model straight into SGLang engines (the TEST DOUBLE on
loopback, run in this test's process): each owner rank delivers its own share (``tensor``: posts
its buckets; ``disk``: writes its own safetensors files; ``distributed``: broadcasts them over a
weights update group of its own, which the double joins as SGLang does). The engine must end
with exactly the trainer's tensors, and a second export gathered on rank 0 must give the same
tensors."""

import json
import os
import time

import pytest
import torch
from safetensors import safe_open

from tests.convert.conftest import save_tiny_model
from tests.megatron.spawn import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def sync_worker(rank, hf_dir, mcore_dir, layout, url, mode, disk_dir, nodes=1, update_groups="stage"):
    """Load the trainer's weights at ``layout``, push them to the engine at ``url`` with ``mode``,
    then gather a second export on rank 0 (the old path, still what local engines read).
    ``nodes`` > 1: the launcher's environment says the ranks span that many nodes."""
    from armor_megatron.megatron.weight_export import HFWeightExport
    from armor_megatron.rollout.sglang.weight_sync import trainer_on_one_node
    from tests.megatron.test_weight_export import loaded_model

    os.environ["LOCAL_WORLD_SIZE"] = str(int(os.environ["WORLD_SIZE"]) // nodes)
    assert trainer_on_one_node() == (nodes == 1)

    arch, _, chunks = loaded_model(hf_dir, mcore_dir, layout)
    export = HFWeightExport(chunks, arch, bucket_bytes=8 << 10)  # many buckets per stage
    with _counting_rank0_transfers() as through_rank0:
        if rank != 0:
            assert list(export) == []  # takes part in rank 0's delivery
        else:
            engine = _push(export, url, mode, disk_dir, hf_dir, update_groups)
    if rank != 0:
        assert list(HFWeightExport(chunks, arch)) == []
        return {"owned": _owned_names(chunks, arch), "through_rank0": through_rank0}
    gathered = list(HFWeightExport(chunks, arch))
    engine.shutdown()
    return {"owned": _owned_names(chunks, arch), "through_rank0": through_rank0, "gathered": gathered}


def _owned_names(chunks, arch) -> list[str]:
    from armor_megatron.megatron.weight_export import _owns, _plan

    return [n for p in _plan(chunks, arch) if _owns(p.expert) for piece in p.pieces for n in piece.ref.hf_names]


class _counting_rank0_transfers:
    """Counts the buckets this rank sends to or receives from rank 0 (the gathered path's raw sends)."""

    def __enter__(self):
        from armor_megatron.megatron import weight_export

        self.module, self.counts = weight_export, {"sent": 0, "received": 0}
        self.saved = weight_export._send_bucket, weight_export._receive_bucket

        def send(bucket, dst):
            self.counts["sent"] += bool(bucket)
            return self.saved[0](bucket, dst)

        def receive(src):
            for item in self.saved[1](src):
                self.counts["received"] += 1
                yield item

        weight_export._send_bucket, weight_export._receive_bucket = send, receive
        return self.counts

    def __exit__(self, *exc):
        self.module._send_bucket, self.module._receive_bucket = self.saved


def _push(export, url, mode, disk_dir, hf_dir, update_groups="stage"):
    from armor_megatron.megatron.collective_export import ExportReadError
    from armor_megatron.rollout.sglang.engine import SGLangEngine
    from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig

    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_config = json.load(f)
    sync = WeightSyncConfig(
        mode=mode,
        bucket_bytes=16 << 10,
        disk_dir=disk_dir,
        hf_config=hf_config,
        backend="gloo",
        timeout=120,
        update_groups=update_groups,
    )
    engine = SGLangEngine([url], weight_sync=sync, request_timeout=120)
    engine.update_weights(export, "synced")
    assert export.finished
    with pytest.raises(ExportReadError, match="already"):  # read once
        iter(export)
    return engine


def _served(server) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in server.engine.model.state_dict().items()}


@pytest.mark.parametrize(
    "family, layout, world, mode, writers",
    [
        ("qwen3", dict(tp=2, pp=2), 4, "tensor", None),
        ("qwen3", dict(tp=2, pp=2), 4, "tensor-2-nodes", None),  # gathered on rank 0 (no IPC across nodes)
        ("qwen3", dict(tp=2, pp=2), 4, "disk", {0, 2}),  # one owner per pipeline stage
        ("qwen3", dict(tp=2, pp=2), 4, "distributed", {0, 2}),  # one group per pipeline stage's owner
        ("qwen3_moe", dict(ep=2), 2, "disk", {0, 1}),  # rank 1 owns the experts of ep rank 1
        ("qwen3_moe", dict(ep=2), 2, "distributed-owner", {0, 1}),
        ("qwen3_moe", dict(ep=2, pp=2), 4, "disk", {0, 1, 2, 3}),
    ],
    ids=[
        "qwen3-tp2pp2-tensor",
        "qwen3-tp2pp2-tensor-2-nodes",
        "qwen3-tp2pp2-disk",
        "qwen3-tp2pp2-distributed",
        "moe-ep2-disk",
        "moe-ep2-distributed-owner",
        "moe-ep2pp2-disk",
    ],
)
def test_engine_ends_with_exactly_the_trainers_tensors(tmp_path, family, layout, world, mode, writers):
    from armor_megatron.convert import convert_hf_to_mcore
    from armor_megatron.rollout.hf_checkpoint import read_hf_checkpoint
    from armor_megatron.rollout.local import LocalEngine
    from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

    engine_dir = save_tiny_model(family, str(tmp_path / "engine"), seed=1)  # what the engine holds first
    trainer_dir = save_tiny_model(family, str(tmp_path / "trainer"), seed=2)
    convert_hf_to_mcore(trainer_dir, str(tmp_path / "mcore"), progress_stream=None)
    expected = hf_tensors(trainer_dir)
    disk_dir = str(tmp_path / "sync" / "policy")
    with SGLangTestServer(LocalEngine.from_pretrained(engine_dir, weight_version="v0"), model_path=engine_dir) as s:
        assert any(not torch.equal(_served(s)[n], t) for n, t in expected.items() if n in _served(s))
        nodes = 2 if mode.endswith("2-nodes") else 1
        update_groups = "owner" if mode.endswith("-owner") else "stage"
        mode = mode.split("-")[0]
        results = run_ranks(
            sync_worker,
            world,
            trainer_dir,
            str(tmp_path / "mcore"),
            layout,
            s.url,
            mode,
            disk_dir,
            nodes,
            update_groups,
        )
        served = _served(s)
        assert s.engine.weight_version == "synced"
        requests = dict(s.requests)
        updates = list(s.distributed_updates)
    gathered = results[0]["gathered"]
    assert sorted(n for n, _ in gathered) == sorted(expected)
    for name, tensor in gathered:
        assert torch.equal(tensor, expected[name]), name
    if mode == "disk":
        written = dict(read_hf_checkpoint(disk_dir))
        assert written.keys() == expected.keys()
        for name, tensor in written.items():
            assert torch.equal(tensor, expected[name]), name
        files = sorted(f for f in os.listdir(disk_dir) if f.endswith(".safetensors"))
        assert {f.split("-")[1] for f in files} == {f"rank{r:05d}" for r in writers}  # each owner its own files
        assert os.listdir(os.path.dirname(disk_dir)) == ["policy"]  # no staging directory left
    for name, tensor in expected.items():
        if name in served:  # the double fuses MoE experts in memory (transformers 5); checked on disk above
            assert torch.equal(served[name], tensor.to(served[name].dtype)), name
    if mode == "tensor":
        assert requests["/update_weights_from_tensor"] > 4 and requests["/begin_weight_update"] == 1
    if mode == "distributed":
        # every owner is its stage's only one, or the groups are per owner: each broadcast exactly its
        # own tensors over its own group; nothing went through rank 0
        by_rank = {}
        for group, names in updates:
            by_rank.setdefault(int(group.split("-rank")[1].split("-")[0]), []).extend(names)
        owned = {r: sorted(res["owned"]) for r, res in enumerate(results) if res["owned"]}
        assert set(owned) == writers
        assert {r: sorted(n) for r, n in by_rank.items()} == owned
        assert len({group for group, _ in updates}) == len(writers)  # one group per owner
        assert all(res["through_rank0"] == {"sent": 0, "received": 0} for res in results)
        assert len(updates) > 2 * len(writers) and requests["/begin_weight_update"] == 1


def test_update_groups_per_stage_and_per_owner_deliver_the_same_tensors_bit_for_bit(tmp_path):
    """pp=2 x ep=2 (4 ranks, one owner each): per stage the engine joins pp = 2 groups, each stage's
    sender broadcasting its expert peer's buckets after its own; per owner it joins 4. Either way
    the engine receives exactly the trainer's tensors, the same names with the same bytes."""
    from armor_megatron.convert import convert_hf_to_mcore
    from armor_megatron.rollout.local import LocalEngine
    from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

    engine_dir = save_tiny_model("qwen3_moe", str(tmp_path / "engine"), seed=1)
    trainer_dir = save_tiny_model("qwen3_moe", str(tmp_path / "trainer"), seed=2)
    convert_hf_to_mcore(trainer_dir, str(tmp_path / "mcore"), progress_stream=None)
    expected = hf_tensors(trainer_dir)
    received, groups, owned, requests = {}, {}, {}, {}
    for layout in ("stage", "owner"):
        with SGLangTestServer(LocalEngine.from_pretrained(engine_dir, weight_version="v0"), model_path=engine_dir) as s:
            results = run_ranks(
                sync_worker, 4, trainer_dir, str(tmp_path / "mcore"), dict(ep=2, pp=2), s.url, "distributed",
                None, 1, layout, timeout=380,
            )  # fmt: skip
            assert s.engine.weight_version == "synced"
            received[layout] = dict(s.distributed_tensors)
            groups[layout] = {}
            requests[layout] = [names for _, names in s.distributed_updates]
            for group, names in s.distributed_updates:
                groups[layout].setdefault(int(group.split("-rank")[1].split("-")[0]), []).extend(names)
            owned[layout] = {r: set(res["owned"]) for r, res in enumerate(results)}
    for layout in ("stage", "owner"):
        assert sorted(received[layout]) == sorted(expected), layout
        for name, tensor in expected.items():
            got = received[layout][name]
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), (layout, name)
    assert owned["stage"] == owned["owner"] and all(owned["stage"].values())  # every rank owns experts
    mine = owned["stage"]
    # per owner: 4 groups, each its owner's tensors; per stage: 2 groups, a stage's sender (its lowest
    # rank) carrying its own tensors and then its expert peer's
    assert {r: set(n) for r, n in groups["owner"].items()} == mine
    assert {r: set(n) for r, n in groups["stage"].items()} == {0: mine[0] | mine[1], 2: mine[2] | mine[3]}
    # each request carries one owner's bucket (a peer's goes over whole, after its sender's own)
    owner_of = {n: r for r, names in mine.items() for n in names}
    assert all(len({owner_of[n] for n in names}) == 1 for names in requests["stage"])
    assert sorted(map(sorted, requests["stage"])) == sorted(map(sorted, requests["owner"]))


def failing_sink_worker(rank, hf_dir, mcore_dir, url, mode, layout):
    """The engine refuses one request: every rank must raise."""
    from armor_megatron.megatron.weight_export import HFWeightExport
    from armor_megatron.rollout.engine import WeightUpdateError
    from tests.megatron.test_weight_export import loaded_model

    arch, _, chunks = loaded_model(hf_dir, mcore_dir, layout)
    export = HFWeightExport(chunks, arch, bucket_bytes=8 << 10)
    with pytest.raises(WeightUpdateError) as failed:
        if rank == 0:
            from armor_megatron.rollout.sglang.engine import SGLangEngine
            from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig

            sync = WeightSyncConfig(mode=mode, bucket_bytes=16 << 10, backend="gloo", timeout=300)
            engine = SGLangEngine([url], weight_sync=sync, request_timeout=300)
            engine.update_weights(export, "synced")
        else:
            list(export)
    return str(failed.value)


@pytest.mark.parametrize(
    "family, layout, mode, path",
    [
        ("qwen3", dict(tp=2, pp=2), "tensor", "/update_weights_from_tensor"),
        ("qwen3", dict(tp=2, pp=2), "distributed", "/update_weights_from_distributed"),
        # per stage: rank 1's and 3's buckets are being handed to their stage's sender when it fails
        ("qwen3_moe", dict(ep=2, pp=2), "distributed", "/update_weights_from_distributed"),
    ],
    ids=["qwen3-tp2pp2-tensor", "qwen3-tp2pp2-distributed", "moe-ep2pp2-distributed"],
)
def test_a_failed_delivery_fails_every_rank_and_closes_the_session(tmp_path, family, layout, mode, path):
    from armor_megatron.convert import convert_hf_to_mcore
    from armor_megatron.rollout.local import LocalEngine
    from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

    trainer_dir = save_tiny_model(family, str(tmp_path / "trainer"), seed=2)
    convert_hf_to_mcore(trainer_dir, str(tmp_path / "mcore"), progress_stream=None)
    with SGLangTestServer(LocalEngine.from_pretrained(trainer_dir, weight_version="v0"), model_path=trainer_dir) as s:
        s.inject_failures(path, 1, status=400)
        start = time.monotonic()
        errors = run_ranks(
            failing_sink_worker, 4, trainer_dir, str(tmp_path / "mcore"), s.url, mode, layout, timeout=380
        )
        # an owner left waiting in a broadcast hears of the refusal, not of the 300 s group timeout
        assert time.monotonic() - start < 200
        assert s.engine.weight_version == "v0"
        assert s.requests["/end_weight_update"] == s.requests["/begin_weight_update"] + 1  # + start-up clearing
    assert all(e.startswith("weight delivery failed: rank ") and "HTTP 400" in e for e in errors), errors


def test_trainer_on_one_node_reads_the_launchers_environment():
    from armor_megatron.rollout.sglang.weight_sync import trainer_on_one_node

    assert trainer_on_one_node({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})
    assert not trainer_on_one_node({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert not trainer_on_one_node({"WORLD_SIZE": "4"})  # unknown: assume spread
    assert trainer_on_one_node({"SLURM_NTASKS": "8", "SLURM_JOB_NUM_NODES": "1"})
    assert not trainer_on_one_node({"SLURM_NTASKS": "16", "SLURM_NNODES": "2"})
    assert trainer_on_one_node({})
