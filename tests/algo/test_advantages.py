import math

import pytest
import torch

from armor_megatron.algo.advantages import (
    ESTIMATORS,
    compute_advantages,
    drgrpo_advantages,
    gae_advantages,
    get_estimator,
    grpo_advantages,
    qae_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)

ONE_OF_FOUR = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # mean 0.25, Bessel std sqrt(0.75/3) = 0.5


def test_grpo_hand_example():
    # (1 − 0.25)/0.5 = 1.5, (0 − 0.25)/0.5 = −0.5
    torch.testing.assert_close(grpo_advantages(ONE_OF_FOUR, eps=0.0), torch.tensor([[1.5, -0.5, -0.5, -0.5]]))
    # All-equal groups get exactly zero; the anchor is an ordinary member.
    assert torch.equal(grpo_advantages(torch.ones(2, 4)), torch.zeros(2, 4))
    assert get_estimator("dapo") is grpo_advantages


def test_drgrpo_hand_example():
    torch.testing.assert_close(drgrpo_advantages(ONE_OF_FOUR), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_qae_binary_two_regimes():
    # K = 0.4 over G = 4 sorted rewards: position 0.4·3 = 1.2, between the 2nd and 3rd values.
    # hard prompt [1,0,0,0]: sorted [0,0,0,1] -> Q = 0: only the success moves, (1−0)/0.5 = 2
    # easy prompt [1,1,1,0]: sorted [0,1,1,1] -> Q = 1: only the failure moves, (0−1)/0.5 = −2
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(
        qae_advantages(rewards, k=0.4, eps=0.0), torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -2.0]])
    )


def test_qae_linear_interpolation():
    # G = 5 rewards [0, 0.5, 1, 2, 3]: position 0.4·4 = 1.6 -> Q = 0.5 + 0.6·(1 − 0.5) = 0.8;
    # mean 1.3, Bessel std = sqrt((1.3² + 0.8² + 0.3² + 0.7² + 1.7²)/4) = sqrt(5.8/4)
    rewards = torch.tensor([[0.0, 0.5, 1.0, 2.0, 3.0]])
    std = math.sqrt(5.8 / 4)
    expected = (rewards - 0.8) / std
    torch.testing.assert_close(qae_advantages(rewards, k=0.4, eps=0.0), expected)
    # G = 2 [0, 1]: Q_0.4 = 0.4, std = sqrt(0.5)
    torch.testing.assert_close(
        qae_advantages(torch.tensor([[0.0, 1.0]]), eps=0.0), torch.tensor([[-0.4, 0.6]]) / math.sqrt(0.5)
    )
    with pytest.raises(ValueError, match="quantile k"):
        qae_advantages(rewards, k=1.5)


def test_rloo_hand_example():
    # success: 1 − mean(0,0,0) = 1;  failure: 0 − mean(1,0,0) = −1/3
    torch.testing.assert_close(rloo_advantages(ONE_OF_FOUR), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))


def test_reinforce_pp_normalises_over_the_whole_batch():
    # batch [1,0,1,1]: mean 0.75, Bessel std sqrt((3·0.0625 + 0.5625)/3) = 0.5
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(reinforce_pp_advantages(rewards, eps=0.0), torch.tensor([[0.5, -1.5], [0.5, 0.5]]))


def test_reinforce_pp_baseline_hand_example():
    # centred by group: [[0.5, −0.5], [0, 0]]; batch std sqrt((0.25+0.25)/3) = sqrt(1/6)
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    s = math.sqrt(1 / 6)
    torch.testing.assert_close(
        reinforce_pp_baseline_advantages(rewards, eps=0.0), torch.tensor([[0.5 / s, -0.5 / s], [0.0, 0.0]])
    )


