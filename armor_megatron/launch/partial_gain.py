"""The generation time partial rollouts are expected to save, from a response-length distribution.

Notation: n = P·G the responses a step trains on, L a response's length (tokens) with CDF F on
[0, L_max] (a truncated distribution: the mass above L_max sits at L_max), B the sequences the
engines decode at once (SGLang's ``--max-running-requests``, summed over engines), every running
sequence advancing one token per decode step of constant time.

**off** starts the step's n responses together (B ≥ n) and waits for the longest::

    E[T_off] = E[max of n lengths] = ∫_0^L_max (1 − F(x)^n) dx     (in decode steps)

**partial** keeps ceil(P · over_provision) groups in flight, more sequences than B, so the batch
stays full and the surplus queues; it stops when P groups are complete and carries the rest over,
decoded tokens and all, to the next step. Nothing is thrown away, so in steady state a step decodes
on average the tokens it trains on, n·E[L], at B per decode step::

    E[T_partial] = n·E[L] / B,    E[L] = ∫_0^L_max (1 − F(x)) dx

    ratio = E[T_partial] / E[T_off] = (n/B) · E[L] / E[max of n lengths];   B = n: E[L] / E[M_n]

It needs more sequences in flight than B (over_provision · n > B; for B = n any over_provision > 1),
so that the batch stays full until the target is met. Left out: the batch is not full
in the few decode steps after a step's abort and before the next starts; the first step starts
with nothing carried over, and a short run ends with tokens carried over that it paid for and never
trained on (both make a short measurement read higher); prefill; dynamic sampling (both modes decode
the dropped groups: partial refills at once, off waits for a refill round's longest response again,
so the gain grows with it).

:func:`lognormal_lengths` is the distribution ``--plan`` assumes: lognormal with shape σ, truncated
at L_max, its median chosen so that the truncated mean is the planned mean length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

_STEPS = 4096  # quadrature points over [0, L_max] (the integrands are smooth and bounded by 1)


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Response lengths on [0, ``max_len``]: ``cdf(x)`` = P(L ≤ x) for x < max_len (the rest at max_len)."""

    cdf: Callable[[float], float]
    max_len: float

    def _integral(self, f: Callable[[float], float]) -> float:
        """∫_0^max_len f(F(x)) dx by the midpoint rule."""
        h = self.max_len / _STEPS
        return h * sum(f(self.cdf((i + 0.5) * h)) for i in range(_STEPS))

    def mean(self) -> float:
        """E[L] = ∫ (1 − F(x)) dx."""
        return self._integral(lambda p: 1.0 - p)

    def expected_max(self, n: int) -> float:
        """E[max of n lengths] = ∫ (1 − F(x)^n) dx."""
        return self._integral(lambda p: 1.0 - p**n)


def partial_generation_ratio(lengths: LengthDistribution, responses: int, running: int | None = None) -> float:
    """E[T_partial] / E[T_off] = (n/B) · E[L] / E[max of n lengths] (module docstring); B = n when None."""
    if responses < 1:
        raise ValueError(f"responses must be >= 1, got {responses}")
    batch = responses if running is None else running
    if batch < responses:
        raise ValueError(f"the model needs the off path's {responses} responses to run at once, got a batch of {batch}")
    return responses / batch * lengths.mean() / lengths.expected_max(responses)


def _lognormal_cdf(median: float, sigma: float) -> Callable[[float], float]:
    if sigma == 0:
        return lambda x: 1.0 if x >= median else 0.0
    return lambda x: 0.0 if x <= 0 else 0.5 * (1.0 + math.erf(math.log(x / median) / (sigma * math.sqrt(2.0))))


def lognormal_lengths(mean: float, sigma: float, max_len: float) -> LengthDistribution:
    """Lognormal lengths of shape ``sigma`` truncated at ``max_len`` whose truncated mean is ``mean``.

    The median is found by bisection (the truncated mean grows with it); ``mean`` = ``max_len``
    means every response at the limit.
    """
    if not 0 < mean <= max_len:
        raise ValueError(f"mean length must be in (0, max_len={max_len}], got {mean}")
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    if mean >= max_len:
        return LengthDistribution(lambda x: 0.0, max_len)
    lo, hi = 1e-9 * max_len, max_len
    while LengthDistribution(_lognormal_cdf(hi, sigma), max_len).mean() < mean:
        hi *= 2.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if LengthDistribution(_lognormal_cdf(mid, sigma), max_len).mean() < mean:
            lo = mid
        else:
            hi = mid
    return LengthDistribution(_lognormal_cdf(math.sqrt(lo * hi), sigma), max_len)
