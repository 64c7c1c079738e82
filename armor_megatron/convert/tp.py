"""Tensor-parallel split / gather of one global Megatron tensor (a rule's ``shape``).

Megatron's TP layouts, per ``TensorRule.tp``:

* ``replicated`` (norms, router): every rank holds the whole tensor.
* ``column`` / ``vocab`` / ``qkv``: rank r holds the r-th of tp equal blocks of dim 0. For the
  fused QKV each block is a run of whole query groups (needs groups % tp == 0), because the
  rows are [group 0: q heads, k, v][group 1: ...].
* ``glu``: fc1 = [gate; up]; rank r holds [gate block r; up block r].
* ``row`` (linear_proj, fc2): rank r holds the r-th block of dim 1 (the input dim).

The vocabulary is split as given: a trainer that pads the vocabulary to a multiple of
tp must pad before splitting and trim after gathering.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from armor_megatron.convert.rules import TensorRule
from armor_megatron.models import ModelArch
from armor_megatron.models.tensors import TPSplit


def _check_divisible(arch: ModelArch, rule: TensorRule, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    if rule.tp is TPSplit.QKV:
        size, what = arch.num_key_value_heads, "num_key_value_heads"
    elif rule.tp is TPSplit.GLU:
        size, what = rule.shape[0] // 2, "ffn hidden size"
    elif rule.tp is TPSplit.ROW:
        size, what = rule.shape[1], f"{rule.ckpt_key} input dim"
    elif rule.tp in (TPSplit.COLUMN, TPSplit.VOCAB):
        size, what = rule.shape[0], "vocab_size" if rule.tp is TPSplit.VOCAB else f"{rule.ckpt_key} output dim"
    else:
        return
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by tp={tp}")


def tp_split(arch: ModelArch, rule: TensorRule, tensor: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """Global tensor -> the tp rank-local tensors (views where possible), rank order."""
    _check_divisible(arch, rule, tp)
    if rule.tp is TPSplit.REPLICATED:
        return [tensor] * tp
    if rule.tp is TPSplit.ROW:
        return list(tensor.chunk(tp, dim=1))
    if rule.tp is TPSplit.GLU:
        gate, up = tensor.chunk(2, dim=0)
        return [torch.cat(pair, dim=0) for pair in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    return list(tensor.chunk(tp, dim=0))


def tp_gather(arch: ModelArch, rule: TensorRule, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rank-local tensors (rank order) -> the global tensor; inverse of :func:`tp_split`.

    Vocabulary shards are concatenated as they are: a trainer's hold its padded vocabulary (a
    multiple of tp, whatever the HF vocabulary), whose padding rows the caller cuts.
    """
    tp = len(shards)
    if rule.tp is not TPSplit.VOCAB:
        _check_divisible(arch, rule, tp)
    if rule.tp is TPSplit.REPLICATED:
        return shards[0]
    if rule.tp is TPSplit.ROW:
        return torch.cat(list(shards), dim=1)
    if rule.tp is TPSplit.GLU:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(shards), dim=0)
