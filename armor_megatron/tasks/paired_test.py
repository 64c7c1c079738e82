"""The paired two-sided Student t test of a pre-registered study, in pure Python.

With its confidence interval and a power calculation; no SciPy.

For differences d_1..d_n (ARMOR − DAPO per seed): mean d̄, sample sd s, standard error
s/√n, t = d̄ / (s/√n) with ν = n − 1 degrees of freedom, two-sided p = P(|T_ν| ≥ |t|), and the
(1 − a) interval d̄ ± t_{1−a/2, ν} · s/√n.

The Student t CDF comes from the regularized incomplete beta function:
P(|T_ν| ≥ |t|) = I_x(ν/2, 1/2) with x = ν / (ν + t²), evaluated by its continued fraction
(modified Lentz); quantiles by bisection on the CDF.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), a, b > 0, x in [0, 1]."""
    if not (a > 0 and b > 0 and 0.0 <= x <= 1.0):
        raise ValueError(f"betainc needs a, b > 0 and x in [0, 1], got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):  # the continued fraction converges fast here
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, 1.0 - x) / b


def _beta_cf(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def t_cdf(t: float, df: float) -> float:
    """P(T_df ≤ t) for Student's t with ``df`` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df={df} must be > 0")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))  # P(T ≥ |t|)
    return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (bisection, |error| < 1e-10)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q} must be in (0, 1)")
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > q:
        lo *= 2
    while t_cdf(hi, df) < q:
        hi *= 2
    while hi - lo > 1e-10:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


@dataclasses.dataclass(frozen=True)
class PairedTest:
    """A paired t test: n, mean difference d̄ and its sd, t, the two-sided p and the confidence interval."""

    n: int
    mean: float  # d̄
    sd: float  # sample sd of the differences
    t: float
    p: float  # two-sided
    ci_low: float
    ci_high: float
    level: float  # of the interval, e.g. 0.95


def paired_t_test(a: Sequence[float], b: Sequence[float], *, level: float = 0.95) -> PairedTest:
    """Test of mean(a − b) = 0 over pairs (a_i, b_i); two-sided p and the ``level`` interval."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if len(a) < 2:
        raise ValueError(f"a paired t test needs at least 2 pairs, got {len(a)}")
    d = [x - y for x, y in zip(a, b)]
    n, mean, sd = len(d), statistics.fmean(d), statistics.stdev(d)
    se = sd / math.sqrt(n)
    half = t_ppf(0.5 + level / 2, n - 1) * se
    if se == 0:
        t, p = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        t = mean / se
        p = min(1.0, 2 * t_cdf(-abs(t), n - 1))
    return PairedTest(n, mean, sd, t, p, mean - half, mean + half, level)


def paired_power(n: int, effect: float, sd: float, *, alpha: float = 0.05) -> float:
    """Approximate power of the two-sided paired t test.

    With ``n`` pairs, a true mean difference ``effect`` and differences of sd ``sd``:
    P(T_{n−1} > t_{1−α/2, n−1} − δ√n/σ) (the shifted central-t approximation of the noncentral t).
    """
    if n < 2 or sd <= 0:
        raise ValueError(f"power needs n >= 2 and sd > 0, got n={n}, sd={sd}")
    crit = t_ppf(1 - alpha / 2, n - 1)
    return 1.0 - t_cdf(crit - abs(effect) * math.sqrt(n) / sd, n - 1)


def pairs_needed(effect: float, sd: float, *, power: float = 0.8, alpha: float = 0.05, max_n: int = 10_000) -> int:
    """The smallest n ≥ 2 whose ``paired_power`` reaches ``power``."""
    for n in range(2, max_n + 1):
        if paired_power(n, effect, sd, alpha=alpha) >= power:
            return n
    raise ValueError(f"more than {max_n} pairs needed for effect={effect}, sd={sd}")
