"""Model FLOPs of training, per token, from a `ModelArch` (the numerator of MFU).

Forward + backward = 3 × forward, a multiply-add = 2 FLOPs, so each weight matmul costs
6 · (its parameter count) per token. With h = hidden_size, d = head_dim, nq / nkv the
query / key-value heads, f the MLP width, V the vocabulary, L layers, s the sequence length:

    F(s) = 6 · (L · (h·(nq + 2·nkv)·d + nq·d·h + mlp) + h·V) + 6 · L · s · nq · d

``mlp`` = 3·h·f for a dense SwiGLU layer; for an MoE layer the experts a token is routed to,
topk · 3·h·f_moe, plus the router h·E. The last term is attention's score and value matmuls
under a causal mask (Q·Kᵀ and A·V, 2·(s/2)·d each per head and token, forward). Norms, RoPE,
softmax and the loss are left out (O(h) per token); the embedding lookup does no matmul.
A sequence of s tokens costs s · F(s); MFU = achieved FLOP/s / peak FLOP/s of the GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable

from armor_megatron.models.arch import ModelArch


def train_flops_per_token(arch: ModelArch, seq_len: int) -> float:
    """F(s) of the module docstring for one token of a sequence of `seq_len` tokens."""
    h, d, nq, nkv = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_key_value_heads
    if arch.is_moe:
        mlp = arch.moe_router_topk * 3 * h * arch.moe_ffn_hidden_size + h * arch.num_experts
    else:
        mlp = 3 * h * arch.ffn_hidden_size
    weights = arch.num_layers * (h * (nq + 2 * nkv) * d + nq * d * h + mlp) + h * arch.vocab_size
    attention = arch.num_layers * seq_len * nq * d
    return 6.0 * weights + 6.0 * attention


def train_flops(arch: ModelArch, lengths: Iterable[int]) -> float:
    """FLOPs of one forward + backward over sequences of the given lengths: Σ s · F(s)."""
    return sum(int(s) * train_flops_per_token(arch, int(s)) for s in lengths)
