import json
import os

import pytest
import torch

from armor_megatron.rollout.hf_checkpoint import read_hf_checkpoint, write_hf_checkpoint


def test_write_shards_index_and_config_then_read_back(tmp_path):
    # 3 fp32 tensors of 64 B, 64 B and 128 B with 150 B shards -> shards {a, b} and {c}.
    named = [("a", torch.arange(16.0)), ("b", torch.ones(4, 4)), ("c", torch.zeros(32))]
    out = write_hf_checkpoint(str(tmp_path / "ckpt"), iter(named), {"model_type": "qwen2"}, max_shard_bytes=150)
    files = sorted(os.listdir(out))
    assert files == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert index["weight_map"] == {"a": files[1], "b": files[1], "c": files[2]}
    back = dict(read_hf_checkpoint(out))
    for name, t in named:
        assert torch.equal(back[name], t)


def test_rewrite_replaces_the_old_checkpoint_and_leaves_no_temporaries(tmp_path):
    target = str(tmp_path / "ckpt")
    write_hf_checkpoint(target, [("a", torch.zeros(2)), ("old", torch.zeros(1))], {"model_type": "qwen2"})
    write_hf_checkpoint(target, [("a", torch.ones(2))], {"model_type": "qwen2"})
    assert dict(read_hf_checkpoint(target)).keys() == {"a"}
    assert os.listdir(tmp_path) == ["ckpt"]


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path):
    target = str(tmp_path / "ckpt")
    write_hf_checkpoint(target, [("a", torch.zeros(2))], {"model_type": "qwen2"})
    with pytest.raises(ValueError, match="weight 'a' given twice"):
        write_hf_checkpoint(target, [("a", torch.ones(2)), ("a", torch.ones(2))], {"model_type": "qwen2"})
    assert torch.equal(dict(read_hf_checkpoint(target))["a"], torch.zeros(2))
    assert os.listdir(tmp_path) == ["ckpt"]
