"""Per-family rules: layouts on hand-made tensors, names in every spec, coverage of HF tensors."""

import pytest
import torch

from armor_megatron.convert import hf_shapes, hf_to_mcore, mcore_to_hf, mcore_to_hf_named, resolve_param, tensor_rules
from armor_megatron.models import ModelArch

# 4 query heads in 2 groups, head_dim 1, hidden 1: small enough to write the fused QKV by hand.
TINY = ModelArch(
    family="qwen2",
    vocab_size=8,
    hidden_size=1,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=1,
    ffn_hidden_size=2,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=16,
    qkv_bias=True,
)
MOE = ModelArch(
    family="mixtral",
    vocab_size=8,
    hidden_size=4,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=2,
    ffn_hidden_size=6,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=16,
    num_experts=3,
    moe_router_topk=1,
    moe_ffn_hidden_size=5,
)


def rule(arch, key):
    return next(r for r in tensor_rules(arch) if r.ckpt_key == key)


def test_qkv_interleaves_query_groups():
    qkv = rule(TINY, "decoder.layers.self_attention.linear_qkv.weight")
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # heads q0..q3; group 0 = q0,q1, group 1 = q2,q3
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = hf_to_mcore(TINY, qkv, [q, k, v])
    # per group: its q heads, then its k head, then its v head
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = mcore_to_hf(TINY, qkv, fused)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_bias_uses_the_same_order():
    bias = rule(TINY, "decoder.layers.self_attention.linear_qkv.bias")
    fused = hf_to_mcore(TINY, bias, [torch.tensor([0.0, 1, 2, 3]), torch.tensor([10.0, 11]), torch.tensor([20.0, 21])])
    assert fused.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_fc1_is_gate_then_up():
    fc1 = rule(TINY, "decoder.layers.mlp.linear_fc1.weight")
    gate, up = torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0], [4.0]])
    assert hf_to_mcore(TINY, fc1, [gate, up]).flatten().tolist() == [1, 2, 3, 4]
    assert [t.flatten().tolist() for t in mcore_to_hf(TINY, fc1, torch.tensor([[1.0], [2], [3], [4]]))] == [
        [1, 2],
        [3, 4],
    ]


def test_mcore_to_hf_rejects_wrong_shape():
    with pytest.raises(ValueError, match="linear_qkv.weight: shape"):
        mcore_to_hf(TINY, rule(TINY, "decoder.layers.self_attention.linear_qkv.weight"), torch.zeros(7, 1))


@pytest.mark.parametrize(
    "name, hf",
    [
        ("decoder.layers.1.input_layernorm.weight", ["model.layers.1.input_layernorm.weight"]),
        ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", ["model.layers.1.input_layernorm.weight"]),
        ("decoder.layers.0.pre_mlp_layernorm.weight", ["model.layers.0.post_attention_layernorm.weight"]),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", ["model.layers.0.post_attention_layernorm.weight"]),
        ("module.decoder.layers.0.mlp.linear_fc2.weight", ["model.layers.0.mlp.down_proj.weight"]),
        ("embedding.word_embeddings.weight", ["model.embed_tokens.weight"]),
        ("output_layer.weight", ["lm_head.weight"]),
    ],
)
def test_dense_names_local_and_te_spec(name, hf):
    assert resolve_param(TINY, name).hf_names == hf


@pytest.mark.parametrize(
    "name, layer, expert, hf",
    [
        (
            "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight",
            1,
            2,
            [
                "model.layers.1.block_sparse_moe.experts.2.w1.weight",
                "model.layers.1.block_sparse_moe.experts.2.w3.weight",
            ],
        ),
        (
            "decoder.layers.0.mlp.experts.linear_fc1.weight2",
            0,
            2,  # grouped GEMM naming
            [
                "model.layers.0.block_sparse_moe.experts.2.w1.weight",
                "model.layers.0.block_sparse_moe.experts.2.w3.weight",
            ],
        ),
        (
            "decoder.layers.0.mlp.experts.linear_fc2.weight1",
            0,
            1,
            ["model.layers.0.block_sparse_moe.experts.1.w2.weight"],
        ),
        ("decoder.layers.1.mlp.router.weight", 1, None, ["model.layers.1.block_sparse_moe.gate.weight"]),
    ],
)
def test_moe_names_sequential_and_grouped(name, layer, expert, hf):
    ref = resolve_param(MOE, name)
    assert (ref.layer, ref.expert, ref.hf_names) == (layer, expert, hf)


def test_mcore_to_hf_named_splits_a_gathered_parameter():
    fc1 = torch.arange(20.0).reshape(10, 2)[:, :1].repeat(1, 4)  # [2·5, 4]: gate rows 0-4, up rows 5-9
    named = dict(mcore_to_hf_named(MOE, "decoder.layers.0.mlp.experts.linear_fc1.weight0", fc1))
    assert torch.equal(named["model.layers.0.block_sparse_moe.experts.0.w1.weight"], fc1[:5])
    assert torch.equal(named["model.layers.0.block_sparse_moe.experts.0.w3.weight"], fc1[5:])


@pytest.mark.parametrize(
    "name",
    [
        "decoder.layers.2.mlp.router.weight",
        "decoder.layers.0.mlp.experts.linear_fc1.weight3",
        "decoder.layers.0.self_attention.linear_qkv.bias_x",
        "lm_head.weight",
    ],
)
def test_unknown_or_out_of_range_names_raise(name):
    with pytest.raises(KeyError):
        resolve_param(MOE, name)


def test_tied_embeddings_have_no_output_layer():
    tied = ModelArch(**{**TINY.__dict__, "tie_word_embeddings": True})
    assert "output_layer.weight" not in [r.ckpt_key for r in tensor_rules(tied)]


def test_hf_shapes_follow_gqa():
    qkv = rule(MOE, "decoder.layers.self_attention.linear_qkv.weight")
    assert qkv.shape == ((2 + 2 * 1) * 2, 4)
    assert hf_shapes(MOE, qkv) == [(4, 4), (2, 4), (2, 4)]
    assert rule(MOE, "decoder.layers.mlp.experts.experts.linear_fc1.weight").stacked_shape(MOE) == (2, 3, 10, 4)


def test_hf_tensor_names_are_exactly_the_saved_checkpoints_tensors(tiny_models):
    from safetensors import safe_open

    from armor_megatron.convert.rules import hf_tensor_names

    for family, hf_dir in tiny_models.items():
        arch = ModelArch.from_hf_dir(hf_dir)
        names = hf_tensor_names(arch)
        with safe_open(f"{hf_dir}/model.safetensors", "pt") as f:
            saved = set(f.keys())
        assert len(names) == len(set(names)), family
        assert set(names) == saved, (family, sorted(set(names) ^ saved)[:5])


def test_hf_tensor_names_cover_every_expert_of_every_layer():
    from armor_megatron.convert.rules import hf_tensor_names

    names = hf_tensor_names(MOE)
    experts = {n for n in names if ".experts." in n}
    assert len(experts) == MOE.num_layers * MOE.num_experts * 3
    assert "model.layers.1.block_sparse_moe.experts.2.w2.weight" in experts
