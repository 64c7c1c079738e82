"""Micro-batches: rows of a batch cut for megatron's pipeline schedule and spread over data-parallel ranks.

Public interface::

    mbs = split_microbatches(input_ids, lengths, micro_batch_size, multiple_of=1)   # [MicroBatch]
    shares, per_rank = data_parallel_shares(n)     # row indices of each DP rank, rows every rank runs
    rows = padded_rows(rows, count)                # zero-loss padding rows appended
    multiple = sequence_multiple(model_chunks)     # tp under sequence parallelism, else 1
    mb = filler_microbatch(input_ids)              # a one-token stand-in for no row
    mb = packed_microbatch(input_ids, lengths, index, multiple_of=1, width=None)   # rows back to back
    t = to_device(host_tensor, device)             # pinned, non-blocking when the device is a GPU
    mbs, shares = local_packed_microbatches(input_ids, lengths, budget, multiple_of)   # this DP rank's packs

A `MicroBatch` holds rows ``index`` of the batch in one of two layouts:

* padded: right-padded to their own longest length, tokens [b, s], lengths [b]; positions at or
  beyond a row's length hold token 0;
* packed (``cu_seqlens`` set; megatron's THD format): tokens [1, t], the rows back to back, then
  one padding segment of token 0 up to a multiple of ``multiple_of`` (or a fixed width).
  ``cu_seqlens`` [k + 1] (int32) bounds the segments: the b rows, then the padding segment if
  any. Positions restart at 0 in every segment, and attention stays inside a segment.

Either way ``mb.unpack(x)`` turns a per-position output of the micro-batch ([b, s] or [1, t],
trailing dims kept) into [b, mb.width] rows, so everything downstream sees the padded layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from armor_megatron.config.schema import TrainConfig
from armor_megatron.data.token_budget import packed_capacity, token_budget_plan


@dataclasses.dataclass
class MicroBatch:
    """Sequences ``index`` of the batch, right-padded to their longest: tokens [b, s], lengths [b]."""

    index: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor | None = None  # packed layout: segment bounds [k + 1], int32

    @property
    def packed(self) -> bool:
        """Whether the micro-batch is packed (THD) rather than padded."""
        return self.cu_seqlens is not None

    @property
    def width(self) -> int:
        """Columns of the rows once unpacked: s (padded layout) or the longest row (packed)."""
        return int(self.lengths.max()) if self.packed else self.tokens.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        """Position ids on the tokens' device."""
        return self.position_ids_on(self.tokens.device)

    def position_ids_on(self, device: torch.device | str | None) -> torch.Tensor:
        """Position ids [b, s] ([1, t] packed) on ``device``.

        Built there; packed, from the segment bounds copied there (``output_size`` spares the
        device a read-back of the repeat counts).
        """
        b, t = self.tokens.shape
        positions = torch.arange(t, device=device)
        if self.cu_seqlens is not None:  # packed
            cu = to_device(self.cu_seqlens, device).long()
            positions = positions - cu[:-1].repeat_interleave(cu.diff(), output_size=t)
        return positions.expand(b, t)

    def packed_seq_params(self, device: torch.device | str | None = None) -> Any:
        """Megatron's ``PackedSeqParams`` (THD) of a packed micro-batch, None for a padded one."""
        if self.cu_seqlens is None:  # padded
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = to_device(self.cu_seqlens.to(torch.int32), device)
        longest = int(self.cu_seqlens.diff().max())  # from the host copy
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """Per-position values of this micro-batch -> [b, width, ...] rows (identity when padded).

        Packed: row i's position j is packed position cu_seqlens[i] + j for j < lengths[i];
        positions past a row's length hold values of the next segment (callers mask them).
        """
        if self.cu_seqlens is None:  # padded
            return x
        t = x.shape[1]
        starts = to_device(self.cu_seqlens[: len(self.lengths)], x.device).long()
        where = (starts[:, None] + torch.arange(self.width, device=x.device)[None, :]).clamp(max=t - 1)
        return x[0][where]


def pinned_copy(src: torch.Tensor, device: torch.device | str | None) -> bool:
    """Whether `src` goes to `device` through pinned host memory, without blocking the host.

    When it lies in host memory and `device` is a GPU. A pageable host-to-GPU copy makes the host
    wait until the GPU has finished its queued work; pinning needs an accelerator.
    """
    return src.device.type == "cpu" and device is not None and torch.device(device).type == "cuda"


