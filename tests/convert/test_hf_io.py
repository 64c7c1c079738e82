"""Streaming safetensors writer and the lazy HF reader."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.hf_io import INDEX_FILE, PlannedTensor, SafetensorsWriter, TensorDigest, shard_plan


def planned(name, nbytes):
    return PlannedTensor(name, (nbytes,), torch.uint8)


def test_shard_plan_cuts_at_the_cap_and_gives_big_tensors_their_own_shard():
    shards = shard_plan([planned("a", 4), planned("b", 4), planned("c", 4), planned("big", 20), planned("d", 1)], 8)
    assert [[t.name for t in s] for s in shards] == [["a", "b"], ["c"], ["big"], ["d"]]


def test_writer_output_is_read_back_exactly_by_safetensors(tmp_path):
    tensors = {
        "x.bf16": torch.randn(3, 5).to(torch.bfloat16),
        "y.f32": torch.randn(7),
        "z.i64": torch.arange(4),
        "w.empty": torch.zeros(0, 3),
    }
    writer = SafetensorsWriter(
        str(tmp_path), [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], max_shard_bytes=40
    )
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        with open(tmp_path / shard, "rb") as f:
            assert int.from_bytes(f.read(8), "little") % 8 == 0  # header padded to 8 bytes
        loaded.update(load_file(str(tmp_path / shard)))
    assert set(loaded) == set(tensors) and len(set(index["weight_map"].values())) > 1
    assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_writer_refuses_undeclared_order_and_missing_tensors(tmp_path):
    writer = SafetensorsWriter(str(tmp_path), [planned("a", 2), planned("b", 2)], 100)
    with pytest.raises(RuntimeError, match="expected a"):
        writer.write("b", torch.zeros(2, dtype=torch.uint8))
    writer.write("a", torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="only 1 of 2"):
        writer.close()


def test_digest_ignores_order_but_not_content():
    a, b = torch.ones(3), torch.zeros(2)
    d1, d2, d3 = TensorDigest(), TensorDigest(), TensorDigest()
    d1.update([("a", a), ("b", b)])
    d2.update([("b", b)]), d2.update([("a", a)])
    d3.update([("a", a)]), d3.update([("b", torch.tensor([0.0, -0.0]))])  # -0.0 differs in bits
    assert d1.hexdigest() == d2.hexdigest() != d3.hexdigest()


def test_reader_names_a_truncated_shard(tiny_models, tmp_path):
    import shutil

    from armor_megatron.convert.hf_io import HFCheckpoint

    hf = shutil.copytree(tiny_models["llama"], tmp_path / "hf")
    os.truncate(hf / "model.safetensors", os.path.getsize(hf / "model.safetensors") - 100)
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable or truncated"):
        HFCheckpoint(str(hf))
