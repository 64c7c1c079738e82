"""Rollout: engines that sample responses (SGLang over HTTP, a local transformers engine),
weight sync from the trainer (HF-named tensors), and the ARMOR anchor sampler with its cache.

Never imports ``armor_megatron.megatron``; SGLang itself is only imported where it is used.
"""

from armor_megatron.rollout.engine import (
    EngineUnavailableError,
    RolloutEngine,
    RolloutError,
    Sample,
    SamplingParams,
    StaleWeightsError,
    WeightUpdateError,
)

__all__ = [
    "EngineUnavailableError",
    "RolloutEngine",
    "RolloutError",
    "Sample",
    "SamplingParams",
    "StaleWeightsError",
    "WeightUpdateError",
]
