"""Advantage estimators.

Group estimators take ``rewards`` of shape [num_groups, G]: row g holds the scalar rewards of
the G responses to prompt g, the ARMOR anchor (if any) included as an ordinary member. They
return advantages of the same shape, one per response, which the loss broadcasts over the
response's tokens. Statistics per group (over the G entries of a row):

    mean_g = (1/G) Σ_j r_gj,   std_g = sqrt(Σ_j (r_gj − mean_g)² / (G − 1))   (Bessel, as torch.std)

GAE works on per-token values and rewards of a critic instead.

Statistics are computed in float64 and the advantages returned in float32. A set whose
rewards are all equal (a group for the group estimators, the batch for REINFORCE++) gets
advantages of exactly 0 whatever the reward value: in fp32, mean(0.7, …, 0.7) ≠ 0.7 and the
rounding error divided by std + ε ≈ 1e-6 gave 0.056.

Every estimator is registered in ``ADVANTAGE_ESTIMATORS`` with the arguments its signature
takes, the ``algorithm`` config keys that supply its hyper-parameters (``config_keys``) and
one trait, ``critic``:

* False (group-based): ``fn(rewards [num_groups, G], **hyper) -> advantages [num_groups, G]``,
  computed once per step on the driver;
* True: the trainer trains a critic beside the actor and calls, on every rank,
  ``fn(values [B, T], rewards [B, T], mask [B, T], **hyper) -> (advantages, returns) [B, T]``
  with the critic's values and the outcome reward on each response's last token.

``compute_advantages(name, rewards=..., **kwargs)`` checks the arguments and dispatches;
``needs_critic(name)`` is what the trainer, the config checks and the memory plan ask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from armor_megatron.registry import Registry

DEFAULT_EPS = 1e-6

ADVANTAGE_ESTIMATORS = Registry("advantage estimator", traits={"critic": False})
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register


def _check_groups(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [num_groups, G] with G >= 2, got shape {tuple(rewards.shape)}")
    return rewards.double()


def _constant_rows(r: torch.Tensor) -> torch.Tensor:
    """[num_groups, 1] bool: the group's rewards are all equal."""
    return r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)


