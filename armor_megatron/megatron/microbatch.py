"""Micro-batches: rows of a batch cut for megatron's pipeline schedule and spread over data-parallel ranks.

Public interface::

    mbs = split_microbatches(input_ids, lengths, micro_batch_size, multiple_of=1)   # [MicroBatch]
    shares, per_rank = data_parallel_shares(n)     # row indices of each DP rank, rows every rank runs
    rows = padded_rows(rows, count)                # zero-loss padding rows appended
    multiple = sequence_multiple(model_chunks)     # tp under sequence parallelism, else 1
    mb = filler_microbatch(input_ids)              # a one-token stand-in for no row

A `MicroBatch` holds rows ``index`` of the batch right-padded to their own longest length:
tokens [b, s], lengths [b]; positions at or beyond a row's length hold token 0.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class MicroBatch:
    """Sequences ``index`` of the batch, right-padded to their longest: tokens [b, s], lengths [b]."""

    index: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1], device=self.tokens.device).expand_as(self.tokens)


def split_microbatches(
    input_ids: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int, multiple_of: int = 1
) -> list[MicroBatch]:
    """Cut [B, T] into consecutive micro-batches, each trimmed to its own longest sequence
    rounded up to a multiple of ``multiple_of`` (see ``sequence_multiple``; zero-padded past T).

    Whatever the caller padded with, positions at or beyond a sequence's length become token 0,
    so any pad id (even -100) is safe for the embedding and the labels.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or lengths.shape != input_ids.shape[:1]:
        raise ValueError(
            f"input_ids must be [B, T] with B >= 1 and lengths [B]; got {tuple(input_ids.shape)} and {tuple(lengths.shape)}"
        )
    if micro_batch_size < 1 or multiple_of < 1:
        raise ValueError(f"micro_batch_size and multiple_of must be >= 1, got {micro_batch_size} and {multiple_of}")
    if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > input_ids.shape[1]):
        raise ValueError(f"lengths must lie in [1, {input_ids.shape[1]}]")
    out = []
    for a in range(0, input_ids.shape[0], micro_batch_size):
        index = torch.arange(a, min(a + micro_batch_size, input_ids.shape[0]))
        s = round_up(int(lengths[index].max()), multiple_of)
        tokens = input_ids[index, :s]
        tokens = torch.nn.functional.pad(tokens, (0, s - tokens.shape[1]))
        pad = torch.arange(s)[None, :] >= lengths[index][:, None]
        out.append(MicroBatch(index, tokens.masked_fill(pad, 0), lengths[index]))
    return out


def data_parallel_shares(n: int) -> tuple[list[torch.Tensor], int]:
    """The row indices of each data-parallel rank (near-equal consecutive shares of `n` rows)
    and how many rows every rank runs, ceil(n / dp) >= 1. Ranks with fewer pad up to it
    (``padded_rows``), so all run as many micro-batches: the expert all-to-alls of an MoE model
    (one per micro-batch) span these ranks."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    return list(torch.tensor_split(torch.arange(n), dp)), max(1, -(-n // dp))


def padded_rows(rows: dict, count: int) -> dict:
    """`rows` ({name: [N, ...]}) with `count` padding rows appended: token 0, length 1, zeros
    everywhere else (zero mask: no loss, no gradient)."""
    if count == 0:
        return rows
    out = {}
    for key, t in rows.items():
        pad = torch.ones if key == "lengths" else torch.zeros
        out[key] = torch.cat([t, pad((count, *t.shape[1:]), dtype=t.dtype)])
    return out


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sequence_multiple(model_chunks) -> int:
    """What micro-batch lengths must be a multiple of: the TP size under sequence parallelism
    (each TP rank holds s / tp positions between the layers), else 1."""
    from megatron.core import parallel_state

    chunk = model_chunks[0] if isinstance(model_chunks, (list, tuple)) else model_chunks
    config = getattr(getattr(chunk, "module", chunk), "config", None)
    if config is not None and getattr(config, "sequence_parallel", False):
        return parallel_state.get_tensor_model_parallel_world_size()
    return 1


def filler_microbatch(input_ids: torch.Tensor, multiple_of: int = 1) -> MicroBatch:
    """A one-token sequence (padded to ``multiple_of``) standing for no batch row (``index`` is
    empty); its output is dropped."""
    tokens = torch.zeros(1, multiple_of, dtype=input_ids.dtype)
    return MicroBatch(torch.zeros(0, dtype=torch.long), tokens, torch.ones(1, dtype=torch.long))
