"""The anchor side of a run, from its config: source -> rejection sampler -> cache."""

from __future__ import annotations

from typing import Any

from armor_megatron.config.schema import RunConfig
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorSampler, AnchorSamplingConfig
from armor_megatron.rollout.anchor.source import ANCHOR_SOURCES, WeightProvider, make_anchor_source
from armor_megatron.rollout.engine import RolloutEngine, SamplingParams


def anchor_reward(text: str, truth: tuple[Any, Any]) -> float:
    """An anchor candidate's reward, by its row's own verifier.

    ``truth`` is the row's ``(verifier, answer)``, so an anchor passes exactly the check its
    group is scored with.
    """
    from armor_megatron.rewards import load_verifier

    spec, answer = truth
    return load_verifier(spec)(text, answer).score


def source_keeps_host_weights(cfg: RunConfig) -> bool:
    """Whether the configured anchor source needs the weights as host copies (not a stream)."""
    return cfg.anchor.enabled and ANCHOR_SOURCES[cfg.anchor.source].keeps_host_weights


def build_anchor_cache(
    cfg: RunConfig,
    sampling: SamplingParams,
    *,
    reference_engine: RolloutEngine | None,
    policy_engine: RolloutEngine | None = None,
    reference_weights: WeightProvider | None = None,
    policy_weights: WeightProvider | None = None,
    reference_version: str = "ref-0",
) -> AnchorCache | None:
    """None without anchors.

    With ``anchor.cache: false`` the trainer empties the cache every step, so anchors are never
    reused and one code path serves both.
    """
    an = cfg.anchor
    if not an.enabled:
        return None
    source = make_anchor_source(
        an.source,
        policy_engine=policy_engine,
        reference_engine=reference_engine,
        reference_weights=reference_weights,
        reference_version=reference_version,
        policy_weights=policy_weights,
    )
    sampler = AnchorSampler(source, anchor_reward, AnchorSamplingConfig.from_run_config(an, sampling))
    return AnchorCache(sampler, max_pool=an.cache_size_per_prompt, seed=cfg.rollout.seed)
