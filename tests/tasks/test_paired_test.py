"""The pure-Python Student t machinery against published table values."""

import math

import pytest

from armor_megatron.tasks.paired_test import betainc, paired_power, paired_t_test, pairs_needed, t_cdf, t_ppf


@pytest.mark.parametrize(
    ("q", "df", "table"),
    [(0.975, 1, 12.7062), (0.975, 5, 2.5706), (0.975, 10, 2.2281), (0.95, 1, 6.3138), (0.995, 30, 2.7500)],
)
def test_quantiles_match_the_t_table(q, df, table):
    assert t_ppf(q, df) == pytest.approx(table, abs=1e-4)


def test_cdf_known_values_and_limits():
    assert t_cdf(2.0, 3) == pytest.approx(0.930337, abs=1e-6)
    assert t_cdf(0.0, 7) == pytest.approx(0.5)
    assert t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/π
    assert t_cdf(1.96, 1e6) == pytest.approx(0.9750021, abs=1e-5)  # → the normal
    assert betainc(2.0, 3.0, 0.4) == pytest.approx(0.5248, abs=1e-4)  # 1 − Σ_{j<2} C(4,j) .4^j .6^(4−j)
    with pytest.raises(ValueError, match="x in"):
        betainc(1.0, 1.0, 1.5)


def test_paired_t_test_by_hand():
    # d = (0.5, -0.2, 0.9, 1.0, 0.9, 0.5): mean 0.6, sd √0.2, t = 0.6/(√0.2/√6) = 3.2863, df 5
    r = paired_t_test([1, 2, 3, 4, 5, 6], [0.5, 2.2, 2.1, 3.0, 4.1, 5.5])
    assert r.mean == pytest.approx(0.6) and r.sd == pytest.approx(math.sqrt(0.2))
    assert r.t == pytest.approx(3.28634, abs=1e-4) and r.p == pytest.approx(0.02180, abs=1e-4)
    half = 2.570582 * math.sqrt(0.2) / math.sqrt(6)
    assert (r.ci_low, r.ci_high) == pytest.approx((0.6 - half, 0.6 + half), abs=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        paired_t_test([1.0], [0.0])


def test_power_grows_with_pairs_and_pairs_needed_is_the_first_to_reach_it():
    assert paired_power(4, 0.05, 0.04) < paired_power(8, 0.05, 0.04) < paired_power(16, 0.05, 0.04)
    n = pairs_needed(0.05, 0.04)
    assert paired_power(n, 0.05, 0.04) >= 0.8 > paired_power(n - 1, 0.05, 0.04)
