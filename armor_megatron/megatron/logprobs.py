"""Per-token log-probs (and entropy) of sequences under a TP/PP/EP Megatron GPT model.

Public interface::

    lp, ent = vocab_parallel_logprobs(logits, labels, vocab_size=None, temperature=1.0,
                                      with_entropy=False, chunk_elements=2**26, group=None)
    out = compute_logprobs(model_chunks, input_ids, lengths, micro_batch_size=...,
                           vocab_size=..., temperature=1.0, with_entropy=False)
    out.logprobs  # [B, T] fp32, on every rank
    out.entropy   # [B, T] fp32 or None
    lp, ent = token_logprobs(logits, mb, vocab_size=..., ...)       # one micro-batch, differentiable
    out = forward_only(model_chunks, input_ids, lengths, micro_batch_size=..., names=("x",),
                       collect=lambda mb, output: (x_of(mb, output),))   # any per-token output, no grad
    shift_to_predicted(x, mb)        # [b, s] per position -> per predicted token (see token_logprobs)

Math (per token, with z = logits / temperature over the global vocabulary, V true entries):
    lse = log Σ_v exp z_v,   log p(y) = z_y − lse,   H = lse − Σ_v p_v z_v.
The vocabulary is split across the tensor-parallel group (rank r holds columns
[r·V_local, (r+1)·V_local)); max, Σ exp and Σ p·z are all-reduced, the target logit comes
from the rank that holds it. Columns at or beyond `vocab_size` (TP padding) are left out.

Memory: `vocab_parallel_logprobs` walks the tokens in chunks of ``chunk_elements // V_local``
rows, so its fp32 work tensors are two [chunk, V_local] buffers reused for every chunk, never
[tokens, V_local]; it saves only the
input logits (not a copy) and [tokens] statistics for backward, which recomputes the softmax
chunk by chunk and writes the gradient straight into one buffer shaped like the logits.
Gradients: ∂log p(y)/∂z_v = 1[v=y] − p_v and ∂H/∂z_v = −p_v (log p_v + H), both divided by
the temperature for the logits.

Host and device: nothing run per micro-batch reads device data on the host (which would wait for
the device's queue): labels are checked on the host before they travel, host tensors travel
through `microbatch.to_device` (pinned, non-blocking on GPUs), and the gradient's target term is
scattered without listing rows. tests/megatron/test_logprobs.py runs this path on meta tensors.

`compute_logprobs` runs the model through megatron-core's pipeline schedule
(`get_forward_backward_func`, forward only, no grad): the batch is cut into micro-batches of
`micro_batch_size` sequences, each right-padded only to its own longest sequence (stages
exchange shapes; ``variable_seq_lengths``). ``logprobs[b, t] = log π(input_ids[b, t] |
input_ids[b, :t])`` for 1 ≤ t < lengths[b] and 0 elsewhere (t = 0 has no prediction); callers
select response tokens with their own mask. The last pipeline stage computes the values and
broadcasts them to every rank of its pipeline group, so every rank returns them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from armor_megatron.megatron.microbatch import (
    MicroBatch,
    data_parallel_shares,
    filler_microbatch,
    local_packed_microbatches,
    padded_rows,
    round_up,
    sequence_multiple,
    split_microbatches,
    to_device,
)

DEFAULT_CHUNK_ELEMENTS = 2**26  # 64 Mi fp32 elements = 256 MiB per work tensor


# ----------------------------------------------------------------------------- vocab-parallel math
class _ChunkedVocabParallelLogProbs(torch.autograd.Function):
    """logits [N, V_local] (any float dtype), labels [N] -> log p [N], entropy [N] (fp32)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        valid: int,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = logits.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        local = labels - vocab_start
        owned = (local >= 0) & (local < valid)
        local = torch.where(owned, local, 0)
        work = _workspace(logits, chunk, valid)  # two fp32 [chunk, valid] buffers, reused per chunk
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            z = _scaled_fp32(work[0, : b - a], logits[a:b, :valid], temperature)
            m = z.max(dim=-1).values if valid else z.new_full((b - a,), -torch.inf)
            _all_reduce(m, dist.ReduceOp.MAX, group)
            z.sub_(m[:, None])  # z − m ≤ 0
            target = z.gather(1, local[a:b, None]).squeeze(1) if valid else z.new_zeros(b - a)
            e = torch.exp(z, out=work[1, : b - a])
            sums = [e.sum(dim=-1), torch.where(owned[a:b], target, 0.0)]
            if with_entropy:  # Σ exp(z−m)·(z−m), with 0·(−inf) := 0 for masked (−inf) logits
                sums.append(torch.linalg.vecdot(e, z.clamp_(min=_FP32_MIN)))
            sums_t = torch.stack(sums)
            _all_reduce(sums_t, dist.ReduceOp.SUM, group)
            log_s = sums_t[0].log()
            logprobs[a:b] = sums_t[1] - log_s
            lse[a:b] = m + log_s
            if entropy is not None:  # H = log s − Σ p·(z−m)
                entropy[a:b] = log_s - sums_t[2] / sums_t[0]
        ctx.save_for_backward(logits, local, owned, lse, entropy if with_entropy else lse)
        ctx.args = (valid, temperature, chunk, with_entropy)
        # an entropy that only feeds metrics gets no gradient: backward then skips its term
        ctx.set_materialize_grads(False)
        return logprobs, (entropy if with_entropy else lse.new_zeros(0))

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, local, owned, lse, entropy = ctx.saved_tensors
        valid, temperature, chunk, with_entropy = ctx.args
        grad = torch.zeros_like(logits)
        use_entropy = with_entropy and grad_entropy is not None
        work = _workspace(logits, chunk, valid)
        for a in range(0, logits.shape[0], chunk):
            b = min(a + chunk, logits.shape[0])
            logp = _scaled_fp32(work[0, : b - a], logits[a:b, :valid], temperature).sub_(lse[a:b, None])
            g = torch.exp(logp, out=work[1, : b - a])  # p
            if use_entropy:  # logp := g_H · p · (log p + H), 0 where p = 0 (masked logits)
                logp.clamp_(min=_FP32_MIN).add_(entropy[a:b, None]).mul_(g).mul_(grad_entropy[a:b, None])
            if grad_logprobs is None:
                g.zero_()
            else:  # g_lp · (1[v = y] − p); rows whose label another rank holds add −0.0 (exact no-op)
                g.mul_(-grad_logprobs[a:b, None])
                if valid:
                    g.scatter_add_(1, local[a:b, None], torch.where(owned[a:b], grad_logprobs[a:b], -0.0)[:, None])
            if use_entropy:
                g.sub_(logp)
            if temperature != 1.0:
                g.div_(temperature)
            grad[a:b, :valid].copy_(g)
        return grad, None, None, None, None, None, None, None


