"""Tensor-parallel split / gather on hand-made tensors (the Megatron parity test checks the
same functions against a real TP=2 model)."""

import pytest
import torch

from armor_megatron.convert import tensor_rules, tp_gather, tp_split
from tests.convert.test_rules import TINY, rule


def test_qkv_splits_whole_query_groups():
    qkv = rule(TINY, "decoder.layers.self_attention.linear_qkv.weight")
    fused = torch.tensor([0.0, 1, 10, 20, 2, 3, 11, 21]).reshape(8, 1)  # [group 0 | group 1]
    ranks = tp_split(TINY, qkv, fused, 2)
    assert [r.flatten().tolist() for r in ranks] == [[0, 1, 10, 20], [2, 3, 11, 21]]
    assert torch.equal(tp_gather(TINY, qkv, ranks), fused)


def test_fc1_each_rank_holds_gate_shard_then_up_shard():
    fc1 = rule(TINY, "decoder.layers.mlp.linear_fc1.weight")
    fused = torch.tensor([1.0, 2, 3, 4]).reshape(4, 1)  # gate = [1, 2], up = [3, 4]
    ranks = tp_split(TINY, fc1, fused, 2)
    assert [r.flatten().tolist() for r in ranks] == [[1, 3], [2, 4]]
    assert torch.equal(tp_gather(TINY, fc1, ranks), fused)


def test_row_parallel_splits_the_input_dim_and_norms_replicate():
    proj = rule(TINY, "decoder.layers.self_attention.linear_proj.weight")
    w = torch.tensor([[1.0, 2, 3, 4]])  # [h=1, nq·d=4]
    assert [r.tolist() for r in tp_split(TINY, proj, w, 2)] == [[[1, 2]], [[3, 4]]]
    norm = rule(TINY, "decoder.final_layernorm.weight")
    assert all(r is w for r in tp_split(TINY, norm, w, 3))


@pytest.mark.parametrize("tp", [1, 2])
def test_gather_inverts_split_for_every_rule(tp):
    gen = torch.Generator().manual_seed(0)
    for r in tensor_rules(TINY):
        full = torch.randn(r.shape, generator=gen)
        assert torch.equal(tp_gather(TINY, r, tp_split(TINY, r, full, tp)), full), r.ckpt_key


@pytest.mark.parametrize(
    "key, tp, message",
    [
        ("decoder.layers.self_attention.linear_qkv.weight", 4, "num_key_value_heads=2 is not divisible by tp=4"),
        ("embedding.word_embeddings.weight", 3, "vocab_size=8 is not divisible by tp=3"),
        ("decoder.layers.mlp.linear_fc1.weight", 4, "ffn hidden size=2 is not divisible by tp=4"),
    ],
)
def test_indivisible_sizes_raise_one_clear_line(key, tp, message):
    r = rule(TINY, key)
    with pytest.raises(ValueError, match=message):
        tp_split(TINY, r, torch.zeros(r.shape), tp)