def test_gae_hand_example_with_padding():
    # γ = 0.9, λ = 0.8 (γλ = 0.72)
    # row 0, V = [1, 2, 3], r = [0, 0, 1], all valid:
    #   t2: δ = 1 − 3 = −2                 A = −2
    #   t1: δ = 0.9·3 − 2 = 0.7            A = 0.7 + 0.72·(−2) = −0.74
    #   t0: δ = 0.9·2 − 1 = 0.8            A = 0.8 + 0.72·(−0.74) = 0.2672
    # row 1, V = [1, 2, 99], r = [0, 1, 0], last position padding (its V ignored):
    #   t1: δ = 1 − 2 = −1                 A = −1
    #   t0: δ = 0.9·2 − 1 = 0.8            A = 0.8 − 0.72 = 0.08
    values = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 99.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae_advantages(values, rewards, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.2672, -0.74, -2.0], [0.08, -1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.2672, 1.26, 1.0], [1.08, 1.0, 0.0]]))


def test_gae_with_gamma_lambda_one_is_monte_carlo_return_minus_value():
    g = torch.Generator().manual_seed(0)
    values, rewards = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    adv, ret = gae_advantages(values, rewards, mask, gamma=1.0, lam=1.0)
    mc = rewards.flip(1).cumsum(1).flip(1)  # Σ_{t' ≥ t} r_t'
    torch.testing.assert_close(ret, mc)
    torch.testing.assert_close(adv, mc - values)


def test_registry_dispatch_and_errors():
    assert set(ESTIMATORS) >= {"grpo", "dapo", "drgrpo", "qae", "rloo", "reinforce++", "gae"}
    torch.testing.assert_close(
        compute_advantages("qae", rewards=ONE_OF_FOUR, k=0.4), qae_advantages(ONE_OF_FOUR, k=0.4)
    )
    adv, _ = compute_advantages("gae", values=torch.zeros(1, 2), rewards=torch.ones(1, 2), mask=torch.ones(1, 2))
    torch.testing.assert_close(adv, torch.tensor([[2.0, 1.0]]))
    with pytest.raises(ValueError, match="did you mean 'grpo'"):
        get_estimator("grp")
    with pytest.raises(ValueError, match=r"\[num_groups, G\] with G >= 2"):
        grpo_advantages(torch.ones(4))
    with pytest.raises(ValueError, match=r"\[num_groups, G\] with G >= 2"):
        rloo_advantages(torch.ones(4, 1))
    with pytest.raises(ValueError, match="gamma and lam"):
        gae_advantages(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), gamma=1.5)


def test_outcome_reward_sits_on_the_last_response_token():
    from armor_megatron.algo.advantages import outcome_token_rewards

    # row 0: response tokens at t = 1, 2 -> reward on t = 2; row 1: t = 1..3 -> t = 3; row 2: none
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    out = outcome_token_rewards(torch.tensor([1.0, -0.5, 7.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, -0.5], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"rewards must be \[B\] and mask \[B, T\]"):
        outcome_token_rewards(torch.ones(2), mask)


def test_whitening_over_valid_tokens():
    from armor_megatron.algo.advantages import whiten_advantages

    # valid values 1, 2, 3: mean 2, std (Bessel) 1 -> −1, 0, 1; the padding value 100 stays out and becomes 0
    adv = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    out = whiten_advantages(adv, torch.tensor([[1, 1], [1, 0]]), eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0], [1.0, 0.0]]))
    with pytest.raises(ValueError, match="whitening needs at least 2 valid tokens, got 1"):
        whiten_advantages(adv, torch.tensor([[1, 0], [0, 0]]))


# --- exact edge cases against an independent float64 implementation (pure Python) -------------


