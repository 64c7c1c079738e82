"""HF -> Megatron torch_dist -> HF is bit-identical for every family (and for bf16)."""

import json
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from armor_megatron.convert import convert_hf_to_mcore, convert_mcore_to_hf
from armor_megatron.convert.hf_io import INDEX_FILE, HFCheckpoint, TensorDigest
from armor_megatron.convert.output import HF_FILES_DIR, METADATA_FILE
from armor_megatron.convert.verify import compare_tensors
from tests.convert.conftest import FAMILIES, save_tiny_model


def round_trip(hf_dir, tmp_path, **kwargs):
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    first = convert_hf_to_mcore(hf_dir, str(mcore), progress_stream=None)
    second = convert_mcore_to_hf(str(mcore), str(back), progress_stream=None, **kwargs)
    return mcore, back, first, second


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_is_bit_identical(family, tiny_models, tmp_path):
    hf_dir = tiny_models[family]
    source = HFCheckpoint(hf_dir)
    # a 60 kB shard cap forces several shards and an index
    mcore, back, first, second = round_trip(hf_dir, tmp_path, max_shard_bytes=60_000)
    compared, mismatched = compare_tensors(source, HFCheckpoint(str(back)))
    assert mismatched == [] and compared == len(source.tensors)
    assert first.tensors == second.tensors == len(source.tensors) and first.bytes == second.bytes
    assert os.path.isfile(back / INDEX_FILE) and len([f for f in os.listdir(back) if f.endswith(".safetensors")]) > 1
    for side in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(mcore / HF_FILES_DIR / side) and os.path.isfile(back / side), side

    meta = json.loads((mcore / METADATA_FILE).read_text())
    digest = TensorDigest()
    digest.update([(name, source.read(name)) for name in source.tensors])
    assert meta["family"] == family and meta["source"]["tensors_checksum"] == digest.hexdigest()
    assert meta["hf_config"] == json.loads(open(os.path.join(hf_dir, "config.json")).read())


def test_round_trip_without_kernel_copies(tiny_models, tmp_path, monkeypatch):
    """File systems that refuse copy_file_range (EXDEV, EOPNOTSUPP...) get a buffered copy."""
    import errno

    def refuse(*args):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    hf_dir = tiny_models["qwen3"]
    _, back, _, _ = round_trip(hf_dir, tmp_path)
    compared, mismatched = compare_tensors(HFCheckpoint(hf_dir), HFCheckpoint(str(back)))
    assert mismatched == [] and compared == len(HFCheckpoint(hf_dir).tensors)


def test_output_loads_in_transformers_with_identical_logits(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_dir = tiny_models["qwen3_moe"]
    _, back, _, _ = round_trip(hf_dir, tmp_path, max_shard_bytes=100_000)
    tokens = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(hf_dir).eval()(tokens).logits
        actual = AutoModelForCausalLM.from_pretrained(str(back)).eval()(tokens).logits
    assert torch.equal(actual, expected)


def test_bf16_is_stored_as_bf16_and_round_trips(tmp_path):
    hf_dir = save_tiny_model("mixtral", str(tmp_path / "hf"), dtype=torch.bfloat16)
    mcore, back, _, _ = round_trip(hf_dir, tmp_path)
    stored = FileSystemReader(str(mcore)).read_metadata().state_dict_metadata
    assert stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"].properties.dtype == torch.bfloat16
    assert compare_tensors(HFCheckpoint(hf_dir), HFCheckpoint(str(back)))[1] == []
    assert os.listdir(back).count("model.safetensors") == 1  # under the default 5 GB cap: one file, no index


def test_checkpoint_holds_layers_stacked_at_global_shapes(tiny_models, tmp_path):
    mcore, _, _, _ = round_trip(tiny_models["qwen3_moe"], tmp_path)
    stored = FileSystemReader(str(mcore)).read_metadata().state_dict_metadata
    # qwen3_moe tiny: 2 layers, 4 experts, expert ffn 32, hidden 64, 4 q heads + 2·2 kv heads of 16
    assert tuple(stored["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (2, 4, 64, 64)
    assert tuple(stored["decoder.layers.self_attention.linear_qkv.weight"].size) == (2, (4 + 4) * 16, 64)
    assert tuple(stored["decoder.layers.pre_mlp_layernorm.weight"].size) == (2, 64)
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4" in stored
