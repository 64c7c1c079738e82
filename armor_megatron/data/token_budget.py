"""Token-budget batching: which rows run on which data-parallel rank, and in which micro-batch.

Public interface (pure: integer lengths in, row indices out)::

    parts = balanced_partition(lengths, k)            # k lists of row indices, near-equal Σ length
    bins  = pack_by_tokens(lengths, budget, multiple) # lists of row indices, each Σ length ≤ budget
    plan  = token_budget_plan(lengths, budget, dp, multiple)   # plan[rank] = [[rows of a micro-batch], ...]
    packed_capacity(budget, multiple)                 # the most row tokens one packed micro-batch holds

A micro-batch of packed rows is laid out as one sequence: its rows back to back, then padding
up to a multiple of ``multiple`` (the tensor-parallel size under sequence parallelism), so its
length is round_up(Σ lengths, multiple). `pack_by_tokens` keeps that at or below ``budget``.

`balanced_partition` is the Karmarkar–Karp largest differencing method for k parts: each row
starts as a k-way partition (itself, then k − 1 empty parts); the two partitions whose largest
and smallest parts differ most are merged, pairing the largest part of one with the smallest of
the other, until one partition is left. Its spread (max − min part sum) is usually far below
the longest row, where greedy assignment of sorted rows (LPT) can leave a whole row's worth.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Row indices split into `parts` groups of near-equal total length (Karmarkar–Karp).

    Deterministic: equal inputs give equal groups on every rank. Groups hold indices in
    increasing order; with fewer rows than parts some groups are empty.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    heap = []  # (−spread, order, [(part sum, [indices]) by decreasing sum])
    for i, n in enumerate(lengths):
        heap.append((-n, i, [(n, [i])] + [(0, []) for _ in range(parts - 1)]))
    if not heap:
        return [[] for _ in range(parts)]
    heapq.heapify(heap)
    order = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(
            ((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=lambda p: p[0], reverse=True
        )
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), order, merged))
        order += 1
    return [sorted(indices) for _, indices in heap[0][2]]


def packed_capacity(budget: int, multiple: int = 1) -> int:
    """Row tokens a packed micro-batch of at most ``budget`` tokens holds.

    With its length padded to a multiple of `multiple`: the budget rounded down to that multiple.
    """
    return budget // multiple * multiple


def pack_by_tokens(lengths: Sequence[int], budget: int, multiple: int = 1) -> list[list[int]]:
    """First-fit decreasing: row indices in bins whose packed length round_up(Σ lengths, multiple) is at most `budget`.

    Longest rows are placed first; bins come in the order they were opened, each with its indices in
    increasing order. A row that cannot fit an empty bin is an error.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    capacity = packed_capacity(budget, multiple)
    if capacity < 1:
        raise ValueError(f"token budget {budget} holds no multiple of {multiple} tokens")
    longest = max(lengths, default=0)
    if longest > capacity:
        raise ValueError(
            f"a {longest}-token sequence exceeds max_tokens_per_micro_batch={budget}"
            + (f" (rounded down to a multiple of {multiple}: {capacity})" if capacity != budget else "")
            + "; raise the budget to at least the longest prompt + response"
        )
    loads: list[int] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                loads[b] += lengths[i]
                bins[b].append(i)
                break
        else:
            loads.append(lengths[i])
            bins.append([i])
    return [sorted(b) for b in bins]


def token_budget_plan(lengths: Sequence[int], budget: int, dp: int, multiple: int = 1) -> list[list[list[int]]]:
    """``plan[r]``: data-parallel rank r's micro-batches as lists of (global) row indices.

    Rows are spread over the `dp` ranks by `balanced_partition` of their lengths, then packed by
    `pack_by_tokens` on each rank. Every rank gets as many micro-batches (the expert all-to-alls
    of an MoE model run once per micro-batch across these ranks): ranks with fewer get empty
    ones, which callers run as one-token fillers.
    """
    plan = []
    for rows in balanced_partition(lengths, dp):
        bins = pack_by_tokens([lengths[i] for i in rows], budget, multiple)
        plan.append([[rows[j] for j in b] for b in bins])
    count = max(1, max(len(p) for p in plan))
    return [p + [[] for _ in range(count - len(p))] for p in plan]
