"""The value every verifier returns."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardResult:
    """A verifier's verdict on one response.

    score:      the scalar reward the trainer uses (0/1 for the rule-based verifiers,
                any finite float for weighted combinations and user verifiers).
    breakdown:  one finite float per criterion checked (e.g. ``answer_found``, ``correct``,
                ``timed_out``), so the trainer can log the mean of each over a batch.
    extracted:  the answer text the verifier read from the response, ``None`` if none.
    """

    score: float
    breakdown: dict[str, float] = field(default_factory=dict)
    extracted: str | None = None

    def __post_init__(self) -> None:
        score = _finite_float(self.score, "score")
        breakdown = {str(k): _finite_float(v, f"breakdown[{k!r}]") for k, v in self.breakdown.items()}
        object.__setattr__(self, "score", score)
        object.__setattr__(self, "breakdown", breakdown)


def _finite_float(value: Any, what: str) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"RewardResult.{what} must be a number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"RewardResult.{what} must be finite, got {out}")
    return out


Verifier = Callable[[str, Any], RewardResult]
"""``verifier(response, ground_truth) -> RewardResult``."""
