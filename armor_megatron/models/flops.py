"""Model FLOPs of training, per token, from a `ModelArch` (the numerator of MFU).

Forward + backward = 3 × forward, a multiply-add = 2 FLOPs, so each weight matmul costs
6 · (its weights a token goes through). Notation: h hidden, L layers, V vocabulary, s the
sequence length, nq / nkv query / key-value heads, d head_dim, f dense MLP width, E experts,
k router top-k, fe / fs routed / shared expert width.

    F(s) = 6 · (Σ_layers (attention weights + mlp weights) + h·V) + 6 · L · keys(s) · nq · (d_qk + d_v)

The weights are those of the family's declared tensors (`models.family`); for the families here:

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

import dataclasses
import functools
from collections.abc import Iterable

from armor_megatron.models.arch import ModelArch
from armor_megatron.models.family import family_of
from armor_megatron.models.tensors import TensorRule


def matmul_weights(rules: Iterable[TensorRule], routed: int = 1) -> int:
    """Weights of the matrices among ``rules`` a token goes through.

    Vectors (norms, biases, a router's bias) do no matmul; each expert's matrices count `routed`
    times (its top-k).
    """
    return sum(r.numel * (routed if r.per_expert else 1) for r in rules if len(r.shape) == 2)


def attention_weights(arch: ModelArch) -> int:
    """Weights of one layer's attention matmuls a token goes through.

    Read from its family's attention tensors (module docstring).
    """
    return matmul_weights(family_of(arch).attention_rules(arch))


def mlp_weights(arch: ModelArch, layer: int) -> int:
    """Weights of layer `layer`'s MLP matmuls a token goes through.

    Dense, or router + routed + shared, read from its family's MLP tensors.
    """
    moe = arch.is_moe_layer(layer)
    return matmul_weights(family_of(arch).mlp_rules(arch, moe), arch.moe_router_topk if moe else 1)


def attended_keys(arch: ModelArch, seq_len: int) -> float:
    """Keys a token of a `seq_len`-token sequence attends to, on average (causal, windowed)."""
    w = arch.sliding_window
    if w and seq_len > w:
        return w - w * w / (2 * seq_len)
    return seq_len / 2


def train_flops_per_token(arch: ModelArch, seq_len: int) -> float:
    """F(s) of the module docstring for one token of a sequence of `seq_len` tokens."""
    key = dataclasses.replace(arch, rope_scaling=None) if arch.rope_scaling else arch
    # a class is hashable; mypy matches type() of an instance against Hashable with the unbound __hash__
    weights = _model_weights(key, type(family_of(arch)))  # type: ignore[arg-type]
    scores = (
        arch.num_layers
        * attended_keys(arch, seq_len)
        * arch.num_attention_heads
        * (arch.head_dim + arch.value_head_dim)
    )
    return 6.0 * weights + 6.0 * scores


@functools.cache
def _model_weights(arch: ModelArch, family: type) -> int:
    """Σ_layers (attention weights + mlp weights) + h·V of ``arch`` under ``family``.

    `family` is part of the cache key (a step asks for every sequence).
    """
    layers = range(arch.num_layers)
    return sum(attention_weights(arch) + mlp_weights(arch, i) for i in layers) + arch.hidden_size * arch.vocab_size


def train_flops(arch: ModelArch, lengths: Iterable[int]) -> float:
    """FLOPs of one forward + backward over sequences of the given lengths: Σ s · F(s)."""
    return sum(int(s) * train_flops_per_token(arch, int(s)) for s in lengths)