def _zero_where(constant: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    return torch.where(constant, torch.zeros_like(adv), adv).float()


@register_advantage_estimator("grpo", "dapo", config_keys={"eps": "std_eps"})
def grpo_advantages(rewards: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """GRPO / DAPO group normalisation:  A_gi = (r_gi − mean_g) / (std_g + ε).

    A group whose rewards are all equal gets A = 0 exactly (DAPO's dynamic sampling drops such groups).
    """
    r = _check_groups(rewards)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return _zero_where(_constant_rows(r), adv)


@register_advantage_estimator("drgrpo")
def drgrpo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Dr.

    GRPO (GRPO done right): the mean baseline without the std division, A_gi = r_gi − mean_g, which
    removes the question-difficulty bias of 1/std_g.
    """
    r = _check_groups(rewards)
    return _zero_where(_constant_rows(r), r - r.mean(dim=1, keepdim=True))


@register_advantage_estimator("qae", config_keys={"k": "qae_quantile", "eps": "std_eps"})
def qae_advantages(rewards: torch.Tensor, k: float = 0.4, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """QAE (Quantile Advantage Estimation, arXiv 2509.22611).

    GRPO/DAPO with the group mean replaced by the group's K-quantile,

        A_gi = (r_gi − Q_K(r_g)) / (std_g + ε),

    Q_K = ``torch.quantile(r_g, K)`` with its default linear interpolation (authors' K = 0.4).
    With binary rewards and success rate p: if p ≤ 1−K, Q_K = 0 (hard prompt: only the rare
    successes get a non-zero, positive advantage); if p > 1−K, Q_K = 1 (easy prompt: only the
    failures get a negative one). Most responses get A = 0 — anchors included, see
    ``anchors.anchor_zero_advantage_rate``.
    """
    if not 0.0 <= k <= 1.0:
        raise ValueError(f"QAE quantile k must be in [0, 1], got {k!r}")
    r = _check_groups(rewards)
    baseline = torch.quantile(r, k, dim=1, keepdim=True)
    adv = (r - baseline) / (r.std(dim=1, keepdim=True) + eps)
    return _zero_where(_constant_rows(r), adv)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """RLOO (REINFORCE leave-one-out).

    The baseline of each response is the mean of the other G−1 responses of its group,

        A_gi = r_gi − (1/(G−1)) Σ_{j≠i} r_gj = G/(G−1) · (r_gi − mean_g).
    """
    r = _check_groups(rewards)
    g = r.shape[1]
    return _zero_where(_constant_rows(r), (r - r.mean(dim=1, keepdim=True)) * (g / (g - 1)))


@register_advantage_estimator("reinforce++", config_keys={"eps": "std_eps"})
def reinforce_pp_advantages(rewards: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """REINFORCE++ with outcome rewards and no per-token KL.

    The return of every response is its reward, normalised over the whole batch (all groups
    together, each response once):

        A_gi = (r_gi − mean_batch) / (std_batch + ε),   std over all num_groups·G rewards (Bessel).
    """
    r = _check_groups(rewards)
    return _zero_where(r.amax() == r.amin(), (r - r.mean()) / (r.std() + eps))


@register_advantage_estimator("reinforce++-baseline", config_keys={"eps": "std_eps"})
def reinforce_pp_baseline_advantages(rewards: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """REINFORCE++-baseline.

    Subtract the group mean, then divide by the std of those centred values over the whole batch:
    c_gi = r_gi − mean_g,  A_gi = c_gi / (std_batch(c) + ε).
    """
    r = _check_groups(rewards)
    constant = _constant_rows(r)
    centred = torch.where(constant, 0.0, r - r.mean(dim=1, keepdim=True))
    return _zero_where(constant, centred / (centred.std() + eps))


@register_advantage_estimator("gae", critic=True, config_keys={"gamma": "gamma", "lam": "lam"})
def gae_advantages(
    values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over response tokens.

    Args:
        values: [B, T] critic values V_t.
        rewards: [B, T] per-token rewards r_t (an outcome reward sits on the last valid token).
        mask: [B, T], 1 on valid tokens.
        gamma: discount γ.
        lam: GAE λ.

    With t+1 the next *valid* token of the same sequence (V = 0 after the last one):

        δ_t = r_t + γ·V_{t+1} − V_t,    A_t = δ_t + γλ·A_{t+1},    R_t = A_t + V_t.

    Returns (advantages, returns), [B, T] fp32, zero on invalid positions. Not whitened.
    """
    if not (values.shape == rewards.shape == mask.shape) or values.dim() != 2:
        raise ValueError(
            f"values {tuple(values.shape)}, rewards {tuple(rewards.shape)} and mask "
            f"{tuple(mask.shape)} must share one [B, T] shape"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma!r}, lam={lam!r}")
    v, r, m = values.float(), rewards.float(), mask.float()
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    adv = torch.zeros_like(v)
    for t in range(v.shape[1] - 1, -1, -1):
        a_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        adv[:, t] = a_t * m[:, t]
        # An invalid position passes the next valid token's value and advantage through.
        next_value = torch.where(m[:, t] > 0, v[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, a_t, next_adv)
    return adv, (adv + v) * m


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [B, T] for GAE.

    The outcome reward ``rewards`` [B] of each sequence on its last valid token (highest t with mask
    1), 0 elsewhere; a row without tokens gets none.
    """
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [B] and mask [B, T]; got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    valid = mask.bool()
    t = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(valid, t, -1).max(dim=1).values  # [B]; -1: no valid token
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero().squeeze(1)
    out[rows, last[rows]] = rewards.float()[rows]
    return out


def whiten_advantages(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """PPO's advantage whitening over the valid tokens of the batch.

    A' = (A − mean) / (std + ε), mean and std (Bessel) over tokens with mask 1; 0 elsewhere.
    """
    if advantages.shape != mask.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and mask {tuple(mask.shape)} must share a shape")
    valid = mask.bool()
    a = advantages.double()
    picked = a[valid]
    if picked.numel() < 2:
        raise ValueError(f"whitening needs at least 2 valid tokens, got {picked.numel()}")
    if picked.amax() == picked.amin():  # all equal: exactly 0, not rounding error / ε
        return torch.zeros(a.shape, dtype=torch.float32, device=a.device)
    return torch.where(valid, (a - picked.mean()) / (picked.std() + eps), 0.0).float()


ESTIMATORS = ADVANTAGE_ESTIMATORS  # name -> function (read-only mapping; register with the decorator)


def needs_critic(name: str) -> bool:
    """The estimator registered as ``name`` works from a critic's per-token values (GAE).

    The trainer builds and trains one, and its advantages are per token, not per group.
    """
    return bool(ADVANTAGE_ESTIMATORS.entry(name).meta["critic"])


def get_estimator(name: str) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """The estimator registered under ``name``; an unknown name raises one line listing the known ones."""
    return ADVANTAGE_ESTIMATORS.definition(name)


def compute_advantages(name: str, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dispatch by config name.

    ``compute_advantages("qae", rewards=r, k=0.4)``, ``compute_advantages("gae", values=v,
    rewards=r, mask=m, gamma=1.0, lam=0.95)``.

    Arguments the estimator does not take raise one line naming those it takes.
    """
    result: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = ADVANTAGE_ESTIMATORS.call(name, *args, **kwargs)
    return result
