"""DAPO clipped surrogate on the ARMOR mixed ratio.

With clip-higher, dual-clip and the loss aggregation modes of the RL frameworks.

Per valid response token t of sequence i, with r = r_mix (ratio.py) and advantage A:

    ℓ_it = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))            (PPO/DAPO, clip-higher)
    ℓ_it = min(ℓ_it, −A·c)   where A < 0                          (dual-clip, c > 1, optional)

No KL term unless asked for (ARMOR's own recipe has none): with ``kl_coef`` β > 0 the loss gains
β·L_KL, L_KL the per-token KL estimate k(lp_θ, lp_ref) (k1, k2 or k3 of kl.py) aggregated like ℓ
(the ``k3`` default is verl's ``low_var_kl``). Aggregation over the global batch (N is the
``normalizer``):

    token-mean            L = Σ_i Σ_t ℓ_it / N,  N = number of valid tokens
    seq-mean-token-mean   L = Σ_i (Σ_t ℓ_it / T_i) / N,  N = number of sequences (T_i ≥ 1)
    seq-mean-token-sum    L = Σ_i Σ_t ℓ_it / N,  N = number of sequences (T_i ≥ 1)

token-mean (DAPO) weights every token equally, so long responses count in proportion to
their length. Passing the GLOBAL N (all micro-batches, all data-parallel ranks) to every call
makes the per-micro-batch losses sum to exactly the global L; ``loss_normalizer`` gives the
local count to all-reduce.

Optional per-token weights w_it (no gradient through them), e.g. truncated importance
sampling (tis.py), multiply the token losses: ℓ_it ← w_it·ℓ_it, before aggregation.

Masked positions (mask 0) never reach the arithmetic: their log-probs, advantages and weights
are replaced by 0 before the ratio, so a NaN or ±inf there (padding, a truncated forward)
gives neither a NaN loss nor a NaN gradient.

Log-ratio clamp (a deliberate departure from the paper's loss): log r is clamped to
[−20, 20] before exp, r ∈ [2.1e-9, 4.9e8]. It changes the loss only at tokens with
|log r| > 20, i.e. π_θ more than 4.9e8 times π_old (or the mixture) or less than 2e-9 times:
no healthy update moves a token that far, it signals broken log-probs or a diverged policy.
There, a token with A < 0 and log r > 20 contributes the constant −A·e^20 and NO gradient
(the paper's −A·r would give a gradient of |A|·r ≥ 4.9e8 from that one token, which would
dominate the batch's gradient and, after global-norm clipping, erase every other token's
update; dual-clip, if set, bounds it to −A·c anyway). With A > 0 and log r > 20 the token is
clipped, without gradient, either way; with log r < −20 the gradient lost is at most
|A|·2e-9. ``log_ratio_clamped_frac`` reports the share of tokens the clamp touched.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from armor_megatron.algo.kl import check_kl_estimator, kl_estimate
from armor_megatron.algo.ratio import MAX_ABS_LOG_RATIO, check_alpha, mixed_log_ratio, mixture_weight
from armor_megatron.registry import Registry

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

POLICY_LOSSES = Registry("policy loss", configures="config")
"""Registered policy losses. Each is registered with ``config=`` the dataclass of its
hyper-parameters and ``config_keys`` naming the ``algorithm`` key of each field (the run builds the
dataclass from them: ``POLICY_LOSSES.configure(name, cfg.algorithm)``), takes by keyword those of
`POLICY_LOSS_INPUTS` it names (:func:`bind_policy_loss`; :func:`policy_loss` takes them all) and
returns ``(loss, metrics)``."""
register_policy_loss = POLICY_LOSSES.register

POLICY_LOSS_INPUTS = (
    "logp",
    "old_logp",
    "ref_logp",
    "advantages",
    "mask",
    "cfg",
    "normalizer",
    "entropy",
    "token_weights",
)
"""What the actor gives a policy loss, by keyword (shapes in :func:`policy_loss`)."""
# inputs a loss must take when the run gives them: the global aggregation and the TIS correction
# the config asked for; a loss may leave out the others (its math decides which it reads)
BINDING_INPUTS = ("normalizer", "token_weights")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Hyper-parameters of the clipped surrogate (paper: α 0.875–0.9375, ε 0.2 / 0.28)."""

    alpha: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip_c: float | None = None  # e.g. 3.0; bounds the loss of negative advantages
    loss_agg: str = "token-mean"
    kl_coef: float = 0.0  # β of the KL penalty to π_ref; 0: none
    kl_estimator: str = "k3"  # k1, k2 or k3 (kl.py)

    def __post_init__(self) -> None:
        check_alpha(self.alpha)
        if not 0.0 < self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in (0, 1), got {self.eps_low!r}")
        if not self.eps_high > 0.0:
            raise ValueError(f"eps_high must be > 0, got {self.eps_high!r}")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1 (or None), got {self.dual_clip_c!r}")
        check_loss_agg(self.loss_agg)
        if not (isinstance(self.kl_coef, (int, float)) and self.kl_coef >= 0.0):
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        check_kl_estimator(self.kl_estimator)

    @property
    def needs_ref_logp(self) -> bool:
        """The loss reads log π_ref: for the mixed ratio (α < 1) or the KL penalty (β > 0)."""
        return self.alpha < 1.0 or self.kl_coef > 0.0

    def replace(self, **changes: Any) -> PolicyLossConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def check_loss_agg(loss_agg: str) -> None:
    """Raise one line unless ``loss_agg`` is one of ``LOSS_AGG_MODES``."""
    if loss_agg not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGG_MODES)}; got {loss_agg!r}")


