import pytest
import torch

from armor_megatron.models.arch import ModelArch
from armor_megatron.models.flops import train_flops, train_flops_per_token

TINY_SHAPE = {
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
QWEN25_05B_SHAPE = {
    **TINY_SHAPE,
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "max_position_embeddings": 32768,
}
DENSE = ModelArch(
    family="qwen2",
    vocab_size=100,
    hidden_size=8,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=2,
    ffn_hidden_size=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=64,
)


def test_dense_by_hand():
    # per layer: qkv 8·(4+4)·2 = 128, o 4·2·8 = 64, mlp 3·8·16 = 384 -> 576; ×2 layers + lm_head 800
    # attention at s = 10: 2 layers · 10 · 4 heads · 2 = 160
    assert train_flops_per_token(DENSE, 10) == 6 * (2 * 576 + 800) + 6 * 160


def test_moe_counts_the_routed_experts_and_the_router():
    import dataclasses

    moe = dataclasses.replace(DENSE, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=4)
    # mlp: 2 experts · 3·8·4 = 192, router 8·8 = 64
    assert train_flops_per_token(moe, 10) == 6 * (2 * (128 + 64 + 256) + 800) + 6 * 160


def test_a_batch_sums_each_sequence():
    assert train_flops(DENSE, [10, 3]) == pytest.approx(
        10 * train_flops_per_token(DENSE, 10) + 3 * train_flops_per_token(DENSE, 3)
    )


def test_a_qwen25_05b_shape_is_near_its_published_size():
    """Qwen2.5-0.5B: 494 M parameters, 136 M of them the (tied) embedding: 6·N without the
    embedding lookup is ~2.96 GFLOP per token before attention."""
    arch = ModelArch(
        family="qwen2",
        vocab_size=151936,
        hidden_size=896,
        num_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        ffn_hidden_size=4864,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    assert train_flops_per_token(arch, 0) == pytest.approx(6 * 494e6, rel=0.01)


def test_flops_per_token_counts_the_matmul_weights_of_the_hf_model():
    """6 × (weights of every nn.Linear of transformers' model, lm_head included) + the causal
    attention term 6·L·s·nq·d: the formula's weight count must be the model's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = TINY_SHAPE
    arch = ModelArch.from_hf_config(shape)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    s = 100
    attention = arch.num_layers * s * arch.num_attention_heads * arch.head_dim
    assert train_flops_per_token(arch, s) == 6 * linear + 6 * attention


def test_flops_per_token_of_the_benchmarked_shape():
    arch = ModelArch.from_hf_config(QWEN25_05B_SHAPE)
    # per layer: 896·(14+2·2)·64 + 14·64·896 + 3·896·4864 = 1032192 + 802816 + 13074432 = 14909440;
    # ×24 + lm_head 896·151936 = 357826560 + 136134656 = 493961216 weights -> ×6 = 2963767296;
    # attention 6·24·4096·14·64 = 528482304; total 3492249600 FLOP per token (~3.5 GFLOP)
    assert train_flops_per_token(arch, 4096) == 3492249600
