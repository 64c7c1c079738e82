"""Combining the per-call metrics of ``policy_loss`` over micro-batches.

Each call reports token-weighted means over its own valid tokens plus ``num_tokens``; the
step's value of a mean is Σ_k n_k·m_k / Σ_k n_k, of ``ratio_min``/``ratio_max`` the min/max
over calls that had tokens, and ``num_tokens`` adds up. Across data-parallel ranks the same
rule applies to the per-rank results (all-reduce n·m and n with SUM, min/max with MIN/MAX).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

_EXTREMES = {"ratio_min": min, "ratio_max": max}


def reduce_loss_metrics(calls: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, float]:
    """One dict of floats from the metrics dicts of several ``policy_loss`` calls."""
    if not calls:
        raise ValueError("reduce_loss_metrics needs at least one metrics dict")
    counts = [float(c["num_tokens"]) for c in calls]
    total = sum(counts)
    out: dict[str, float] = {"num_tokens": total}
    for key in calls[0]:
        if key == "num_tokens":
            continue
        if key in _EXTREMES:
            values = [float(c[key]) for c, n in zip(calls, counts) if n > 0]
            out[key] = _EXTREMES[key](values) if values else 0.0
        else:
            out[key] = sum(float(c[key]) * n for c, n in zip(calls, counts)) / total if total else 0.0
    return out
