"""PPO's clipped value loss for the critic, aggregated like the policy loss.

Per valid response token t, with the critic's current value V (with grad), its value V_old when
the rollout was scored, and the GAE return R (advantages.gae_advantages):

    V_clip = V_old + clip(V − V_old, −ε_v, ε_v)
    ℓ_t    = 0.5 · max((V − R)², (V_clip − R)²)

(ε_v = None drops the clipped term: ℓ_t = 0.5 · (V − R)².) The per-token losses are aggregated
with ``loss.aggregate_token_loss`` under the same modes and GLOBAL normaliser as the policy
loss, so micro-batch losses of all data-parallel ranks add up to the loss of the whole batch.

Metrics are token-weighted means over the call's valid tokens (combine calls with
``metrics.reduce_loss_metrics``), chosen so that the explained variance of the whole batch
follows from the combined means (``explained_variance_from_moments``):

    value_clip_frac       share of tokens where the clipped term is the larger (no gradient to V)
    value_mean, return_mean, value_error_mean = mean(R − V), value_error_sq_mean = mean((R − V)²),
    return_sq_mean = mean(R²), num_tokens
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from armor_megatron.algo.loss import aggregate_token_loss, check_loss_agg


@dataclass(frozen=True)
class ValueLossConfig:
    """ε_v of the value clip (None: unclipped squared error) and the aggregation mode."""

    clip_eps: float | None = 0.2
    loss_agg: str = "token-mean"

    def __post_init__(self) -> None:
        if self.clip_eps is not None and not self.clip_eps > 0.0:
            raise ValueError(f"clip_eps must be > 0 (or None), got {self.clip_eps!r}")
        check_loss_agg(self.loss_agg)

    def replace(self, **changes: Any) -> ValueLossConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cfg: ValueLossConfig,
    *,
    normalizer: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss of one micro-batch.

    Args:
        values: [B, T] V (with grad).
        old_values: [B, T] V_old, the values at rollout time.
        returns: [B, T] R, the value targets.
        mask: [B, T], 1/True on response tokens.
        cfg: clip ε_v and aggregation mode.
        normalizer: the GLOBAL count of aggregation units (``loss.loss_normalizer``); None: this call's.

    Returns (loss, metrics): an fp32 scalar with grad, and detached fp32 scalars (module doc).
    """
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if values.dim() != 2 or t.shape != values.shape:
            raise ValueError(f"values must be [B, T] and {name} alike; got {tuple(values.shape)} and {tuple(t.shape)}")
    valid = mask.bool()
    v, v_old, ret = values.float(), old_values.float(), returns.float()
    unclipped = (v - ret).square()
    if cfg.clip_eps is None:
        token_loss = 0.5 * unclipped
        clipped_larger = torch.zeros_like(valid)
    else:
        v_clip = v_old + (v - v_old).clamp(-cfg.clip_eps, cfg.clip_eps)
        clipped = (v_clip - ret).square()
        token_loss = 0.5 * torch.maximum(unclipped, clipped)
        clipped_larger = clipped > unclipped
    loss = aggregate_token_loss(token_loss, valid, cfg.loss_agg, normalizer)

    with torch.no_grad():
        n = valid.sum()

        def mean(x: torch.Tensor) -> torch.Tensor:
            return torch.where(valid, x.float(), 0.0).sum() / n.clamp(min=1).float()

        error = ret - v.detach()
        metrics = {
            "value_clip_frac": mean(clipped_larger),
            "value_mean": mean(v.detach()),
            "return_mean": mean(ret),
            "value_error_mean": mean(error),
            "value_error_sq_mean": mean(error.square()),
            "return_sq_mean": mean(ret.square()),
            "num_tokens": n.float(),
        }
    return loss, metrics


def explained_variance_from_moments(metrics: dict[str, float]) -> float:
    """1 − Var(R − V) / Var(R) from token-weighted means (``value_loss`` metrics, possibly combined over calls).

    Var(x) = E[x²] − E[x]². NaN when the returns do not vary (undefined).
    """
    var_return = metrics["return_sq_mean"] - metrics["return_mean"] ** 2
    var_error = metrics["value_error_sq_mean"] - metrics["value_error_mean"] ** 2
    if var_return <= 0.0:
        return float("nan")
    return 1.0 - var_error / var_return


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(R − V) / Var(R) over the valid tokens of [B, T] tensors (population variances)."""
    valid = mask.bool()
    v, r = values.float()[valid], returns.float()[valid]
    if r.numel() == 0 or float(r.var(unbiased=False)) <= 0.0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / r.var(unbiased=False))
