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


def test_restricted_unpickler_refuses_classes_outside_sglangs_allowlist():
    import base64
    import pickle

    outsider = base64.b64encode(pickle.dumps(tensor_payload.FlattenedTensorMetadata("w", (1,), None, 0, 1, 1))).decode()
    with pytest.raises(pickle.UnpicklingError, match="armor_megatron.rollout.sglang.tensor_payload"):
        tensor_payload.deserialize(outsider, None)
    evil = base64.b64encode(pickle.dumps(print)).decode()  # builtins is admitted, eval/exec/compile are not
    assert tensor_payload.sglang_admits("builtins", "print")
    assert not tensor_payload.sglang_admits("builtins", "eval") and not tensor_payload.sglang_admits("os", "system")
    assert tensor_payload.restricted_loads(base64.b64decode(evil)) is print
