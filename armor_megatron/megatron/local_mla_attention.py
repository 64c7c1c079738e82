"""Core attention for multi-head latent attention (MLA) under megatron-core's local spec.

megatron-core 0.16.1's local MLA spec builds its core attention with ``DotProductAttention``,
which takes neither ``k_channels`` nor ``v_channels``: MLA's query/key heads (d_nope + d_rope)
are wider than its value heads (d_v), and only Transformer Engine's attention accepts that.
`LocalMLACoreAttention` is the torch computation for that case, used by the project's local
MLA layer spec (CPU, and GPU runs without TE):

    scores = q·kᵀ · softmax_scale      q [sq, b, n, d_qk], k [sk, b, n, d_qk]
    probs  = softmax(scores + causal mask (+ the given mask)), in fp32
    out    = probs · v                  v [sk, b, n, d_v] -> [sq, b, n·d_v]

``attention_mask`` follows megatron: True marks a position that may not be attended to. Packed
(THD) micro-batches run segment by segment (`packed_attention.attend_per_segment`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from armor_megatron.megatron.packed_attention import attend_per_segment


class LocalMLACoreAttention(MegatronModule):  # type: ignore[misc]  # megatron-core ships no types
    """Causal scaled dot-product attention with separate q/k and v head sizes (no dropout)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size > 1:
            raise ValueError("LocalMLACoreAttention does not support context parallelism")
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) > 0:
            raise ValueError("LocalMLACoreAttention has no attention dropout (set attention_dropout=0)")
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attention [s, b, n·d_v] of q, k, v [s, b, n, d] (THD packed: [t, n, d]), masked per ``attn_mask_type``."""
        if attention_bias is not None:
            raise ValueError("LocalMLACoreAttention does not support attention bias")
        if packed_seq_params is not None:  # THD: q, k, v [t, n, d], see packed_attention
            if attention_mask is not None:
                raise ValueError("packed sequences take no attention_mask: segments are bounded by cu_seqlens")
            dense = lambda q, k, v: self.forward(q, k, v, None, attn_mask_type)  # noqa: E731
            return attend_per_segment(dense, query, key, value, packed_seq_params)
        sq, b, n, _ = query.shape
        sk = key.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        masked = torch.zeros(sq, sk, dtype=torch.bool, device=scores.device)
        if (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal:
            masked = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
        if attention_mask is not None:
            masked = masked | attention_mask.to(torch.bool)
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [b, n, sq, d_v]
        return out.permute(2, 0, 1, 3).reshape(sq, b, n * v.shape[-1])