_FP32_MIN = torch.finfo(torch.float32).min


def _workspace(logits: torch.Tensor, chunk: int, valid: int) -> torch.Tensor:
    return torch.empty(2, min(chunk, logits.shape[0]), valid, dtype=torch.float32, device=logits.device)


def _scaled_fp32(out: torch.Tensor, x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``out`` := fp32 x / temperature (a copy: the caller's logits are never modified)."""
    out.copy_(x)
    return out.div_(temperature) if temperature != 1.0 else out


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(labels) and optionally the entropy under softmax(logits / temperature).

    logits: [..., V_local], this rank's vocabulary shard (rank r of `group` holds columns
    [r·V_local, (r+1)·V_local) of the padded vocabulary); labels: [...] global token ids.
    `vocab_size` is the true vocabulary (default: all columns); `group` the tensor-parallel
    group (None: no split). Returns fp32 tensors shaped like `labels`; differentiable w.r.t.
    logits (log-probs and entropy) with memory bounded as described in the module docstring.
    Labels outside [0, vocab_size) raise when they are host tensors; device labels are not read
    on the host (that would wait for the device): their out-of-range entries get NaN log-probs.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    rank = dist.get_rank(group) if group is not None else 0
    world = dist.get_world_size(group) if group is not None else 1
    v_local = logits.shape[-1]
    vocab_size = v_local * world if vocab_size is None else vocab_size
    if not 0 < vocab_size <= v_local * world:
        raise ValueError(f"vocab_size={vocab_size} does not fit {world} shards of {v_local} columns")
    on_host = labels.device.type == "cpu"
    if on_host:
        check_labels(labels, vocab_size)
    vocab_start = rank * v_local
    valid = max(0, min(v_local, vocab_size - vocab_start))
    chunk = max(1, chunk_elements // max(v_local, 1))
    flat_logits = logits.reshape(-1, v_local)
    lp, ent = _ChunkedVocabParallelLogProbs.apply(  # type: ignore[no-untyped-call]  # torch leaves apply untyped
        flat_logits, labels.reshape(-1), vocab_start, valid, float(temperature), chunk, with_entropy, group
    )
    if not on_host:  # reading the labels' range would wait for the device
        lp = out_of_range_to_nan(lp, labels.reshape(-1), vocab_size)
    return lp.view(labels.shape), (ent.view(labels.shape) if with_entropy else None)


def out_of_range_to_nan(lp: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``lp`` with NaN where the label lies outside [0, vocab_size).

    The check of labels on the device: it never reads them back to the host.
    """
    return torch.where((labels < 0) | (labels >= vocab_size), torch.nan, lp)


def check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    """Raise unless every (host) label lies in [0, vocab_size)."""
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= vocab_size):
        raise ValueError(f"labels must lie in [0, {vocab_size}); got [{int(labels.min())}, {int(labels.max())}]")


# ----------------------------------------------------------------------------- pipeline forward
@dataclasses.dataclass
class LogProbs:
    """Per-token log-probs [B, T] in fp32 and, when asked for, entropies [B, T]."""

    logprobs: torch.Tensor  # [B, T] fp32
    entropy: torch.Tensor | None  # [B, T] fp32 or None


def model_forward(model: Any, mb: MicroBatch) -> torch.Tensor:
    """One stage's forward: logits [b, s, V_local] ([1, t, V_local] packed) on the last stage, hidden states elsewhere.

    A packed micro-batch runs as THD (``PackedSeqParams``).
    """
    device = _device_of(model)
    tokens = to_device(mb.tokens, device)
    out: torch.Tensor = model(tokens, mb.position_ids_on(device), None, packed_seq_params=mb.packed_seq_params(device))
    return out


def token_logprobs(logits: torch.Tensor, mb: MicroBatch, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [b, w] of a micro-batch from its logits.

    w = ``mb.width``; logits [b, s, V_local] (or [1, t, V_local] packed); column 0 and padding
    are 0.
    Position t holds log p(tokens[t] | tokens[:t]), predicted by the logits at t − 1. The logits
    are read whole (slicing off the last position would force a copy of [b, s−1, V_local]); the
    last position of each sequence gets a placeholder label (the next token, or 0) and its value
    is dropped.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    labels = torch.cat([mb.tokens[:, 1:], torch.zeros_like(mb.tokens[:, :1])], dim=1)  # [b, s], on the host
    vocab = kwargs.get("vocab_size") or logits.shape[-1] * (dist.get_world_size(group) if group is not None else 1)
    check_labels(labels, vocab)  # here, on the host: on the device the check would wait for it
    lp, ent = vocab_parallel_logprobs(logits, to_device(labels, logits.device), group=group, **kwargs)
    return shift_to_predicted(mb.unpack(lp), mb), (shift_to_predicted(mb.unpack(ent), mb) if ent is not None else None)


def shift_to_predicted(x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """[b, s] per-position outputs (unpacked, ``mb.unpack``) -> [b, s] indexed by the token they predict.

    The output at t (from tokens ≤ t) belongs to token t + 1: it is kept when t + 1 < length and
    moved right by one, so position 0 and positions ≥ length hold 0.
    """
    keep = torch.arange(1, x.shape[1] + 1, device=x.device)[None, :] < to_device(mb.lengths, x.device)[:, None]
    return torch.nn.functional.pad(torch.where(keep, x, 0.0)[:, :-1], (1, 0))


def compute_logprobs(
    model_chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    *,
    micro_batch_size: int,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    max_tokens: int | None = None,
) -> LogProbs:
    """Per-token log-probs (and entropy) of `input_ids` [B, T] with true `lengths` [B].

    `model_chunks`: this rank's model (a list of VPP chunks, or one model). `vocab_size`: the
    HF vocabulary (padding columns are excluded). `max_tokens`: packed micro-batches of at most
    that many tokens instead of `micro_batch_size` rows (see `forward_only`). Same result on
    every rank.
    """
    kwargs = dict(
        vocab_size=vocab_size, temperature=temperature, with_entropy=with_entropy, chunk_elements=chunk_elements
    )
    names = ("logprobs", "entropy") if with_entropy else ("logprobs",)

    def collect(mb: MicroBatch, logits: torch.Tensor) -> list[torch.Tensor]:
        logprobs, entropy = token_logprobs(logits, mb, **kwargs)
        return [logprobs] if entropy is None else [logprobs, entropy]

    out = forward_only(
        model_chunks,
        input_ids,
        lengths,
        micro_batch_size=micro_batch_size,
        names=names,
        collect=collect,
        max_tokens=max_tokens,
    )
    return LogProbs(out["logprobs"], out.get("entropy"))


def forward_only(
    model_chunks: Sequence[torch.nn.Module],
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    *,
    micro_batch_size: int,
    names: Sequence[str],
    collect: Callable[[MicroBatch, torch.Tensor], Sequence[torch.Tensor]],
    max_tokens: int | None = None,
) -> dict[str, torch.Tensor]:
    """Forward-only pass over a batch, per-token results gathered on every rank.

    Run the model over `input_ids` [B, T] (true `lengths` [B]) through megatron's pipeline
    schedule, forward only, no grad, and gather per-token results on every rank.

    Each data-parallel rank runs only its share of the rows: ceil(B / dp) consecutive rows in
    micro-batches of `micro_batch_size` (padded with one-token rows, so every rank runs as many
    micro-batches: the expert all-to-alls of an MoE model span these ranks), or with
    `max_tokens` set, rows balanced over ranks by tokens and packed into micro-batches of at
    most that many tokens (`microbatch.local_packed_microbatches`). The shares are then
    all-gathered over data parallelism. ``collect(mb, output)`` turns the last stage's output
    for a micro-batch into one [b, mb.width] tensor per entry of `names`; they are written into
    fp32 zeros at the micro-batch's rows and broadcast from the last pipeline stage. Returns
    {name: [B, T]}, the same on every rank.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunks: list[torch.nn.Module] = (
        list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [cast(torch.nn.Module, model_chunks)]
    )
    multiple = sequence_multiple(chunks)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    B, T = input_ids.shape
    input_ids, lengths = input_ids.cpu(), lengths.cpu()
    if max_tokens is None:
        shares, per_rank = data_parallel_shares(B)
        own = shares[parallel_state.get_data_parallel_rank()]
        local = padded_rows({"input_ids": input_ids[own], "lengths": lengths[own]}, per_rank - len(own))
        mbs = split_microbatches(local["input_ids"], local["lengths"], micro_batch_size, multiple_of=multiple)
        if len(chunks) > 1:  # the interleaved schedule needs a multiple of pp micro-batches
            mbs += [filler_microbatch(input_ids, multiple)] * (-len(mbs) % pp)
    else:
        mbs, shares = local_packed_microbatches(
            input_ids, lengths, max_tokens, multiple, count_multiple=pp if len(chunks) > 1 else 1
        )
        per_rank = max(len(rows) for rows in shares)
    device = _device_of(chunks[0])
    width = round_up(T, multiple)  # micro-batches may run past T; their extra columns are dropped
    results = {name: torch.zeros(per_rank, width, dtype=torch.float32, device=device) for name in names}

    def loss_func(mb: MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows, index = len(mb.index), to_device(mb.index, device)
        for name, value in zip(names, collect(mb, output), strict=True):
            results[name][index, : value.shape[1]] = value[:rows]
        return output.new_zeros(()), {}

    def forward_step(data_iterator: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
        mb = next(data_iterator)
        return model_forward(model, mb), functools.partial(loss_func, mb)

    was_training = [m.training for m in chunks]
    for m in chunks:
        m.eval()
    try:
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs),
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=len(mbs),
                seq_length=max(mb.tokens.shape[1] for mb in mbs),
                micro_batch_size=max(mb.tokens.shape[0] for mb in mbs),
                forward_only=True,
            )
    finally:
        for m, training in zip(chunks, was_training):
            m.train(training)
    if pp > 1:
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        group = parallel_state.get_pipeline_model_parallel_group()
        for t in results.values():
            dist.broadcast(t, src=src, group=group)
    return {name: _gathered_rows(t, shares)[:, :T] for name, t in results.items()}


def _gathered_rows(local: torch.Tensor, shares: Sequence[torch.Tensor]) -> torch.Tensor:
    """The batch's [B, w] from every data-parallel rank's results, on every rank.

    Every data-parallel rank's results [per_rank, w] (rank r's first len(shares[r]) rows are
    batch rows shares[r], in that order) -> the batch's [B, w], on every rank.
    """
    from megatron.core import parallel_state

    parts = [local]
    if len(shares) > 1:
        parts = [torch.empty_like(local) for _ in shares]
        dist.all_gather(parts, local, group=parallel_state.get_data_parallel_group())
    out = local.new_zeros(sum(len(rows) for rows in shares), local.shape[1])
    for part, rows in zip(parts, shares):
        out[to_device(rows, out.device)] = part[: len(rows)]
    return out


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