def _mean(xs):
    return math.fsum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _quantile(xs, k):
    s = sorted(xs)
    pos = k * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def _reference(name, groups, eps=1e-6, k=0.4):
    """Advantages in float64 from the formulas in the docstrings; an all-equal set gives 0."""
    flat = [x for g in groups for x in g]
    if name == "reinforce++":
        if max(flat) == min(flat):
            return [[0.0] * len(g) for g in groups]
        m, s = _mean(flat), _std(flat)
        return [[(x - m) / (s + eps) for x in g] for g in groups]
    if name == "reinforce++-baseline":
        centred = [[0.0 if max(g) == min(g) else x - _mean(g) for x in g] for g in groups]
        cflat = [x for g in centred for x in g]
        if max(cflat) == min(cflat) == 0.0:
            return centred
        s = _std(cflat)
        return [[x / (s + eps) for x in g] for g in centred]
    out = []
    for g in groups:
        if max(g) == min(g):
            out.append([0.0] * len(g))
            continue
        m, s, n = _mean(g), _std(g), len(g)
        if name == "grpo":
            out.append([(x - m) / (s + eps) for x in g])
        elif name == "drgrpo":
            out.append([x - m for x in g])
        elif name == "rloo":
            out.append([x - (math.fsum(g) - x) / (n - 1) for x in g])
        elif name == "qae":
            q = _quantile(g, k)
            out.append([(x - q) / (s + eps) for x in g])
    return out


GROUP_NAMES = ["grpo", "drgrpo", "qae", "rloo", "reinforce++", "reinforce++-baseline"]


@pytest.mark.parametrize("name", GROUP_NAMES)
@pytest.mark.parametrize("value", [0.7, 0.1, -3.3, 1.0, 0.0, 1e-3])
def test_identical_non_binary_rewards_give_exactly_zero(name, value):
    rewards = torch.full((3, 8), value)
    assert torch.equal(compute_advantages(name, rewards=rewards), torch.zeros(3, 8))


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_estimators_match_a_float64_reference(name):
    g = torch.Generator().manual_seed(7)
    rewards = torch.rand(6, 8, generator=g)
    rewards[1] = 0.7  # a constant non-binary group among varied ones
    rewards[2] = torch.tensor([0.0, 1.0] * 4)
    rewards[3, :4] = 0.3
    groups = rewards.double().tolist()  # the float32 values, exactly
    expected = torch.tensor(_reference(name, groups), dtype=torch.float64)
    got = compute_advantages(name, rewards=rewards)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    if name not in ("reinforce++",):
        assert torch.equal(got[1], torch.zeros(8))


def test_whitening_constant_advantages_is_exactly_zero():
    from armor_megatron.algo.advantages import whiten_advantages

    out = whiten_advantages(torch.full((2, 3), 0.7), torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


def test_compute_advantages_checks_the_arguments_the_estimator_takes():
    with pytest.raises(ValueError, match=r"advantage estimator 'qae' takes \(rewards, k, eps\)"):
        compute_advantages("qae", rewards=ONE_OF_FOUR, kk=0.4)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'; known: grpo, dapo, drgrpo"):
        compute_advantages("nope", rewards=ONE_OF_FOUR)
    torch.testing.assert_close(compute_advantages("grpo", ONE_OF_FOUR), grpo_advantages(ONE_OF_FOUR))


def test_a_new_estimator_is_one_registered_function():
    from armor_megatron.algo.advantages import ADVANTAGE_ESTIMATORS, register_advantage_estimator

    @register_advantage_estimator("test-max-baseline")
    def max_baseline(rewards, scale: float = 1.0):
        return (rewards - rewards.amax(dim=1, keepdim=True)) * scale

    try:
        out = compute_advantages("test-max-baseline", rewards=ONE_OF_FOUR, scale=2.0)
        torch.testing.assert_close(out, torch.tensor([[0.0, -2.0, -2.0, -2.0]]))
        assert ADVANTAGE_ESTIMATORS.entry("test-max-baseline").parameters == ("rewards", "scale")
        with pytest.raises(ValueError, match="already registered"):
            register_advantage_estimator("test-max-baseline")(max_baseline)
    finally:
        ADVANTAGE_ESTIMATORS.unregister("test-max-baseline")
    assert "test-max-baseline" not in ESTIMATORS