def loss_normalizer(mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """The local count of aggregation units in ``mask`` [B, T].

    Valid tokens for token-mean, sequences with at least one valid token for the seq-* modes. Sum it
    over micro-batches and data-parallel ranks to get the global ``normalizer`` of ``policy_loss``.
    """
    check_loss_agg(loss_agg)
    valid = mask.bool()
    if loss_agg == "token-mean":
        return valid.sum()
    return valid.any(dim=-1).sum()


def aggregate_token_loss(
    token_loss: torch.Tensor, mask: torch.Tensor, loss_agg: str, normalizer: torch.Tensor | float | None = None
) -> torch.Tensor:
    """The loss L of per-token losses ``token_loss`` [B, T] under ``loss_agg`` (module doc).

    Σ_i Σ_t ℓ_it / N, or Σ_i (Σ_t ℓ_it / T_i) / N for seq-mean-token-mean. Positions where ``mask``
    is 0 are dropped; ``normalizer`` is the GLOBAL N (None: this call's own count).
    """
    if isinstance(normalizer, (int, float)) and normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}")
    valid = mask.bool()
    # where(), not a product: a non-finite value on a padding position must not leak in.
    token_loss = torch.where(valid, token_loss, torch.zeros_like(token_loss))
    if loss_agg == "seq-mean-token-mean":
        total = (token_loss.sum(-1) / valid.sum(-1).clamp(min=1)).sum()
    else:
        total = token_loss.sum()
    if normalizer is None:
        normalizer = loss_normalizer(valid, loss_agg).clamp(min=1)
    return total / normalizer


def _check_inputs(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None,
    token_weights: torch.Tensor | None = None,
) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    named = (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask), ("entropy", entropy))
    for name, t in (*named, ("token_weights", token_weights)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logp.shape)} like logp")
    if advantages.shape not in (logp.shape[:1], logp.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected [B]={tuple(logp.shape[:1])} "
            f"or [B, T]={tuple(logp.shape)}"
        )


