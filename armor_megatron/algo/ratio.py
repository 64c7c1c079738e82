"""The ARMOR mixed importance ratio, computed in log space.

With the mixture policy π_mix = α·π_θ + (1−α)·π_ref (per token), ARMOR replaces the PPO ratio
π_θ/π_old by

    r_mix = (α·π_θ + (1−α)·π_ref) / (α·π_old + (1−α)·π_ref)

    log r_mix = logaddexp(log α + lp_θ, log(1−α) + lp_ref)
              − logaddexp(log α + lp_old, log(1−α) + lp_ref)

where lp_* are per-token log-probabilities. logaddexp never forms π = exp(lp) directly, so
log-probs of −80 or −1000 neither underflow nor lose the ratio. Its derivative is

    ∂ log r_mix / ∂ lp_θ = α·π_θ / (α·π_θ + (1−α)·π_ref)   ∈ (0, 1],

the share of π_θ in the mixture: tokens the reference strongly supports move the ratio less.
"""

from __future__ import annotations

import math

import torch

# exp(±20) ≈ 4.9e8: far outside any clip range, but finite in fp32 even for garbage inputs
# (see "Log-ratio clamp" in algo/loss.py for what it changes).
MAX_ABS_LOG_RATIO = 20.0


def check_alpha(alpha: float) -> None:
    """Raise ValueError unless the mixing weight α lies in (0, 1]."""
    if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")


def mixed_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, alpha: float
) -> torch.Tensor:
    """The mixed log-ratio log r_mix per token, in fp32, differentiable w.r.t. ``logp``.

    Args:
        logp: lp_θ, log π_θ of the sampled tokens (with grad), any shape, e.g. [B, T].
        old_logp: lp_old, log π_old of the same tokens, same shape.
        ref_logp: lp_ref, log π_ref of the same tokens, same shape; None means "no reference".
        alpha: mixing weight α ∈ (0, 1].

    Returns:
        fp32 tensor of the same shape. With α == 1 or ``ref_logp`` None it is exactly
        ``logp.float() - old_logp.float()``, bit for bit the PPO log-ratio.
    """
    check_alpha(alpha)
    if logp.shape != old_logp.shape:
        raise ValueError(f"logp {tuple(logp.shape)} and old_logp {tuple(old_logp.shape)} differ in shape")
    logp, old_logp = logp.float(), old_logp.float()
    if alpha == 1.0 or ref_logp is None:
        return logp - old_logp
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp {tuple(ref_logp.shape)} and logp {tuple(logp.shape)} differ in shape")
    ref_term = ref_logp.float() + math.log1p(-alpha)
    log_alpha = math.log(alpha)
    return torch.logaddexp(logp + log_alpha, ref_term) - torch.logaddexp(old_logp + log_alpha, ref_term)


def mixture_weight(logp: torch.Tensor, ref_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """The weight w = α·π_θ / (α·π_θ + (1−α)·π_ref) = ∂ log r_mix / ∂ lp_θ, in fp32 (1 where α == 1).

    Computed as sigmoid(log α + lp_θ − log(1−α) − lp_ref), stable for any log-probs.
    """
    check_alpha(alpha)
    if alpha == 1.0:
        return torch.ones_like(logp, dtype=torch.float32)
    logit = logp.float() - ref_logp.float() + (math.log(alpha) - math.log1p(-alpha))
    return torch.sigmoid(logit)


def trust_region_bounds(
    old_logp: torch.Tensor, ref_logp: torch.Tensor, alpha: float, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probability interval for π_θ that clipping r_mix to [1−ε_low, 1+ε_high] allows.

    Solving (α·π_θ + (1−α)·π_ref) / (α·π_old + (1−α)·π_ref) = 1 ± ε for π_θ (the r_mix of the
    module docstring) gives ARMOR's adaptive trust region:

        lower = (1 − ε_low)·π_old − ε_low·(1−α)/α·π_ref
        upper = (1 + ε_high)·π_old + ε_high·(1−α)/α·π_ref

    At α = 1 it is PPO's [(1−ε_low)·π_old, (1+ε_high)·π_old]; the reference widens it on
    both sides in proportion to π_ref. Returns (lower, upper) in probability space, fp64.
    """
    check_alpha(alpha)
    p_old, p_ref = old_logp.double().exp(), ref_logp.double().exp()
    widen = (1.0 - alpha) / alpha * p_ref
    return (1.0 - eps_low) * p_old - eps_low * widen, (1.0 + eps_high) * p_old + eps_high * widen
