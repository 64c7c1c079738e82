"""The ARMOR algorithm in pure torch: mixed ratio, clipped loss, advantages, anchors, PPO value loss,
DAPO's dynamic sampling and overlong shaping, reference reset schedules.

Nothing here imports megatron or a rollout engine; tensors in, tensors out.
"""

from armor_megatron.algo.advantages import (
    ESTIMATORS,
    compute_advantages,
    gae_advantages,
    get_estimator,
    outcome_token_rewards,
    whiten_advantages,
)
from armor_megatron.algo.anchors import AnchorGroups, anchor_zero_advantage_rate, assemble_anchor_groups
from armor_megatron.algo.dynamic_sampling import DynamicSampler, dynamic_sampling_keep
from armor_megatron.algo.loss import PolicyLossConfig, aggregate_token_loss, loss_normalizer, policy_loss
from armor_megatron.algo.metrics import reduce_loss_metrics
from armor_megatron.algo.overlong import apply_overlong_shaping, overlong_penalty
from armor_megatron.algo.ratio import mixed_log_ratio, mixture_weight, trust_region_bounds
from armor_megatron.algo.reset import ResetSchedule, build_reset_schedule
from armor_megatron.algo.value_loss import (
    ValueLossConfig,
    explained_variance,
    explained_variance_from_moments,
    value_loss,
)

__all__ = [
    "ESTIMATORS",
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
    "get_estimator",
    "loss_normalizer",
    "mixed_log_ratio",
    "mixture_weight",
    "outcome_token_rewards",
    "overlong_penalty",
    "policy_loss",
    "reduce_loss_metrics",
    "trust_region_bounds",
    "value_loss",
    "whiten_advantages",
]