def to_device(t: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """`t` on `device` (None: left where it is).

    Host tensors bound for a GPU are pinned and copied asynchronously (`pinned_copy`): the caching
    host allocator keeps the pinned buffer until the copy has run.
    """
    if device is None:
        return t
    if pinned_copy(t, device):
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


def split_microbatches(
    input_ids: torch.Tensor, lengths: torch.Tensor, micro_batch_size: int, multiple_of: int = 1
) -> list[MicroBatch]:
    """Cut [B, T] into consecutive padded micro-batches.

    Each trimmed to its own longest sequence rounded up to a multiple of ``multiple_of`` (see
    ``sequence_multiple``; zero-padded past T).

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
    """Each data-parallel rank's row indices: near-equal consecutive shares.

    The row indices of each data-parallel rank (near-equal consecutive shares of `n` rows)
    and how many rows every rank runs, ceil(n / dp) >= 1. Ranks with fewer pad up to it
    (``padded_rows``), so all run as many micro-batches: the expert all-to-alls of an MoE model
    (one per micro-batch) span these ranks.
    """
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    return list(torch.tensor_split(torch.arange(n), dp)), max(1, -(-n // dp))


def padded_rows(rows: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """`rows` ({name: [N, ...]}) with `count` padding rows appended.

    Token 0, length 1, zeros everywhere else (zero mask: no loss, no gradient).
    """
    if count == 0:
        return rows
    out = {}
    for key, t in rows.items():
        pad = torch.ones if key == "lengths" else torch.zeros
        out[key] = torch.cat([t, pad((count, *t.shape[1:]), dtype=t.dtype)])
    return out


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def sequence_multiple(model_chunks: Any) -> int:
    """What micro-batch lengths must be a multiple of.

    The TP size under sequence parallelism (each TP rank holds s / tp positions between the layers),
    else 1.
    """
    from megatron.core import parallel_state

    chunk = model_chunks[0] if isinstance(model_chunks, (list, tuple)) else model_chunks
    config = getattr(getattr(chunk, "module", chunk), "config", None)
    if config is not None and getattr(config, "sequence_parallel", False):
        return int(parallel_state.get_tensor_model_parallel_world_size())
    return 1


def packed_microbatch(
    input_ids: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor, multiple_of: int = 1, width: int | None = None
) -> MicroBatch:
    """Rows ``index`` of [B, T] packed back to back into tokens [1, t].

    Here t = round_up(Σ lengths, multiple_of), or `width` when given (fixed shapes), the rest one padding
    segment of token 0.
    """
    lengths = lengths[index]
    total = int(lengths.sum())
    t = round_up(total, multiple_of) if width is None else width
    if t < total:
        raise ValueError(f"{total} packed tokens exceed the micro-batch width {t}")
    tokens = torch.zeros(1, t, dtype=input_ids.dtype)
    bounds = [0]
    for row, n in zip(index.tolist(), lengths.tolist()):
        tokens[0, bounds[-1] : bounds[-1] + n] = input_ids[row, :n]
        bounds.append(bounds[-1] + n)
    if t > total:
        bounds.append(t)
    return MicroBatch(index, tokens, lengths, cu_seqlens=torch.tensor(bounds, dtype=torch.int32))


@dataclasses.dataclass(frozen=True)
class TokenBudget:
    """Token-budget micro-batches (``train.max_tokens_per_micro_batch``).

    Rows packed into micro-batches of at most ``train`` tokens for training and ``forward`` tokens
    for the no-grad log-prob / value forwards; None keeps ``micro_batch_size`` padded rows per
    micro-batch.
    """

    train: int | None = None
    forward: int | None = None

    @classmethod
    def of(cls, train: TrainConfig) -> TokenBudget:
        """From a run config's ``train`` section (the forward budget defaults to the train one)."""
        budget = train.max_tokens_per_micro_batch
        return cls(budget, train.forward_max_tokens_per_micro_batch or budget)

    def __post_init__(self) -> None:
        for name in ("train", "forward"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"token budget {name} must be >= 1 or None, got {value}")


def local_packed_microbatches(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    budget: int,
    multiple_of: int = 1,
    *,
    count_multiple: int = 1,
    fixed_width: bool = False,
) -> tuple[list[MicroBatch], list[torch.Tensor]]:
    """This data-parallel rank's packed micro-batches under a token budget.

    Also ``shares[r]``, the batch rows of every rank r in the order its micro-batches hold them:
    rows balanced over ranks by tokens, every rank as many micro-batches
    (`data.token_budget.token_budget_plan`).

    A micro-batch's ``index`` counts positions in this rank's ``shares[rank]``; fillers (empty
    index) stand in for micro-batches a rank lacks, and pad the count to a multiple of
    `count_multiple` (the interleaved schedule needs a multiple of pp). ``fixed_width``: every
    micro-batch is ``budget`` (rounded down to `multiple_of`) tokens wide, as the interleaved
    schedule exchanges fixed shapes.
    """
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    plan = [
        [torch.tensor(rows, dtype=torch.long) for rows in rank]
        for rank in token_budget_plan(lengths.tolist(), budget, dp, multiple_of)
    ]
    shares = [torch.cat(rank) if rank else torch.zeros(0, dtype=torch.long) for rank in plan]
    width = packed_capacity(budget, multiple_of) if fixed_width else None
    out, offset = [], 0
    for rows in plan[parallel_state.get_data_parallel_rank()]:
        if len(rows) == 0:
            out.append(filler_microbatch(input_ids, multiple_of, packed=True, width=width))
            continue
        mb = packed_microbatch(input_ids, lengths, rows, multiple_of, width)
        out.append(dataclasses.replace(mb, index=torch.arange(offset, offset + len(rows))))
        offset += len(rows)
    out += [filler_microbatch(input_ids, multiple_of, packed=True, width=width)] * (-len(out) % count_multiple)
    return out, shares


def filler_microbatch(
    input_ids: torch.Tensor, multiple_of: int = 1, packed: bool = False, width: int | None = None
) -> MicroBatch:
    """A one-token micro-batch standing for no row (filler for the schedule).

    A one-token sequence (padded to ``multiple_of``, or to `width`) standing for no batch row
    (``index`` is empty); its output is dropped. ``packed``: in the packed layout.
    """
    one = torch.zeros(1, 1, dtype=input_ids.dtype)
    if packed:
        mb = packed_microbatch(
            one, torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), multiple_of, width
        )
        return dataclasses.replace(mb, index=torch.zeros(0, dtype=torch.long))
    tokens = torch.zeros(1, multiple_of, dtype=input_ids.dtype)
    return MicroBatch(torch.zeros(0, dtype=torch.long), tokens, torch.ones(1, dtype=torch.long))
