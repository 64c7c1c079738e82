"""The anchor side of a run, from its config: source -> rejection sampler -> cache."""

from __future__ import annotations

from typing import Any

from armor_megatron.config.schema import RunConfig
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorRollout, AnchorSampler, AnchorSamplingConfig, single_turn
from armor_megatron.rollout.anchor.source import ANCHOR_SOURCES, WeightProvider, make_anchor_source
from armor_megatron.rollout.engine import RolloutEngine, SamplingParams


def anchor_reward(text: str, truth: tuple[Any, ...], trajectory: Any = None) -> float:
    """An anchor candidate's reward, by its row's own verifier.

    ``truth`` is its row's ``(verifier, answer)`` or ``(verifier, answer, row fields[, environment
    row])`` (`trainer.rollout_phase.anchor_truths`), so an anchor passes exactly the check its group
    is scored with (a group verifier judges the candidate alone, as a group of one); ``trajectory``:
    a multi-turn candidate's turns, for a verifier that names that field.
    """
    from armor_megatron.rewards import load_verifier

    spec, answer, *rest = truth
    fields = {**rest[0], "trajectory": trajectory} if rest else None
    return load_verifier(spec)(text, answer, fields).score


def anchor_source_kind(cfg: RunConfig) -> str:
    """``anchor.source``, except ``swap`` with ``lora.sync: adapter``: ``base``.

    There the policy engines hold the base (π_ref) and the policy's adapter, so anchors are
    requests that name no adapter: nothing to swap.
    """
    adapter_sync = cfg.lora.enabled and cfg.lora.sync == "adapter"
    return "base" if adapter_sync and cfg.anchor.source == "swap" else cfg.anchor.source


def source_keeps_host_weights(cfg: RunConfig) -> bool:
    """Whether the configured anchor source needs the weights as host copies (not a stream)."""
    return cfg.anchor.enabled and ANCHOR_SOURCES[anchor_source_kind(cfg)].keeps_host_weights


def build_anchor_cache(
    cfg: RunConfig,
    sampling: SamplingParams,
    *,
    reference_engine: RolloutEngine | None,
    policy_engine: RolloutEngine | None = None,
    reference_weights: WeightProvider | None = None,
    policy_weights: WeightProvider | None = None,
    reference_version: str = "ref-0",
    rollout: AnchorRollout = single_turn,
) -> AnchorCache | None:
    """None without anchors.

    With ``anchor.cache: false`` the trainer empties the cache every step, so anchors are never
    reused and one code path serves both. ``rollout``: how π_ref's responses are drawn (a
    multi-turn run's environment loop, `AnchorSampler`).
    """
    an = cfg.anchor
    if not an.enabled:
        return None
    source = make_anchor_source(
        anchor_source_kind(cfg),
        policy_engine=policy_engine,
        reference_engine=reference_engine,
        reference_weights=reference_weights,
        reference_version=reference_version,
        policy_weights=policy_weights,
    )
    sampler = AnchorSampler(source, anchor_reward, AnchorSamplingConfig.from_run_config(an, sampling), rollout)
    return AnchorCache(sampler, max_pool=an.cache_size_per_prompt, seed=cfg.rollout.seed)
