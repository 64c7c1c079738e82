"""Data containers shared by the rollout side, the algorithm and the trainer."""

from armor_megatron.data.batch import RolloutBatch

__all__ = ["RolloutBatch"]
