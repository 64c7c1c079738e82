"""Training FLOPs per token (`models.flops`), counted by hand per family, tensor by tensor, and
against torch's FLOP counter on transformers' own (eager) forward of tiny models.

Every matmul of a token through a weight [out, in] costs 2·in·out forward and twice that backward,
6·in·out in all; the attention products cost 6 · keys · (d_qk + d_v) per head and token.
"""

import dataclasses

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

# Tiny HF configs of the MoE and MLA families (the FLOP-counter test builds them with transformers).
QWEN2_MOE_SHAPE = dict(
    model_type="qwen2_moe",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    num_experts=6,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
QWEN3_MOE_SHAPE = {
    **{k: v for k, v in QWEN2_MOE_SHAPE.items() if k != "shared_expert_intermediate_size"},
    "model_type": "qwen3_moe",
    "head_dim": 8,
}
MIXTRAL_SHAPE = {
    **{k: v for k, v in QWEN2_MOE_SHAPE.items() if k not in ("shared_expert_intermediate_size", "num_experts")},
    "model_type": "mixtral",
    "num_local_experts": 4,
    "intermediate_size": 16,
}
DEEPSEEK_V2_SHAPE = dict(  # V2-Lite-like: no query LoRA, first layer dense, two shared experts
    model_type="deepseek_v2",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    n_shared_experts=2,
    n_routed_experts=6,
    num_experts_per_tok=2,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    q_lora_rank=None,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=6,
    max_position_embeddings=64,
    topk_method="greedy",
    norm_topk_prob=False,
    n_group=1,
    topk_group=1,
)
DEEPSEEK_V3_SHAPE = {  # V3-like: a query LoRA rank, one shared expert
    **DEEPSEEK_V2_SHAPE,
    "model_type": "deepseek_v3",
    "q_lora_rank": 12,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
}


def test_dense_by_hand():
    # per layer: q, k, v 8·(4+2+2)·2 = 128, o 4·2·8 = 64, gate/up/down 3·8·16 = 384 -> 576;
    # ×2 layers + lm_head 8·100 = 800; attention at s = 10 (5 keys on average under the causal
    # mask): 2 layers · 5 keys · 4 heads · (2 + 2)
    assert train_flops_per_token(DENSE, 10) == 6 * (2 * 576 + 800) + 6 * 2 * 5 * 4 * (2 + 2)


def test_moe_counts_the_routed_experts_and_the_router():
    moe = dataclasses.replace(DENSE, family="qwen2_moe", num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=4)
    # mlp: router 8·8 = 64 (scores of all 8 experts), 2 routed experts · 3·8·4 = 192
    assert train_flops_per_token(moe, 10) == 6 * (2 * (128 + 64 + 64 + 192) + 800) + 6 * 160


def test_qwen2_moe_by_hand_counts_the_shared_expert_and_its_gate():
    arch = ModelArch.from_hf_config(QWEN2_MOE_SHAPE)
    h, s = 32, 20
    attention = h * (4 + 2 + 2) * 8 + 4 * 8 * h  # q, k, v projections (d = 32/4 = 8) + o_proj = 3072
    router = h * 6  # mlp.gate: a score per expert = 192
    routed = 2 * 3 * h * 16  # top-2 experts, gate/up/down of width 16 = 3072
    shared = 3 * h * 24  # shared_expert gate/up/down of width 24 = 2304
    shared_gate = h * 1  # shared_expert_gate: one sigmoid logit = 32
    lm_head = h * 96  # untied output layer = 3072
    weights = 2 * (attention + router + routed + shared + shared_gate) + lm_head
    scores = 2 * (s / 2) * 4 * (8 + 8)  # 2 layers, 10 keys on average, 4 heads, QKᵀ (d) and A·V (d)
    assert train_flops_per_token(arch, s) == 6 * weights + 6 * scores


@pytest.mark.parametrize("shape", [DEEPSEEK_V2_SHAPE, DEEPSEEK_V3_SHAPE], ids=["v2-no-q-lora", "v3-q-lora"])
def test_deepseek_by_hand_counts_mla_projections_shared_experts_and_the_dense_first_layer(shape):
    arch = ModelArch.from_hf_config(shape)
    h, n, nope, rope, dv, c_kv, s = 32, 4, 8, 4, 6, 16, 20
    d_qk = nope + rope  # 12: a query/key head is its no-position part and its rotary part
    if shape["q_lora_rank"]:
        q = h * 12 + 12 * n * d_qk  # q_a_proj down to the rank-12 latent, q_b_proj up to n heads = 384 + 576
    else:
        q = h * n * d_qk  # q_proj straight to n heads = 1536
    kv_down = h * (c_kv + rope)  # kv_a_proj_with_mqa: the latent c_kv and the one rope key shared by all heads
    kv_up = c_kv * n * (nope + dv)  # kv_b_proj: the latent up to every head's no-position key and its value
    o = n * dv * h  # o_proj from n value heads of width d_v
    attention = q + kv_down + kv_up + o
    dense = 3 * h * 48  # layer 0 (first_k_dense_replace = 1): a dense SwiGLU of width 48
    experts = shape["n_routed_experts"]
    router = h * experts  # one score per routed expert
    routed = 2 * 3 * h * 16  # top-2 routed experts of width 16
    shared = 3 * h * 16 * shape["n_shared_experts"]  # the shared experts, fused into one of width 16·n_shared
    lm_head = h * 96
    weights = 3 * attention + dense + 2 * (router + routed + shared) + lm_head
    scores = 3 * (s / 2) * n * (d_qk + dv)  # 3 layers, 10 keys, QKᵀ over d_qk and A·V over d_v per head
    assert train_flops_per_token(arch, s) == 6 * weights + 6 * scores


def test_a_sliding_window_bounds_the_keys_a_token_sees():
    arch = dataclasses.replace(DENSE, family="mistral", sliding_window=4)
    # within the window: causal s/2 keys; past it (s = 10), Σ_t min(t, w) / s in the continuous
    # form (w²/2 + (s - w)·w) / s = 4 - 16/20 = 3.2 keys instead of 5
    assert train_flops_per_token(arch, 4) == train_flops_per_token(DENSE, 4)
    assert train_flops_per_token(arch, 10) == pytest.approx(6 * (2 * 576 + 800) + 6 * 2 * 3.2 * 4 * (2 + 2))


def test_a_batch_sums_each_sequence():
    assert train_flops(DENSE, [10, 3]) == pytest.approx(
        10 * train_flops_per_token(DENSE, 10) + 3 * train_flops_per_token(DENSE, 3)
    )


def test_a_qwen25_05b_shape_is_near_its_published_size():
    """Qwen2.5-0.5B: 494 M parameters, 136 M of them the (tied) embedding: 6·N without the
    embedding lookup is ~2.96 GFLOP per token before attention."""
    arch = ModelArch.from_hf_config(QWEN25_05B_SHAPE)
    assert train_flops_per_token(arch, 0) == pytest.approx(6 * 494e6, rel=0.01)


def test_deepseek_v2_lite_activates_its_published_parameters():
    """DeepSeek-V2-Lite: "2.4 B activated for each token" (its paper); the matmul weights a token
    goes through (MLA, the first dense layer, 6 of 64 routed + 2 shared experts, router, lm_head) are
    2.45 B; the embedding lookup (0.21 B) does no matmul. Counted as GQA (nq·d queries, keys and
    values from h), without the shared experts or the dense first layer, it was 2.29 B."""
    from armor_megatron.config import load_config
    from armor_megatron.config.validate import model_arch_of

    arch = model_arch_of(load_config("configs/deepseek_v2_lite_armor.yaml"))
    assert train_flops_per_token(arch, 0) / 6 / 1e9 == pytest.approx(2.4, abs=0.06)


@pytest.mark.parametrize(
    "shape",
    [TINY_SHAPE, QWEN2_MOE_SHAPE, QWEN3_MOE_SHAPE, MIXTRAL_SHAPE, DEEPSEEK_V2_SHAPE, DEEPSEEK_V3_SHAPE],
    ids=["qwen2", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"],
)
def test_flops_match_torchs_flop_counter_on_the_hf_model(shape):
    """transformers' eager forward of T one-token sequences, counted by torch's FlopCounterMode:
    every matmul a token runs (projections, the k experts it is routed to, shared experts, router,
    lm_head) plus its attention over its one key, 2·(d_qk + d_v) per head and layer. Training is
    3× that forward: F(0) (no keys) / 3 + the attention of one key."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    arch = ModelArch.from_hf_config(shape)
    torch.manual_seed(0)
    config = AutoConfig.for_model(**shape)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    tokens = 10
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.eval()(torch.randint(0, arch.vocab_size, (tokens, 1)))
    d_v = arch.value_head_dim
    one_key = 2 * arch.num_layers * arch.num_attention_heads * (arch.head_dim + d_v)
    assert counter.get_total_flops() == tokens * (train_flops_per_token(arch, 0) / 3 + one_key)


def test_flops_per_token_of_the_benchmarked_shape():
    arch = ModelArch.from_hf_config(QWEN25_05B_SHAPE)
    # per layer: 896·(14+2·2)·64 + 14·64·896 + 3·896·4864 = 1032192 + 802816 + 13074432 = 14909440;
    # ×24 + lm_head 896·151936 = 357826560 + 136134656 = 493961216 weights -> ×6 = 2963767296;
    # attention 6·24·4096·14·64 = 528482304; total 3492249600 FLOP per token (~3.5 GFLOP)
    assert train_flops_per_token(arch, 4096) == 3492249600
