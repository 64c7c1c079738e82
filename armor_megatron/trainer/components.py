"""Turn a RunConfig into the pieces the loop uses: losses, reset schedule, sampling, rollout settings,
the rollout engines and the anchor cache. Nothing here runs a step."""

from __future__ import annotations

import dataclasses

from armor_megatron.algo import PolicyLossConfig, ValueLossConfig, build_reset_schedule
from armor_megatron.config.schema import RunConfig
from armor_megatron.rollout.anchor_cache import AnchorCache
from armor_megatron.rollout.anchor_source import make_anchor_source
from armor_megatron.rollout.anchors import AnchorConfig, AnchorSampler
from armor_megatron.rollout.engine import RolloutEngine, SamplingParams
from armor_megatron.trainer.rollout_phase import RolloutSettings


def loss_config(cfg: RunConfig) -> PolicyLossConfig:
    algo = cfg.algorithm
    return PolicyLossConfig(
        alpha=algo.alpha,
        eps_low=algo.eps_low,
        eps_high=algo.eps_high,
        dual_clip_c=algo.dual_clip_c,
        loss_agg=algo.loss_agg,
    )


def value_loss_config(cfg: RunConfig) -> ValueLossConfig:
    """The critic's loss: its value clip, aggregated like the policy loss."""
    return ValueLossConfig(clip_eps=cfg.critic.clip_eps, loss_agg=cfg.algorithm.loss_agg)


def reset_schedule(cfg: RunConfig):
    ref = cfg.reference
    if ref.reset == "every":
        return build_reset_schedule("every", tau=ref.tau)
    if ref.reset == "two_stage":
        return build_reset_schedule("two_stage", first_stage_steps=ref.stage_one_steps, tau=ref.tau)
    if ref.reset == "validation_best":
        return build_reset_schedule("validation_best", metric=ref.validation_metric)
    if ref.reset == "validation_hook":
        return build_reset_schedule("validation_hook", hook=ref.validation_hook)
    return build_reset_schedule("never")


def rollout_sampling(cfg: RunConfig, eos_ids: tuple[int, ...] = ()) -> SamplingParams:
    ro = cfg.rollout
    # No per-request seed: every request must draw fresh samples; the loop reseeds the engines
    # at each step from rollout.seed and the step, so runs are reproducible and resumable.
    return SamplingParams(
        max_new_tokens=ro.max_response_len,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        stop_token_ids=eos_ids,
    )


def eval_sampling(cfg: RunConfig, eos_ids: tuple[int, ...] = ()) -> SamplingParams:
    ev = cfg.eval
    return SamplingParams(
        max_new_tokens=ev.max_response_len,
        temperature=ev.temperature,
        top_p=ev.top_p,
        stop_token_ids=eos_ids,
        seed=cfg.rollout.seed,
    )


def rollout_settings(cfg: RunConfig, sampling: SamplingParams) -> RolloutSettings:
    algo = cfg.algorithm
    kwargs = {"k": algo.qae_quantile} if algo.estimator == "qae" else {}
    if algo.estimator in ("dapo", "grpo", "qae", "reinforce++", "reinforce++-baseline"):
        kwargs["eps"] = algo.std_eps
    return RolloutSettings(
        group_size=cfg.rollout.group_size,
        sampling=sampling,
        estimator=algo.estimator,
        estimator_kwargs=kwargs,
        verifier=cfg.reward.verifier,
        overlong_buffer=algo.overlong.buffer_len if algo.overlong.enabled else None,
        overlong_penalty=algo.overlong.penalty,
        reward_workers=cfg.reward.workers,
        timeout=cfg.rollout.sglang.request_timeout_s if cfg.rollout.engine == "sglang" else None,
    )


def anchor_reward(text: str, truth) -> float:
    """An anchor candidate's reward; ``truth`` is its row's ``(verifier, answer)``, so an anchor
    passes exactly the check its group will score it with."""
    from armor_megatron.rewards import load_verifier

    spec, answer = truth
    return load_verifier(spec)(text, answer).score


def anchor_cache(
    cfg: RunConfig,
    sampling: SamplingParams,
    *,
    reference_engine: RolloutEngine | None,
    policy_engine: RolloutEngine | None = None,
    reference_weights=None,
    policy_weights=None,
    reference_version: str = "ref-0",
) -> AnchorCache | None:
    """The anchor side: rejection sampler over the configured source, wrapped in the cache.

    With ``anchor.cache: false`` the loop empties the cache at every step, so anchors are never
    reused and the same code path serves both.
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
    if an.temperature is not None:
        sampling = dataclasses.replace(sampling, temperature=an.temperature)
    sampler = AnchorSampler(
        source,
        anchor_reward,
        AnchorConfig(max_tries=an.max_tries, tries_per_round=an.tries_per_request, sampling=sampling),
    )
    return AnchorCache(sampler, max_pool=an.cache_size_per_prompt, seed=cfg.rollout.seed)
