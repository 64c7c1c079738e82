"""A KL penalty to the reference policy, per token: the estimators k1, k2, k3.

With d = log π_θ(y_t) − log π_ref(y_t) at a token y_t sampled from π_θ (Schulman, "Approximating
KL divergence", 2020; verl's ``kl_loss_type``), each is an estimate of KL(π_θ ‖ π_ref) at that token:

    k1 = d                           unbiased, high variance, can be negative
    k2 = ½·d²                        biased, low variance, ≥ 0
    k3 = exp(−d) − 1 + d = r − 1 − log r,  r = π_ref/π_θ    unbiased, low variance, ≥ 0

Gradients with respect to log π_θ: ∂k1/∂d = 1, ∂k2/∂d = d, ∂k3/∂d = 1 − exp(−d). The k3 exponent
is clamped like the policy loss's log-ratio (d ∈ [−20, 20], ``MAX_ABS_LOG_RATIO``): beyond it the
estimate is finite and carries no gradient.

Used as ``β · aggregate(k)`` added to the policy loss (``PolicyLossConfig.kl_coef``,
``kl_estimator``); the same k3 gives the loss's ``approx_kl_old`` and ``approx_kl_ref`` metrics.
"""

from __future__ import annotations

import torch

from armor_megatron.algo.ratio import MAX_ABS_LOG_RATIO

KL_ESTIMATORS = ("k1", "k2", "k3")


def check_kl_estimator(estimator: str) -> None:
    """Raise one line unless ``estimator`` is one of ``KL_ESTIMATORS``."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {', '.join(KL_ESTIMATORS)}; got {estimator!r}")


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """The per-token estimate of KL(π_θ ‖ π_ref) (module docstring), fp32, differentiable w.r.t. ``logp``.

    Args:
        logp: [...] log π_θ of the sampled tokens.
        ref_logp: same shape, log π_ref of the same tokens.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        fp32 tensor of the shape of ``logp``.
    """
    check_kl_estimator(estimator)
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp {tuple(ref_logp.shape)} and logp {tuple(logp.shape)} differ in shape")
    d = logp.float() - ref_logp.float()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d.square()
    d = d.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO)
    return torch.expm1(-d) + d
