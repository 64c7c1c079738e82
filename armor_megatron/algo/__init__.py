"""The ARMOR algorithm in pure torch: mixed ratio, clipped loss, advantages, anchors,
DAPO's dynamic sampling and overlong shaping, reference reset schedules.

Nothing here imports megatron or a rollout engine; tensors in, tensors out.
"""

from armor_megatron.algo.advantages import ESTIMATORS, compute_advantages, gae_advantages, get_estimator
from armor_megatron.algo.anchors import AnchorGroups, anchor_zero_advantage_rate, assemble_anchor_groups
from armor_megatron.algo.dynamic_sampling import DynamicSampler, dynamic_sampling_keep
from armor_megatron.algo.loss import PolicyLossConfig, loss_normalizer, policy_loss
from armor_megatron.algo.metrics import reduce_loss_metrics
from armor_megatron.algo.overlong import apply_overlong_shaping, overlong_penalty
from armor_megatron.algo.ratio import mixed_log_ratio, mixture_weight, trust_region_bounds
from armor_megatron.algo.reset import ResetSchedule, build_reset_schedule

__all__ = [
    "ESTIMATORS", "AnchorGroups", "DynamicSampler", "PolicyLossConfig", "ResetSchedule",
    "anchor_zero_advantage_rate", "apply_overlong_shaping", "assemble_anchor_groups", "build_reset_schedule",
    "compute_advantages", "dynamic_sampling_keep", "gae_advantages", "get_estimator", "loss_normalizer",
    "mixed_log_ratio", "mixture_weight", "overlong_penalty", "policy_loss", "reduce_loss_metrics",
    "trust_region_bounds",
]
