"""Advantages of the batch that trains, in one place.

Group estimators on the driver, critic estimators (GAE) with the critic. Which one applies is the
estimator's registered ``critic`` trait (``algo.needs_critic``); its hyper-parameters come from its
registered ``algorithm`` config keys.

* ``group_advantages(batch, settings)``: once per step, after dynamic sampling has chosen the
  groups (estimators normalised over the whole batch, REINFORCE++, must see exactly those):
  ``advantages`` [N] fp32 = the configured estimator (``algo.compute_advantages``) over the
  rewards viewed as [P, G], each group whole, anchor included; zeros for a critic estimator,
  whose per-token advantages come from the critic.
* ``gae_targets(batch, cfg)``: on every rank, from the critic's ``old_values`` [N, L]: the critic
  estimator's per-token advantages and returns [N, L].
"""

from __future__ import annotations

import torch

from armor_megatron.algo import (
    ADVANTAGE_ESTIMATORS,
    anchor_zero_advantage_rate,
    compute_advantages,
    needs_critic,
    outcome_token_rewards,
    whiten_advantages,
)
from armor_megatron.config.schema import RunConfig
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.trainer.rollout_phase import RolloutSettings


def group_advantages(batch: RolloutBatch, settings: RolloutSettings) -> tuple[RolloutBatch, dict[str, float]]:
    """Set ``batch["advantages"]`` [N] (see module docstring).

    Returns the batch and ``anchor/zero_advantage_rate`` (QAE's zero mask can drop anchors) when it
    holds anchors.
    """
    rewards = batch["rewards"].view(-1, settings.group_size)
    if needs_critic(settings.estimator):
        batch["advantages"] = torch.zeros(rewards.numel(), dtype=torch.float32)
        return batch, {}
    advantages = compute_advantages(settings.estimator, rewards=rewards, **settings.estimator_kwargs)
    assert isinstance(advantages, torch.Tensor)  # a group estimator: one tensor (GAE took the branch above)
    batch["advantages"] = advantages.reshape(-1).float()
    metrics = {}
    is_anchor = batch["is_anchor"].view_as(rewards)
    if is_anchor.any():
        metrics["anchor/zero_advantage_rate"] = anchor_zero_advantage_rate(advantages, is_anchor).item()
    return batch, metrics


def gae_targets(batch: dict[str, torch.Tensor], cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token (advantages, returns) [N, L] from the critic's ``old_values`` [N, L].

    The outcome reward ``rewards`` [N] on each response's last token, the critic estimator
    ``algorithm.estimator`` (GAE with algorithm.gamma / lam) over the response tokens, advantages
    whitened over the batch when critic.whiten_advantages. All inputs on the host.
    """
    mask = batch["response_mask"]
    rewards = outcome_token_rewards(batch["rewards"], mask)
    advantages, returns = ADVANTAGE_ESTIMATORS.call_configured(
        cfg.algorithm.estimator, cfg.algorithm, values=batch["old_values"], rewards=rewards, mask=mask
    )
    if cfg.critic.whiten_advantages:
        advantages = whiten_advantages(advantages, mask)
    return advantages, returns
