"""Packed (THD) sequences through the local spec's core attention.

Transformer Engine's attention runs megatron's THD format natively (variable-length flash /
cuDNN kernels over ``cu_seqlens``). megatron-core's local ``DotProductAttention`` refuses
``packed_seq_params``; `PackedDotProductAttention` (the project's local spec) and
`local_mla_attention.LocalMLACoreAttention` run each packed sequence as a batch of one instead:

    out[a:b] = attention(q[a:b], k[a:b], v[a:b])   for each segment [a, b) of cu_seqlens

with the causal mask inside the segment, which is what the varlen kernels compute. megatron
has already applied RoPE per segment (positions restart at every cu_seqlens bound) and squeezed
the dummy batch dimension: q, k, v arrive [t, n, d] and leave as [t, 1, n·d_v].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def attend_per_segment(
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed_seq_params: Any,
) -> torch.Tensor:
    """Attention on every segment of a packed micro-batch.

    ``attend(q, k, v)`` ([s, 1, n, d] each -> [s, 1, n·d_v]) on every segment of a packed
    micro-batch (q, k, v [t, n, d]); the results back to back, [t, 1, n·d_v].
    """
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed sequences must use the 'thd' format, got {packed_seq_params.qkv_format!r}")
    if not torch.equal(packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv):
        raise ValueError("packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
    bounds = packed_seq_params.cu_seqlens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[0]:
        raise ValueError(f"cu_seqlens {bounds[0]}..{bounds[-1]} do not cover the {query.shape[0]} packed tokens")
    return torch.cat([attend(query[a:b, None], key[a:b, None], value[a:b, None]) for a, b in zip(bounds, bounds[1:])])


class PackedDotProductAttention(DotProductAttention):  # type: ignore[misc]  # megatron-core ships no types
    """megatron-core's local ``DotProductAttention`` that also runs packed (THD) micro-batches."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Megatron's dot-product attention, or per segment for a packed micro-batch (``packed_seq_params``)."""
        if packed_seq_params is None:
            out: torch.Tensor = super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
            return out
        if attention_mask is not None:
            raise ValueError("packed sequences take no attention_mask: segments are bounded by cu_seqlens")
        dense = super().forward
        return attend_per_segment(
            lambda q, k, v: dense(q, k, v, None, attn_mask_type, attention_bias), query, key, value, packed_seq_params
        )
