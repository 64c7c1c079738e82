import math

import pytest
import torch

from armor_megatron.algo.ratio import mixed_log_ratio, mixture_weight, trust_region_bounds


def _random_logps(seed: int, shape=(4, 64)):
    """lp_θ, lp_old, lp_ref: ordinary token log-probs in (−10, 0], with some set to −80 and
    one row where all three sit near −80 (probabilities ~1e−35: exp() would be denormal-close)."""
    g = torch.Generator().manual_seed(seed)
    lps = [-10 * torch.rand(shape, generator=g) for _ in range(3)]
    for lp in lps:
        lp[torch.rand(shape, generator=g) < 0.1] = -80.0
    for lp in lps:
        lp[0] = -80.0 + torch.rand(shape[1:], generator=g)
    return lps


def _direct_log_ratio(lp, old, ref, alpha):
    """The textbook formula in float64: log((α·π_θ + (1−α)·π_ref) / (α·π_old + (1−α)·π_ref))."""
    p, p_old, p_ref = (x.double().exp() for x in (lp, old, ref))
    return torch.log((alpha * p + (1 - alpha) * p_ref) / (alpha * p_old + (1 - alpha) * p_ref))


def test_alpha_one_is_the_ppo_log_ratio_bit_for_bit():
    lp, old, ref = _random_logps(0)
    expected = lp - old
    assert torch.equal(mixed_log_ratio(lp, old, ref, 1.0), expected)
    assert torch.equal(mixed_log_ratio(lp, old, None, 0.9), expected)  # no reference: PPO
    # bf16 inputs are upcast first, then subtracted: the fp32 PPO log-ratio of the upcast values.
    lp16, old16 = lp.bfloat16(), old.bfloat16()
    out = mixed_log_ratio(lp16, old16, ref, 1.0)
    assert out.dtype == torch.float32 and torch.equal(out, lp16.float() - old16.float())


@pytest.mark.parametrize("alpha", [0.5, 0.875, 0.9375])
def test_mixed_ratio_matches_direct_formula_including_minus_80(alpha):
    lp, old, ref = _random_logps(1)
    out = mixed_log_ratio(lp, old, ref, alpha)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # fp32 log-probs of magnitude 80 carry ~5e-6 absolute rounding; the ratio inherits it.
    torch.testing.assert_close(out.double(), _direct_log_ratio(lp, old, ref, alpha), rtol=0, atol=3e-5)


def test_mixed_ratio_stays_finite_where_probabilities_underflow_even_in_fp64():
    # exp(−1000) is 0 in fp64; the log ratio is shift invariant, so compare against the
    # direct formula evaluated on the log-probs shifted by +1000.
    lp, old, ref = _random_logps(2)
    out = mixed_log_ratio(lp - 1000, old - 1000, ref - 1000, 0.875)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _direct_log_ratio(lp, old, ref, 0.875), rtol=0, atol=3e-4)


def test_hand_computed_mixed_ratio():
    # α = 0.5, π_θ = 0.5, π_old = π_ref = 0.25:  (0.25 + 0.125) / (0.125 + 0.125) = 1.5
    lp, old, ref = (torch.tensor([math.log(p)]) for p in (0.5, 0.25, 0.25))
    torch.testing.assert_close(mixed_log_ratio(lp, old, ref, 0.5), torch.tensor([math.log(1.5)]))


@pytest.mark.parametrize("alpha", [0.5, 0.9375])
def test_gradient_wrt_logp_is_the_mixture_share_of_pi_theta(alpha):
    lp, old, ref = _random_logps(3, shape=(2, 16))
    lp = lp.clone().requires_grad_(True)
    mixed_log_ratio(lp, old, ref, alpha).sum().backward()
    p, p_ref = lp.detach().double().exp(), ref.double().exp()
    expected = alpha * p / (alpha * p + (1 - alpha) * p_ref)  # α·π_θ / (α·π_θ + (1−α)·π_ref)
    torch.testing.assert_close(lp.grad.double(), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(mixture_weight(lp.detach(), ref, alpha).double(), expected, rtol=1e-5, atol=1e-7)


def test_trust_region_hand_values_and_ratio_at_the_bounds():
    # α = 0.5, ε_low 0.2, ε_high 0.28, π_old = 0.3, π_ref = 0.5 (so (1−α)/α = 1):
    #   lower = 0.8·0.3 − 0.2·0.5 = 0.14,  upper = 1.28·0.3 + 0.28·0.5 = 0.524
    old, ref = torch.tensor([math.log(0.3)]), torch.tensor([math.log(0.5)])
    lower, upper = trust_region_bounds(old, ref, 0.5, 0.2, 0.28)
    torch.testing.assert_close(lower, torch.tensor([0.14], dtype=torch.float64))
    torch.testing.assert_close(upper, torch.tensor([0.524], dtype=torch.float64))
    # r_mix at the bounds: (0.5·0.524 + 0.25)/(0.15 + 0.25) = 1.28 and (0.07 + 0.25)/0.4 = 0.8
    ratio = mixed_log_ratio(torch.cat([upper, lower]).log().float(), old.expand(2), ref.expand(2), 0.5).exp()
    torch.testing.assert_close(ratio, torch.tensor([1.28, 0.8]))


@pytest.mark.parametrize("alpha", [0.5, 0.875, 0.9375, 1.0])
def test_clipping_r_mix_is_the_adaptive_trust_region_on_pi_theta(alpha):
    """docs/design.md §4.3: 1−ε_low ≤ r_mix ≤ 1+ε_high  ⇔  lower ≤ π_θ ≤ upper."""
    g = torch.Generator().manual_seed(4)
    p_old, p_ref = (
        torch.rand(20000, generator=g, dtype=torch.float64),
        torch.rand(20000, generator=g, dtype=torch.float64),
    )
    p = p_old * (0.3 + 1.4 * torch.rand(20000, generator=g, dtype=torch.float64))
    ratio = mixed_log_ratio(p.log(), p_old.log(), p_ref.log(), alpha).double().exp()
    lower, upper = trust_region_bounds(p_old.log(), p_ref.log(), alpha, 0.2, 0.28)
    inside_by_ratio = (ratio >= 0.8) & (ratio <= 1.28)
    inside_by_bounds = (p >= lower) & (p <= upper)
    # Skip points within float rounding of a boundary.
    clear = ((ratio - 0.8).abs() > 1e-5) & ((ratio - 1.28).abs() > 1e-5)
    assert clear.sum() > 19000 and inside_by_bounds[clear].any() and (~inside_by_bounds[clear]).any()
    assert torch.equal(inside_by_ratio[clear], inside_by_bounds[clear])
    if alpha < 1:  # the reference widens PPO's interval on both sides
        assert (lower < 0.8 * p_old).all() and (upper > 1.28 * p_old).all()


@pytest.mark.parametrize("alpha", [0.0, -0.5, 1.5, float("nan")])
def test_alpha_outside_unit_interval_raises(alpha):
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="alpha must be in"):
        mixed_log_ratio(x, x, x, alpha)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="ref_logp"):
        mixed_log_ratio(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), 0.5)
    with pytest.raises(ValueError, match="old_logp"):
        mixed_log_ratio(torch.zeros(2, 3), torch.zeros(3, 2), None, 1.0)
