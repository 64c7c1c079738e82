"""The ARMOR algorithm in pure torch.

Mixed ratio, clipped loss (with an optional KL penalty to π_ref), advantages, anchors, PPO value
loss, DAPO's dynamic sampling and overlong shaping, reference reset schedules.

Nothing here imports megatron or a rollout engine; tensors in, tensors out. Advantage
estimators, policy losses and reset schedules are looked up by name in registries (registry.py):
``compute_advantages(name, rewards=..., **kwargs)``, ``get_policy_loss(name)`` with
``make_policy_loss_config(name, **hyper_parameters)``, ``build_reset_schedule(name, **params)``.
"""

from armor_megatron.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATORS,
    compute_advantages,
    gae_advantages,
    get_estimator,
    needs_critic,
    outcome_token_rewards,
    register_advantage_estimator,
    whiten_advantages,
)
from armor_megatron.algo.anchors import AnchorGroups, anchor_zero_advantage_rate, assemble_anchor_groups
from armor_megatron.algo.dynamic_sampling import DynamicSampler, dynamic_sampling_keep
from armor_megatron.algo.kl import KL_ESTIMATORS, kl_estimate
from armor_megatron.algo.loss import (
    POLICY_LOSSES,
    PolicyLossConfig,
    aggregate_token_loss,
    get_policy_loss,
    loss_normalizer,
    make_policy_loss_config,
    policy_loss,
    register_policy_loss,
)
from armor_megatron.algo.metrics import reduce_loss_metrics
from armor_megatron.algo.overlong import apply_overlong_shaping, overlong_penalty
from armor_megatron.algo.ratio import mixed_log_ratio, mixture_weight, trust_region_bounds
from armor_megatron.algo.reset import RESET_SCHEDULES, ResetSchedule, build_reset_schedule, register_reset_schedule
from armor_megatron.algo.tis import truncated_is_weights
from armor_megatron.algo.value_loss import (
    ValueLossConfig,
    explained_variance,
    explained_variance_from_moments,
    value_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "RESET_SCHEDULES",
    "AnchorGroups",
    "DynamicSampler",
    "PolicyLossConfig",
    "ResetSchedule",
    "ValueLossConfig",
    "aggregate_token_loss",
    "anchor_zero_advantage_rate",
    "apply_overlong_shaping",
    "assemble_anchor_groups",
    "build_reset_schedule",
    "compute_advantages",
    "dynamic_sampling_keep",
    "explained_variance",
    "explained_variance_from_moments",
    "gae_advantages",
    "kl_estimate",
    "get_estimator",
    "get_policy_loss",
    "loss_normalizer",
    "make_policy_loss_config",
    "mixed_log_ratio",
    "mixture_weight",
    "needs_critic",
    "outcome_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "reduce_loss_metrics",
    "register_advantage_estimator",
    "register_policy_loss",
    "register_reset_schedule",
    "truncated_is_weights",
    "trust_region_bounds",
    "value_loss",
    "whiten_advantages",
]
