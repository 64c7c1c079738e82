"""The partial-rollout gain of ``--plan`` (launch/partial_gain.py) on distributions solved by hand."""

import math

import pytest

from armor_megatron.launch.partial_gain import LengthDistribution, lognormal_lengths, partial_generation_ratio
from armor_megatron.launch.step_time import plan_step_time
from armor_megatron.models.arch import ModelArch

from .test_step_time import TINY_GPU


def test_uniform_lengths_by_hand():
    # L ~ U(0, 1): E[L] = 1/2, E[max of n] = n/(n + 1); n = 4: ratio (1/2)/(4/5) = 5/8
    uniform = LengthDistribution(lambda x: x, 1.0)
    assert uniform.mean() == pytest.approx(0.5)
    assert uniform.expected_max(4) == pytest.approx(0.8)
    assert partial_generation_ratio(uniform, 4) == pytest.approx(5 / 8)
    assert partial_generation_ratio(uniform, 4, running=8) == pytest.approx(5 / 16)  # twice the batch, half the time
    with pytest.raises(ValueError, match="run at once"):
        partial_generation_ratio(uniform, 4, running=2)


def test_two_lengths_with_truncation_by_hand():
    # half the responses stop at 1 token, half reach the limit 2: E[L] = 1.5, E[max of 2] = 2 − P(both 1) = 1.75
    two = LengthDistribution(lambda x: 0.0 if x < 1 else 0.5, 2.0)
    assert two.mean() == pytest.approx(1.5)
    assert partial_generation_ratio(two, 2) == pytest.approx(1.5 / 1.75)


def test_lognormal_lengths_meet_their_mean_and_degenerate_to_no_gain():
    lengths = lognormal_lengths(mean=20.0, sigma=0.47, max_len=48.0)
    assert lengths.mean() == pytest.approx(20.0, rel=1e-6)
    median = next(x / 100 for x in range(1, 4800) if lengths.cdf(x / 100) >= 0.5)
    assert lengths.cdf(median * math.exp(2.326 * 0.47)) == pytest.approx(0.99, abs=1e-3)  # p99/p50 = e^(2.326σ)
    assert partial_generation_ratio(lognormal_lengths(20.0, 0.0, 48.0), 32) == pytest.approx(1.0)  # one length
    assert partial_generation_ratio(lognormal_lengths(48.0, 0.47, 48.0), 32) == pytest.approx(1.0)  # all at the limit
    assert (
        0 < partial_generation_ratio(lengths, 32) < partial_generation_ratio(lengths, 4) < 1
    )  # a longer tail to wait for


def test_plan_shows_the_gain_with_partial_rollouts_on(load):
    base = (*TINY_GPU, "anchor.enabled=false", "launch.step_time.response_len_fraction=0.4")
    cfg = load("tiny_cpu", *base, "rollout.partial.enabled=true")
    table = plan_step_time(cfg, ModelArch.from_hf_config(cfg.model.arch)).table()
    expected = partial_generation_ratio(lognormal_lengths(40.0, 0.47, 100.0), 2 * 4)
    assert f"partial rollouts: generation {expected:.2f} x the time of waiting for the longest of the step's 8" in table
    off = load("tiny_cpu", *base)
    assert "partial rollouts" not in plan_step_time(off, ModelArch.from_hf_config(off.model.arch)).table()
