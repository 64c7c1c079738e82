import pytest

from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorSampler, AnchorSamplingConfig
from armor_megatron.rollout.anchor.source import SeparateReference, SwapReference
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.testing.tiny_models import tiny_weights

from .test_sampler import SAMPLING, UNSOLVABLE, setup, starts_with  # noqa: F401 - fixture


def make_cache(ref, **kw):
    sampler = AnchorSampler(
        SeparateReference(ref), starts_with, AnchorSamplingConfig(max_tries=4, tries_per_request=2, sampling=SAMPLING)
    )
    return AnchorCache(sampler, **kw)


@pytest.fixture
def ref(setup):
    cfg, tok, _, _, _ = setup
    return LocalEngine(cfg, tiny_weights(cfg, seed=0, sharpen=100.0), tokenizer=tok, weight_version="ref-0", seed=1)


def test_hits_after_the_first_epoch(setup, ref):
    _, _, _, prompts, truths = setup
    cache = make_cache(ref)
    first = cache.get(prompts, truths)
    assert not any(r.cached for r in first) and cache.stats.hit_rate == 0
    second = cache.get(prompts, truths)
    solvable = [t != UNSOLVABLE for t in truths]
    assert [r.cached for r in second] == solvable
    assert all(r.generated_tokens == 0 and r.anchor.text.startswith(t) for r, t in zip(second, truths) if r.cached)
    assert [r.anchor.prompt_index for r in second if r.found] == [0, 1, 2, 3]
    # Unsolvable prompts are tried again (give_up_after=None): they cost tokens, and find nothing.
    assert all(r.generated_tokens > 0 and not r.found for r, s in zip(second, solvable) if not s)
    assert cache.stats.hit_rate == pytest.approx(4 / 12)


def test_give_up_after_skips_prompts_the_reference_failed(setup, ref):
    _, _, _, prompts, truths = setup
    cache = make_cache(ref, give_up_after=1)
    cache.get(prompts, truths)
    second = cache.get(prompts, truths)
    assert sum(r.generated_tokens for r in second) == 0
    assert cache.stats.skipped == 2


def test_reference_reset_empties_the_cache(setup, ref):
    cfg, _, _, prompts, truths = setup
    cache = make_cache(ref)
    cache.get(prompts, truths)
    assert cache.num_anchors > 0
    cache.sampler.source.reset(tiny_weights(cfg, seed=4, sharpen=100.0), version="ref-1")
    after = cache.get(prompts, truths)
    assert not any(r.cached for r in after)  # pools of ref-0 are gone
    assert cache.version == "ref-1" and cache.stats.invalidations == 1
    assert all(r.anchor.weight_version == "ref-1" for r in after if r.found)
    cache.reset()
    assert cache.num_anchors == 0


def test_max_uses_limits_reuse(setup, ref):
    _, _, _, prompts, truths = setup
    cache = make_cache(ref, max_pool=1, max_uses=2)
    cache.get(prompts[:1], truths[:1])  # sampled: first use
    assert cache.get(prompts[:1], truths[:1])[0].cached  # second use, then dropped
    assert not cache.get(prompts[:1], truths[:1])[0].cached


@pytest.mark.timeout(60)
def test_prefetch_in_background_then_hits(setup, ref):
    _, _, _, prompts, truths = setup
    cache = make_cache(ref)
    cache.prefetch(prompts, truths)
    results = cache.get(prompts, truths)  # waits for the prefetch
    assert [r.cached for r in results] == [t != UNSOLVABLE for t in truths]
    # The prefetch spent the unsolvable prompts' tries: the lookup does not try them again.
    assert all(r.generated_tokens == 0 and not r.found for r, t in zip(results, truths) if t == UNSOLVABLE)
    assert cache.sampler.stats.tries == 4 * 2 + 2 * 4


def test_prefetch_refuses_a_swap_reference(setup, ref):
    cfg, _, _, prompts, truths = setup
    weights = tiny_weights(cfg, seed=0)
    sampler = AnchorSampler(SwapReference(ref, weights, "ref-x", weights), starts_with)
    with pytest.raises(ValueError, match="separate"):
        AnchorCache(sampler).prefetch(prompts, truths)


def test_state_dict_round_trip(setup, ref):
    _, _, _, prompts, truths = setup
    cache = make_cache(ref)
    cache.get(prompts, truths)
    restored = make_cache(ref)
    restored.load_state_dict(cache.state_dict())
    assert restored.num_anchors == cache.num_anchors
    a, b = cache.get(prompts, truths), restored.get(prompts, truths)
    assert [r.anchor for r in a if r.cached] == [r.anchor for r in b if r.cached]


class _Echo:
    """An environment that answers the first turn with "=" and ends the episode at the second."""

    def __init__(self, row):
        self.turns = 0

    def step(self, response):
        self.turns += 1
        return "=" if self.turns == 1 else None


def test_multi_turn_anchors_keep_their_mask_and_trajectory_through_a_checkpoint(setup, ref):
    import io

    import torch

    from armor_megatron.rollout.multiturn import EnvironmentSettings, MultiTurnRollout

    _, tok, _, prompts, truths = setup
    env = MultiTurnRollout(
        EnvironmentSettings(spec="tests:_Echo", max_turn_tokens=2),
        lambda t: tok.encode(t, add_special_tokens=False),
        _Echo,
    )
    config = AnchorSamplingConfig(max_tries=4, tries_per_request=2, sampling=SAMPLING)
    sampler = AnchorSampler(
        SeparateReference(ref), lambda text, t, trajectory: starts_with(text, t[1]), config, env.anchor_rollout
    )
    rows = [
        ("v", t, {}, {"index": i}) for i, t in enumerate(truths)
    ]  # (verifier, answer, fields, row), as the trainer's
    cache = AnchorCache(sampler)
    found = [r.anchor for r in cache.get(prompts, rows) if r.found]
    assert found and all(a.loss_mask == (1, 1, 0, 1, 1) and len(a.trajectory) == 2 for a in found)
    buffer = io.BytesIO()
    torch.save(cache.state_dict(), buffer)  # as trainer_state.pt holds it, read back with weights_only
    restored = AnchorCache(sampler)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    a, b = cache.get(prompts, rows), restored.get(prompts, rows)
    assert [r.anchor for r in a if r.cached] == [r.anchor for r in b if r.cached] != []