def on_valid(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``x`` with masked positions set to 0 (a ``where``: no NaN/inf there, no gradient there)."""
    return torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))


@register_policy_loss(
    "armor",
    config=PolicyLossConfig,
    config_keys={
        **{f: f for f in ("alpha", "eps_low", "eps_high", "dual_clip_c", "loss_agg")},
        "kl_coef": "kl_loss.coef",
        "kl_estimator": "kl_loss.estimator",
    },
)
def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
    *,
    normalizer: torch.Tensor | float | None = None,
    entropy: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ARMOR/DAPO policy loss of one micro-batch (registered as ``"armor"``; α = 1 is PPO/DAPO).

    Args:
        logp: [B, T] log-probs of the response tokens under π_θ (with grad).
        old_logp: [B, T] log-probs under π_old.
        ref_logp: [B, T] log-probs under π_ref; may be None when ``cfg.alpha`` == 1 and
            ``cfg.kl_coef`` == 0.
        advantages: [B] (one per sequence) or [B, T] (per token).
        mask: [B, T], 1/True on real response tokens.
        cfg: the loss hyper-parameters.
        normalizer: the GLOBAL count of aggregation units (see module doc); None: this call's.
        entropy: optional [B, T] per-token entropy of π_θ, only reported.
        token_weights: optional [B, T] weights w_it of the token losses (detached), e.g. the
            truncated importance-sampling weights of tis.py; None: all 1.

    Returns:
        (loss, metrics): loss is an fp32 scalar with grad; metrics are detached fp32 scalars,
        token-weighted over this call's valid tokens (0 when there are none):
        clip_frac_low (A<0 and r<1−ε_low: clipped, no gradient), clip_frac_high (A>0 and
        r>1+ε_high), dual_clip_frac (A<0 and r>c), ratio_mean/min/max (of r_mix),
        approx_kl_old = mean(ρ−1−log ρ), ρ = π_θ/π_old (k3 estimate of KL(π_old‖π_θ)),
        approx_kl_ref = mean(ρ−1−log ρ), ρ = π_ref/π_θ (k3 estimate of KL(π_θ‖π_ref)),
        mixture_weight_mean = mean α·π_θ/(α·π_θ+(1−α)·π_ref) (both when ref_logp is given),
        log_ratio_clamped_frac (|log r_mix| > 20, module doc), kl_loss = mean k (the estimator of
        ``cfg.kl_estimator``, when ``cfg.kl_coef`` > 0), entropy (when given) and num_tokens.
    """
    _check_inputs(logp, old_logp, ref_logp, advantages, mask, entropy, token_weights)
    if cfg.needs_ref_logp and ref_logp is None:
        raise ValueError(
            f"ref_logp is required when alpha < 1 or kl_coef > 0 (alpha={cfg.alpha}, kl_coef={cfg.kl_coef})"
        )
    valid = mask.bool()
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1).expand_as(logp)
    # Masked positions may hold NaN/inf (padding): neutralise every input before the arithmetic,
    # since a where() after it keeps the value finite but not the gradient (0·NaN = NaN).
    logp, old_logp, adv = on_valid(logp, valid), on_valid(old_logp, valid), on_valid(adv, valid)
    if ref_logp is not None:
        ref_logp = on_valid(ref_logp, valid)

    log_ratio = mixed_log_ratio(logp, old_logp, ref_logp, cfg.alpha)
    ratio = torch.exp(log_ratio.clamp(-MAX_ABS_LOG_RATIO, MAX_ABS_LOG_RATIO))
    token_loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high))
    if cfg.dual_clip_c is not None:
        token_loss = torch.where(adv < 0, torch.minimum(token_loss, -adv * cfg.dual_clip_c), token_loss)
    if token_weights is not None:
        token_loss = token_loss * on_valid(token_weights.detach().float(), valid)
    loss = aggregate_token_loss(token_loss, valid, cfg.loss_agg, normalizer)
    kl = None
    if cfg.kl_coef > 0.0:
        assert ref_logp is not None  # needs_ref_logp
        kl = kl_estimate(logp, ref_logp, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * aggregate_token_loss(kl, valid, cfg.loss_agg, normalizer)

    with torch.no_grad():
        metrics = _metrics(ratio, log_ratio, adv, valid, logp, old_logp, ref_logp, entropy, cfg)
        if kl is not None:
            metrics["kl_loss"] = torch.where(valid, kl.detach(), 0.0).sum() / valid.sum().clamp(min=1).float()
    return loss, metrics


def get_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The policy loss registered as ``name`` (``"armor"``).

    An unknown name raises one line listing the known ones.
    """
    return POLICY_LOSSES.definition(name)


def bind_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The loss registered as ``name``, called by keyword with those of `POLICY_LOSS_INPUTS` it takes.

    A loss needing a parameter the actor does not give is refused here; at a call, an input the
    loss does not take is left out, unless it is one of `BINDING_INPUTS` and given (the global
    ``normalizer``, TIS ``token_weights``): that is refused in one line rather than silently
    training another objective than the config asks for. The metrics gain ``num_tokens`` (valid
    tokens of the call) where the loss does not report it.
    """
    entry = POLICY_LOSSES.entry(name)
    fn = POLICY_LOSSES.definition(name)
    parameters = inspect.signature(fn).parameters
    unknown = [p for p, v in parameters.items() if p not in POLICY_LOSS_INPUTS and v.default is inspect.Parameter.empty]
    if unknown:
        raise ValueError(
            f"policy loss {name!r} needs {', '.join(unknown)}, which the actor does not give "
            f"(it gives {', '.join(POLICY_LOSS_INPUTS)})"
        )

    def call(**inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        refused = [k for k in BINDING_INPUTS if inputs.get(k) is not None and k not in entry.parameters]
        if refused:
            raise ValueError(f"policy loss {name!r} does not take {', '.join(refused)}, which this run gives it")
        loss, metrics = fn(**{k: v for k, v in inputs.items() if k in entry.parameters})
        metrics = dict(metrics)
        metrics.setdefault("num_tokens", inputs["mask"].bool().sum().float())  # megatron's per-token accounting
        return loss, metrics

    return call


def make_policy_loss_config(name: str, **hyper_parameters: Any) -> PolicyLossConfig:
    """The config of loss ``name`` built from ``hyper_parameters`` (its dataclass fields).

    An unknown field raises one line listing the fields the loss takes.
    """
    config_cls = POLICY_LOSSES.entry(name).meta["config"]
    fields = [f.name for f in dataclasses.fields(config_cls)]
    unknown = [k for k in hyper_parameters if k not in fields]
    if unknown:
        raise ValueError(f"policy loss {name!r} takes no {', '.join(unknown)}; its config fields: {', '.join(fields)}")
    config: PolicyLossConfig = config_cls(**hyper_parameters)
    return config


def _metrics(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
    cfg: PolicyLossConfig,
) -> dict[str, torch.Tensor]:
    n = valid.sum()
    denom = n.clamp(min=1).float()
    has_tokens = n > 0

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.float(), 0.0).sum() / denom

    def k3(logp: torch.Tensor, other_logp: torch.Tensor) -> torch.Tensor:  # mean k3 of KL(π_logp ‖ π_other)
        return mean(kl_estimate(logp, other_logp, "k3"))

    inf = torch.tensor(float("inf"), device=ratio.device)
    out = {
        "clip_frac_low": mean((adv < 0) & (ratio < 1.0 - cfg.eps_low)),
        "clip_frac_high": mean((adv > 0) & (ratio > 1.0 + cfg.eps_high)),
        "dual_clip_frac": (
            mean((adv < 0) & (ratio > cfg.dual_clip_c))
            if cfg.dual_clip_c is not None
            else torch.zeros((), device=ratio.device)
        ),
        "ratio_mean": mean(ratio),
        "ratio_min": torch.where(has_tokens, torch.where(valid, ratio, inf).min(), 0.0),
        "ratio_max": torch.where(has_tokens, torch.where(valid, ratio, -inf).max(), 0.0),
        "approx_kl_old": k3(old_logp, logp),
        "log_ratio_clamped_frac": mean(log_ratio.detach().abs() > MAX_ABS_LOG_RATIO),
        "num_tokens": n.float(),
    }
    if ref_logp is not None:
        out["approx_kl_ref"] = k3(logp, ref_logp)
        out["mixture_weight_mean"] = mean(mixture_weight(logp.detach(), ref_logp, cfg.alpha))
    if entropy is not None:
        out["entropy"] = mean(on_valid(entropy.detach(), valid))
    return out
