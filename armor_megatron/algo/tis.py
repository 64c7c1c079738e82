"""Truncated importance sampling (TIS) of the rollout engine's sampling mismatch.

On-policy responses are sampled by the rollout engine (π_engine: SGLang's kernels, its
precision), while the loss treats them as samples of π_old (the trainer's recomputation of
the same weights). The two differ by numerics; TIS reweights each on-policy token's loss by
the truncated ratio

    w_it = min(π_old(y_t) / π_engine(y_t), C) = exp(min(lp_old − lp_engine, log C)),

computed in fp32 from the per-token log-probs, in log space (no overflow), without gradient.
ARMOR anchors get w = 1: their behaviour policy is π_ref, already in the mixed ratio, not
the engine's π_old. Masked positions get w = 0 (they carry no loss). The weights go to
``policy_loss(..., token_weights=w)``.
"""

from __future__ import annotations

import math

import torch


def truncated_is_weights(
    old_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    is_anchor: torch.Tensor,
    cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token TIS weights and their metrics.

    Args:
        old_logp: [B, T] lp_old, the trainer's log π_old of the sampled tokens.
        engine_logp: [B, T] lp_engine, the rollout engine's log-probs of the same tokens.
        mask: [B, T], 1/True on response tokens.
        is_anchor: [B] bool, True for anchor rows (weight 1).
        cap: C > 0, the truncation.

    Returns:
        (weights, metrics): weights [B, T] fp32, detached; metrics over the on-policy
        (non-anchor) response tokens, fp32 scalars, 0 when there are none:
        ``tis_weight_mean``, ``tis_weight_max``, ``tis_capped_frac`` (share with
        π_old/π_engine > C), ``tis_num_tokens``.
    """
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0 or not math.isfinite(cap):
        raise ValueError(f"TIS cap must be a finite number > 0, got {cap!r}")
    if old_logp.dim() != 2 or engine_logp.shape != old_logp.shape or mask.shape != old_logp.shape:
        raise ValueError(
            f"old_logp {tuple(old_logp.shape)}, engine_logp {tuple(engine_logp.shape)} and mask "
            f"{tuple(mask.shape)} must share one [B, T] shape"
        )
    if is_anchor.shape != old_logp.shape[:1]:
        raise ValueError(f"is_anchor must be [B]={tuple(old_logp.shape[:1])}, got {tuple(is_anchor.shape)}")
    with torch.no_grad():
        valid = mask.bool()
        on_policy = valid & ~is_anchor.bool().unsqueeze(-1)
        zero = torch.zeros((), dtype=torch.float32, device=old_logp.device)
        log_w = torch.where(on_policy, old_logp.detach().float() - engine_logp.detach().float(), zero)
        if torch.isnan(log_w).any():
            bad = int(torch.isnan(log_w).sum())
            raise ValueError(f"TIS got NaN log-probs on {bad} on-policy response token(s)")
        log_cap = math.log(cap)
        weights = torch.exp(log_w.clamp(max=log_cap))
        weights = torch.where(on_policy, weights, torch.where(valid, 1.0, zero))

        n = on_policy.sum()
        denom = n.clamp(min=1).float()
        metrics = {
            "tis_weight_mean": torch.where(on_policy, weights, zero).sum() / denom,
            "tis_weight_max": torch.where(on_policy, weights, zero).max() if weights.numel() else zero,
            "tis_capped_frac": (on_policy & (log_w > log_cap)).sum().float() / denom,
            "tis_num_tokens": n.float(),
        }
    return weights, metrics
