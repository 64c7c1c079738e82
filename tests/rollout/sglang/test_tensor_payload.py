import pytest
import torch

from armor_megatron.rollout.sglang import tensor_payload


def test_buckets_respect_size_and_never_mix_dtypes():
    named = [
        ("a", torch.zeros(4)),  # 16 B
        ("b", torch.zeros(4)),  # 16 B -> a+b = 32 B fits a 40 B bucket
        ("c", torch.zeros(4)),  # would make 48 B: new bucket
        ("d", torch.zeros(4, dtype=torch.bfloat16)),  # other dtype: new bucket
        ("e", torch.zeros(100)),  # larger than a bucket: alone
    ]
    got = [[n for n, _ in b] for b in tensor_payload.buckets(named, bucket_bytes=40)]
    assert got == [["a", "b"], ["c"], ["d"], ["e"]]


@pytest.mark.parametrize("load_format", [tensor_payload.FLATTENED_BUCKET, None])
def test_round_trip(load_format):
    named = [("w", torch.arange(6.0).reshape(2, 3)), ("b", torch.tensor([7.0, 8.0]))]
    payload = tensor_payload.serialize(named, load_format)
    assert isinstance(payload, str)  # base64 text, as sent in JSON
    back = tensor_payload.deserialize(payload, load_format)
    assert [n for n, _ in back] == ["w", "b"]
    for (_, t), (_, u) in zip(named, back):
        assert torch.equal(t, u) and t.shape == u.shape


def test_flattened_metadata_has_sglang_fields():
    named = [("w", torch.zeros(2, 3)), ("b", torch.zeros(2))]
    import base64

    obj = tensor_payload.restricted_loads(base64.b64decode(tensor_payload.serialize(named)))
    assert obj["flattened_tensor"].shape == (8,)
    m = obj["metadata"][1]
    assert (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) == ("b", (2,), torch.float32, 6, 8, 2)


def test_mixed_dtypes_cannot_be_flattened():
    with pytest.raises(ValueError, match="one dtype"):
        tensor_payload.serialize([("a", torch.zeros(1)), ("b", torch.zeros(1, dtype=torch.int64))])


def _globals_named(payload: str) -> set:
    """Every (module, name) the payload's pickle asks its unpickler to import (recorded, not checked)."""
    import base64
    import io
    import pickle

    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            if module == tensor_payload.SGLANG_METADATA_MODULE:
                return tensor_payload.FlattenedTensorMetadata
            return super().find_class(module, name)

    Recorder(io.BytesIO(base64.b64decode(payload))).load()
    return found


def test_flattened_payload_names_only_classes_sglangs_unpickler_admits():
    # SGLang 0.5.x unpickles payloads with SafeUnpickler (sglang/srt/utils/common.py): module
    # prefixes builtins, collections, torch, sglang.srt.weight_sync.tensor_bucket, ... only.
    named = [("w", torch.zeros(2, 3)), ("b", torch.zeros(2))]
    names = _globals_named(tensor_payload.serialize(named))
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in names
    assert not [n for n in names if n[0].startswith("armor_megatron")]
    assert all(tensor_payload.sglang_admits(module, name) for module, name in names)


def test_a_by_value_payload_carries_the_bytes_themselves_under_sglangs_allowlist():
    # for /load_lora_adapter_from_tensors: the tensors' bytes, which any process can read (no fd or IPC
    # handle of the sender's), as torch.storage._load_from_bytes, which SGLang loads with weights_only
    named = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4))]
    payload = tensor_payload.serialize_by_value(named)
    names = _globals_named(payload)
    assert ("torch.storage", "_load_from_bytes") in names
    assert not [n for n in names if n[0] == "torch.multiprocessing.reductions"]
    assert all(tensor_payload.sglang_admits(module, name) for module, name in names)
    back = dict(tensor_payload.deserialize(payload, tensor_payload.FLATTENED_BUCKET))
    assert torch.equal(back["a"], named[0][1]) and torch.equal(back["b"], named[1][1])
    big = torch.zeros(4000)  # one tensor, a view: a copy goes, not the 16 KB storage it views
    assert len(tensor_payload.serialize_by_value([("v", big[:6])])) < 2000


def test_restricted_unpickler_refuses_classes_outside_sglangs_allowlist():
    import base64
    import pickle

    outsider = base64.b64encode(pickle.dumps(tensor_payload.FlattenedTensorMetadata("w", (1,), None, 0, 1, 1))).decode()
    with pytest.raises(pickle.UnpicklingError, match="armor_megatron.rollout.sglang.tensor_payload"):
        tensor_payload.deserialize(outsider, None)
    # SGLang 0.5.23's list is exact pairs: callables of admitted modules stay out
    for module, name in [("builtins", "print"), ("builtins", "eval"), ("os", "system"), ("torch", "load")]:
        assert not tensor_payload.sglang_admits(module, name)
        with pytest.raises(pickle.UnpicklingError, match=f"refuses .*{name}"):
            tensor_payload.restricted_loads(pickle.dumps(getattr(__import__(module), name)))


def test_cuda_handles_name_their_gpu_by_uuid_and_receivers_map_it_back(monkeypatch):
    # torch's CUDA IPC handle carries the sender's device index (argument 6 of
    # rebuild_cuda_tensor); an engine with another CUDA_VISIBLE_DEVICES must get the GPU's UUID
    from torch.multiprocessing import reductions

    uuids = {0: "GPU-aaaa", 1: "GPU-bbbb", 2: "GPU-cccc"}
    monkeypatch.setattr(tensor_payload, "gpu_uuid", lambda index: uuids[index])
    handle = tuple(range(6)) + (2,) + ("rest",)
    reduce = tensor_payload._naming_gpus_by_uuid(lambda obj: (reductions.rebuild_cuda_tensor, handle))
    rebuild, args = reduce(object())
    assert rebuild is reductions.rebuild_cuda_tensor and args == tuple(range(6)) + ("GPU-cccc", "rest")
    cpu = tensor_payload._naming_gpus_by_uuid(lambda obj: (reductions.rebuild_tensor, (1, 2, 3, 4, 5, 6, 7)))
    assert cpu(object())[1] == (1, 2, 3, 4, 5, 6, 7)  # not a CUDA handle: untouched

    # the receiver sees the same GPUs in another order: the UUID picks its own index
    receiver = {0: "GPU-cccc", 1: "GPU-aaaa"}
    monkeypatch.setattr(tensor_payload, "gpu_uuid", lambda index: receiver[index])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    rebuilt = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *a: rebuilt.append(a) or "tensor")
    assert tensor_payload._rebuild_cuda_tensor_on_uuid(*args) == "tensor"
    assert rebuilt[-1][6] == 0 and rebuilt[-1][7] == "rest"
    tensor_payload._rebuild_cuda_tensor_on_uuid(*handle)  # an index (an unpatched sender) passes as it is
    assert rebuilt[-1][6] == 2
    with pytest.raises(Exception, match="GPU-bbbb is not visible"):
        tensor_payload._rebuild_cuda_tensor_on_uuid(*(tuple(range(6)) + ("GPU-bbbb",)))
