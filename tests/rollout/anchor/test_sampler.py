"""Anchor rejection sampling against a tiny, confident reference model (LocalEngine).

The reference is sharpened (lm_head × 100). A prompt is *solvable* when the reference puts
at least 85% on one first character and the ground truth is that character (reward: the
response starts with the ground truth): 4 tries all fail with probability < 1e-3. It is
*unsolvable* when the ground truth is '#', a character outside the tokenizer's alphabet
that no response can contain.
"""

import pytest
import torch

from armor_megatron.rollout.anchor.sampler import AnchorSampler, AnchorSamplingConfig
from armor_megatron.rollout.anchor.source import SeparateReference, SwapReference, make_anchor_source
from armor_megatron.rollout.engine import SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.testing.tiny_models import build_char_tokenizer, encode, tiny_config, tiny_weights

UNSOLVABLE = "#"
SAMPLING = SamplingParams(max_new_tokens=4, ignore_eos=True)


def starts_with(text, gt):
    return float(text.startswith(gt))


@pytest.fixture(scope="module")
def setup():
    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok))
    ref = LocalEngine(cfg, tiny_weights(cfg, seed=0, sharpen=100.0), tokenizer=tok, weight_version="ref-0", seed=1)
    solvable = []
    for text in ("1+1=", "2+3=", "what", "9*9", "7-2=", "xyz", "abc", "12", "q"):
        ids = encode(tok, text)
        with torch.no_grad():
            probs = torch.softmax(ref.model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        if probs.max() >= 0.85:
            solvable.append((ids, tok.decode([int(probs.argmax())])))
    assert len(solvable) >= 4, "the tiny reference is not confident enough on the candidate prompts"
    prompts = [ids for ids, _ in solvable[:4]] + [encode(tok, "5+5="), encode(tok, "hi")]
    truths = [gt for _, gt in solvable[:4]] + [UNSOLVABLE, UNSOLVABLE]
    return cfg, tok, ref, prompts, truths


@pytest.fixture(autouse=True)
def fresh_sampling(setup):
    """Every test draws the same numbers from the shared reference, whatever ran before it: the
    engine's call counter (call i samples with seed + i) starts over."""
    setup[2].reseed(1)


def test_anchor_found_exactly_where_the_reference_can_solve(setup):
    _, _, ref, prompts, truths = setup
    sampler = AnchorSampler(
        SeparateReference(ref), starts_with, AnchorSamplingConfig(max_tries=4, tries_per_request=2, sampling=SAMPLING)
    )
    results = sampler.sample(prompts, truths)
    for i, r in enumerate(results):
        assert r.prompt_index == i
        if truths[i] == UNSOLVABLE:
            assert r.anchor is None and r.tries == 4 and r.generated_tokens == 4 * 4
        else:
            assert r.anchor is not None and r.anchor.text.startswith(truths[i])
            assert r.anchor.weight_version == "ref-0" and r.anchor.prompt_index == i
            assert r.tries == 2  # found in the first round of two: no second round
    assert sampler.stats.found_rate == pytest.approx(4 / 6)
    assert sampler.stats.tries == 4 * 2 + 2 * 4
    assert sampler.stats.generated_tokens == sum(r.generated_tokens for r in results)


def test_positive_anchors_only(setup):
    _, _, ref, prompts, truths = setup
    half_credit = lambda text, gt: 0.5  # noqa: E731 - never a full reward
    results = AnchorSampler(
        SeparateReference(ref), half_credit, AnchorSamplingConfig(max_tries=2, sampling=SAMPLING)
    ).sample(prompts, truths)
    assert not any(r.found for r in results)


def test_mismatched_inputs_are_one_clear_error(setup):
    _, _, ref, prompts, truths = setup
    with pytest.raises(ValueError, match="6 prompts but 5 ground truths"):
        AnchorSampler(SeparateReference(ref), starts_with).sample(prompts, truths[:5])


def test_swap_reference_pushes_reference_in_and_policy_back(setup):
    cfg, tok, _, prompts, truths = setup
    policy_weights = tiny_weights(cfg, seed=3, sharpen=100.0)
    reference_weights = tiny_weights(cfg, seed=0, sharpen=100.0)
    engine = LocalEngine(cfg, policy_weights, tokenizer=tok, weight_version="policy-7")
    greedy = SamplingParams(max_new_tokens=3, temperature=0)
    before = engine.generate(prompts, 1, greedy)
    source = SwapReference(engine, reference_weights, "ref-0", policy_weights)
    results = AnchorSampler(
        source, starts_with, AnchorSamplingConfig(max_tries=4, tries_per_request=2, sampling=SAMPLING)
    ).sample(prompts, truths)
    assert [r.found for r in results] == [True] * 4 + [False] * 2
    assert all(r.anchor.weight_version == "ref-0" for r in results if r.found)
    assert engine.weight_version == "policy-7"
    assert engine.generate(prompts, 1, greedy) == before


def test_anchor_source_switch(setup):
    _, _, ref, _, _ = setup
    assert isinstance(make_anchor_source("separate", reference_engine=ref), SeparateReference)
    with pytest.raises(ValueError, match="'swap' needs reference_weights, reference_version, policy_weights"):
        make_anchor_source("swap", policy_engine=ref)
    with pytest.raises(ValueError, match="must be one of"):
        make_anchor_source("colocated")
