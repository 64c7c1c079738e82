import pytest
import torch

from armor_megatron.data.batch import RolloutBatch


def _batch(n=5, t=3, first=0, meta=None):
    return RolloutBatch(
        {"ids": torch.arange(first, first + n), "tokens": torch.arange(n * t).reshape(n, t)},
        {"text": [f"s{first + i}" for i in range(n)]},
        meta if meta is not None else {"step": 7},
    )


def test_fields_and_validation():
    b = _batch()
    assert len(b) == 5 and b.keys() == ["ids", "tokens", "text"] and "text" in b and b.meta == {"step": 7}
    b["reward"] = torch.ones(5)
    b["verdict"] = ["ok"] * 5
    with pytest.raises(ValueError, match="field 'bad' has 4 rows, the batch has 5"):
        b["bad"] = torch.ones(4)
    with pytest.raises(ValueError, match="'text' exists with the other kind"):
        b["text"] = torch.ones(5)
    with pytest.raises(ValueError, match="0-dim"):
        b["scalar"] = torch.tensor(1.0)
    with pytest.raises(KeyError, match="no field 'rewards'"):
        b["rewards"]
    with pytest.raises(ValueError, match="has 2 rows"):
        RolloutBatch({"a": torch.ones(3)}, {"b": [1, 2]})
    assert len(RolloutBatch()) == 0


def test_slice_index_select_keep_rows_aligned():
    b = _batch()
    s = b.slice(1, 3)
    assert s["ids"].tolist() == [1, 2] and s["text"] == ["s1", "s2"] and s["tokens"].tolist() == [[3, 4, 5], [6, 7, 8]]
    i = b.index([4, 0, 4])
    assert i["ids"].tolist() == [4, 0, 4] and i["text"] == ["s4", "s0", "s4"]
    m = b.select(torch.tensor([True, False, False, True, False]))
    assert m["ids"].tolist() == [0, 3] and m["text"] == ["s0", "s3"] and m.meta == {"step": 7}
    m.meta["step"] = 8
    assert b.meta["step"] == 7  # derived batches own their meta dict
    with pytest.raises(ValueError, match=r"bool mask of shape \(5,\)"):
        b.select(torch.tensor([1, 0, 0, 1, 0]))
    with pytest.raises(IndexError, match="5 rows"):
        b.index([5])


def test_split_chunk_repeat():
    b = _batch(n=5)
    assert [p["text"] for p in b.split(2)] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert [len(p) for p in b.chunk(3)] == [2, 2, 1]
    assert [len(p) for p in b.chunk(7)] == [1, 1, 1, 1, 1, 0, 0]
    assert RolloutBatch.concat(b.chunk(3))["ids"].tolist() == list(range(5))
    r = b.slice(0, 2).repeat_interleave(3)
    assert r["ids"].tolist() == [0, 0, 0, 1, 1, 1] and r["text"] == ["s0"] * 3 + ["s1"] * 3
    with pytest.raises(ValueError, match="parts >= 1"):
        b.chunk(0)


def test_concat_pads_ragged_tensors_and_merges_meta():
    a, b = _batch(n=2, t=2), _batch(n=1, t=4, first=2, meta={"step": 7, "weight_version": "v3"})
    out = RolloutBatch.concat([a, b], pad_values={"tokens": -1})
    assert out["tokens"].tolist() == [[0, 1, -1, -1], [2, 3, -1, -1], [0, 1, 2, 3]]
    assert out["text"] == ["s0", "s1", "s2"] and out.meta == {"step": 7, "weight_version": "v3"}
    with pytest.raises(ValueError, match=r"field 'tokens' has trailing shapes \[\(2,\), \(4,\)\]"):
        RolloutBatch.concat([a, b])
    with pytest.raises(ValueError, match="meta 'step' differs"):
        RolloutBatch.concat([a, _batch(n=1, t=2, meta={"step": 8})])
    with pytest.raises(ValueError, match="batch 1 has fields"):
        RolloutBatch.concat([a, RolloutBatch({"ids": torch.ones(1)})])


def test_to_device_keeps_objects():
    b = _batch().to("cpu")
    assert b["tokens"].device.type == "cpu" and b["text"][0] == "s0"
    if torch.cuda.is_available():
        assert _batch().to("cuda")["ids"].is_cuda
