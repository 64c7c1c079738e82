"""Model FLOPs of training, per token, from a `ModelArch` (the numerator of MFU).

Forward + backward = 3 × forward, a multiply-add = 2 FLOPs, so each weight matmul costs
6 · (its weights a token goes through). Notation: h hidden, L layers, V vocabulary, s the
sequence length, nq / nkv query / key-value heads, d head_dim, f dense MLP width, E experts,
k router top-k, fe / fs routed / shared expert width.

    F(s) = 6 · (Σ_layers (attention weights + mlp weights) + h·V) + 6 · L · keys(s) · nq · (d_qk + d_v)

Attention weights per layer:
    GQA   q, k, v projections h·(nq + 2·nkv)·d, output projection nq·d·h
    MLA   (DeepSeek; d_qk = d_nope + d_rope = head_dim, c_kv = kv_lora_rank, c_q = q_lora_rank)
          queries h·c_q + c_q·nq·d_qk (low-rank down and up projections), or h·nq·d_qk without c_q;
          kv down projection h·(c_kv + d_rope) (the latent and the shared rope key);
          kv up projection c_kv·nq·(d_nope + d_v); output projection nq·d_v·h
MLP weights per layer:
    dense 3·h·f (SwiGLU gate, up, down)
    MoE   router h·E + k routed experts k·3·h·fe + the shared expert 3·h·fs (+ its sigmoid gate h,
          Qwen2-MoE); DeepSeek's first ``moe_first_dense_layers`` layers are dense
Attention scores: per head and token, Q·Kᵀ over keys(s) keys of width d_qk and A·V of width d_v,
2·keys·(d_qk + d_v) forward (GQA: d_qk = d_v = d). Under the causal mask a token sees s/2 keys on
average; with a sliding window w (the TE spec applies it) keys(s) = w − w²/(2s) once s > w.

Norms, RoPE, softmax, biases and the loss are left out (O(h) per token); the embedding lookup
does no matmul; the output layer's matmul runs whether or not it is tied. A sequence of s tokens
costs s · F(s); MFU = achieved FLOP/s / peak FLOP/s of the GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable

from armor_megatron.models.arch import ModelArch


def attention_weights(arch: ModelArch) -> int:
    """Weights of one layer's attention matmuls a token goes through (module docstring)."""
    h, nq, d = arch.hidden_size, arch.num_attention_heads, arch.head_dim
    if not arch.is_mla:
        return h * (nq + 2 * arch.num_key_value_heads) * d + nq * d * h
    c_q, c_kv, rope, dv = arch.q_lora_rank, arch.kv_lora_rank, arch.qk_rope_head_dim, arch.v_head_dim
    q = h * c_q + c_q * nq * d if c_q else h * nq * d
    kv = h * (c_kv + rope) + c_kv * nq * (arch.qk_nope_head_dim + dv)
    return q + kv + nq * dv * h


def mlp_weights(arch: ModelArch, layer: int) -> int:
    """Weights of layer `layer`'s MLP matmuls a token goes through: dense, or router + routed + shared."""
    h = arch.hidden_size
    if not arch.is_moe_layer(layer):
        return 3 * h * arch.ffn_hidden_size
    routed = arch.moe_router_topk * 3 * h * arch.moe_ffn_hidden_size
    shared = 3 * h * arch.moe_shared_expert_ffn_hidden_size + h * arch.moe_shared_expert_gate
    return h * arch.num_experts + routed + shared


def attended_keys(arch: ModelArch, seq_len: int) -> float:
    """Keys a token of a `seq_len`-token sequence attends to, on average (causal, windowed)."""
    w = arch.sliding_window
    if w and seq_len > w:
        return w - w * w / (2 * seq_len)
    return seq_len / 2


def train_flops_per_token(arch: ModelArch, seq_len: int) -> float:
    """F(s) of the module docstring for one token of a sequence of `seq_len` tokens."""
    layers = range(arch.num_layers)
    weights = sum(attention_weights(arch) + mlp_weights(arch, i) for i in layers) + arch.hidden_size * arch.vocab_size
    d_v = arch.v_head_dim if arch.is_mla else arch.head_dim
    scores = arch.num_layers * attended_keys(arch, seq_len) * arch.num_attention_heads * (arch.head_dim + d_v)
    return 6.0 * weights + 6.0 * scores


def train_flops(arch: ModelArch, lengths: Iterable[int]) -> float:
    """FLOPs of one forward + backward over sequences of the given lengths: Σ s · F(s)."""
    return sum(int(s) * train_flops_per_token(arch, int(s)) for s in lengths)
