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
    import pickle

    obj = pickle.loads(base64.b64decode(tensor_payload.serialize(named)))
    assert obj["flattened_tensor"].shape == (8,)
    m = obj["metadata"][1]
    assert (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) == ("b", (2,), torch.float32, 6, 8, 2)


def test_mixed_dtypes_cannot_be_flattened():
    with pytest.raises(ValueError, match="one dtype"):
        tensor_payload.serialize([("a", torch.zeros(1)), ("b", torch.zeros(1, dtype=torch.int64))])
