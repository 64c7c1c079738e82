"""Rollout: engines that sample responses, weight sync from the trainer, and ARMOR anchors.

Never imports ``armor_megatron.megatron`` (engines receive HF-named tensors) and imports
neither torch nor SGLang at import time.

================================  =====================================================
module                            what
================================  =====================================================
``engine``                        ``RolloutEngine`` interface, ``SamplingParams``, ``Sample``
``local``                         in-process transformers engine (CPU, tests, the double)
``multiturn``                     multi-turn rollouts with tools on any engine, the loss mask
``sglang.client``                 HTTP client of one SGLang server: retries, error shapes
``sglang.engine``                 ``SGLangEngine``: servers or a router, concurrency
``sglang.launcher``               start/stop ``sglang.launch_server`` (+ ``sglang-router``)
``sglang.weight_sync``            ``tensor`` / ``distributed`` / ``disk`` weight pushes
``anchor.source``                 π_ref as a ``separate`` engine or ``swap``-ped in
``anchor.sampler``                rejection sampling of verified anchors, statistics
``anchor.cache``                  per-prompt anchor pools valid until a reference reset
``anchor.build``                  the anchor side of a run from its config
``testing.sglang_test_server``    TEST DOUBLE of the SGLang HTTP server (not SGLang)
================================  =====================================================

One ARMOR step on this package (group size G, reference reset every τ steps)::

    anchors = cache.get(prompts, answers, keys=prompt_ids)      # π_ref, verified, often cached
    groups = policy.generate(prompts, G - 1, sampling)           # π_old
    # a group without anchor gets one more policy.generate(...) sample
    cache.prefetch(next_prompts, next_answers, keys=next_ids)    # while the trainer updates
    ...train...
    policy.update_weights(hf_named_tensors, version=f"step-{t}")
    if t % tau == 0:
        reference.reset(hf_named_tensors, version=f"ref-{t}")    # pools of the old π_ref drop
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
