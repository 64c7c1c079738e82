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


# ---------------------------------------------------------------------- files from elsewhere
def _rewrite_header(path, change):
    """Rewrite a safetensors file's header with ``change(header)`` applied, its data bytes kept."""
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header, data = json.loads(f.read(n)), f.read()
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _sharded_copy(tiny_models, tmp_path):
    """The tiny llama with an index naming its one shard (so the index can be made to lie)."""
    import shutil

    hf = shutil.copytree(tiny_models["llama"], tmp_path / "hf")
    os.rename(hf / "model.safetensors", hf / "model-00001-of-00001.safetensors")
    names = load_file(hf / "model-00001-of-00001.safetensors").keys()
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}
    (hf / INDEX_FILE).write_text(json.dumps(index))
    return hf


@pytest.mark.parametrize("shard", ["../outside.safetensors", "../../etc/passwd", "/etc/passwd", "link.safetensors"])
def test_index_shard_names_stay_inside_the_model_directory(tiny_models, tmp_path, capsys, shard):
    """An index naming a shard outside its directory (an outside copy of real weights included, so
    nothing but the path is wrong; a link inside pointing out too) is refused by the converter, the
    trainer's HF reader and the rollout side's loaders, in one line naming the index and the name."""
    import shutil

    from armor_megatron.cli.convert import main
    from armor_megatron.confined import PathEscapeError
    from armor_megatron.convert.hf_io import HFCheckpoint
    from armor_megatron.rollout.hf_checkpoint import build_causal_lm, load_through_transformers

    hf = _sharded_copy(tiny_models, tmp_path)
    shutil.copy(hf / "model-00001-of-00001.safetensors", tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", hf / "link.safetensors")
    index = json.loads((hf / INDEX_FILE).read_text())
    index["weight_map"] = dict.fromkeys(index["weight_map"], shard)
    (hf / INDEX_FILE).write_text(json.dumps(index))
    line = f"{hf / INDEX_FILE}: names {shard!r}, which lies outside {hf}; refusing to read it"
    with pytest.raises(PathEscapeError) as err:
        HFCheckpoint(str(hf))
    assert str(err.value) == line
    assert main(["hf-to-mcore", str(hf), str(tmp_path / "out"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"armor-convert: error: {line}\n"
    config = json.loads((hf / "config.json").read_text())
    with pytest.raises(PathEscapeError, match="lies outside"):
        load_through_transformers(build_causal_lm(config), str(hf), config)


def test_a_shard_linked_from_outside_the_directory_is_refused_by_the_rollout_reader(tiny_models, tmp_path):
    import shutil

    from armor_megatron.confined import PathEscapeError
    from armor_megatron.rollout.hf_checkpoint import read_hf_checkpoint

    hf = shutil.copytree(tiny_models["llama"], tmp_path / "hf")
    os.rename(hf / "model.safetensors", tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", hf / "model.safetensors")
    with pytest.raises(PathEscapeError, match=r"names 'model.safetensors', which lies outside"):
        list(read_hf_checkpoint(str(hf), keys_only=True))


def test_a_hub_cache_snapshot_whose_files_link_to_its_blobs_is_read(tiny_models, tmp_path):
    """The one legitimate outside link: the hub cache's snapshots/<rev>/ files point to ../../blobs/."""
    from armor_megatron.convert.hf_io import HFCheckpoint
    from armor_megatron.rollout.hf_checkpoint import read_hf_checkpoint

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for name in os.listdir(tiny_models["llama"]):
        blob = blobs / f"sha-{name}"
        blob.write_bytes(open(os.path.join(tiny_models["llama"], name), "rb").read())
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / name)
    with HFCheckpoint(str(snapshot)) as hf:
        assert hf.tensors
    assert len(list(read_hf_checkpoint(str(snapshot), keys_only=True))) == len(hf.tensors)


def _set_dtype(name, code):
    def change(header):
        header[name]["dtype"] = code

    return change


def test_a_header_with_an_integer_dtype_for_a_float_weight_is_refused(tiny_models, tmp_path, capsys):
    """I32 is F32's size: safetensors itself accepts the file, and the run trained on garbage."""
    import shutil

    from armor_megatron.cli.convert import main
    from armor_megatron.convert.hf_io import HFCheckpoint
    from armor_megatron.rollout.hf_checkpoint import read_hf_checkpoint

    hf = shutil.copytree(tiny_models["llama"], tmp_path / "hf")
    _rewrite_header(hf / "model.safetensors", _set_dtype("model.layers.0.mlp.up_proj.weight", "I32"))
    assert "model.layers.0.mlp.up_proj.weight" in load_file(hf / "model.safetensors")  # safetensors accepts it
    line = (
        f"{hf}/model.safetensors: tensor model.layers.0.mlp.up_proj.weight is stored as I32, "
        "expected F32 (the config's torch_dtype)"
    )
    with pytest.raises(CheckpointError) as err:
        HFCheckpoint(str(hf))
    assert str(err.value) == line
    assert main(["hf-to-mcore", str(hf), str(tmp_path / "out"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"armor-convert: error: {line}\n"
    with pytest.raises(CheckpointError, match="stored as I32"):
        list(read_hf_checkpoint(str(hf), keys_only=True))


@pytest.mark.parametrize(
    "declared, stored, refused",
    [
        ("bfloat16", {"norm": "F32"}, None),  # fp32 norms in a bf16 checkpoint: common, accepted
        ("bfloat16", {"up": "F16"}, "stored as F16, expected BF16"),  # same size, other meaning
        ("float32", {"up": "BF16"}, None),  # bf16 weights under a config saying float32: loadable as they are
        ("float16", {"up": "BF16"}, "stored as BF16, expected F16"),
        (None, {"up": "F16", "norm": "F32"}, None),  # no torch_dtype: any float
        (None, {"up": "I16"}, "stored as I16, expected a floating dtype"),
        ("bfloat16", {"up": "U8"}, "stored as U8, expected BF16"),
    ],
)
def test_dtypes_are_checked_against_the_config(tmp_path, declared, stored, refused):
    from safetensors.torch import save_file

    from armor_megatron.convert.hf_io import declared_dtype, read_header

    codes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I16": torch.int16, "U8": torch.uint8}
    tensors = {name: torch.zeros(4, 4, dtype=codes[code]) for name, code in stored.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"torch_dtype": declared} if declared else {}
    if refused is None:
        assert read_header(str(tmp_path / "model.safetensors"), declared_dtype(config)).keys() == tensors.keys()
    else:
        with pytest.raises(CheckpointError, match=refused):
            read_header(str(tmp_path / "model.safetensors"), declared_dtype(config))


def test_a_header_whose_byte_span_disagrees_with_its_shape_is_refused(tmp_path):
    from safetensors.torch import save_file

    from armor_megatron.convert.hf_io import read_header

    save_file({"a": torch.zeros(4, 4), "b": torch.zeros(2)}, str(tmp_path / "m.safetensors"))

    def change(header):
        header["a"]["shape"] = [4, 2]  # 32 bytes of F32, but the span holds 64

    _rewrite_header(tmp_path / "m.safetensors", change)
    with pytest.raises(CheckpointError, match=r"tensor a spans 64 bytes, but F32 \[4, 2\] is 32 bytes$"):
        read_header(str(tmp_path / "m.safetensors"), torch.float32)
