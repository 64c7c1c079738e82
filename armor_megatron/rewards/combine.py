"""Weighted combination of verifiers.

score = Σ_i w_i · score_i over the named verifiers, each called with the same
(response, ground_truth) and given the row fields it names. breakdown holds every part's score under its name and each of its
criteria as ``"<name>/<criterion>"``; ``extracted`` is the first part's that has one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from armor_megatron.rewards.registry import load_verifier
from armor_megatron.rewards.result import RewardResult, Verifier


def weighted_verifier(weights: Mapping[str, float]) -> Verifier:
    """``weighted_verifier({"math": 0.9, "format": 0.1})``.

    Keys are anything :func:`~armor_megatron.rewards.registry.load_verifier` accepts (names or
    ``module:function``).
    """
    if not weights:
        raise ValueError("weighted verifier needs at least one verifier")
    parts = []
    for spec, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"weight of verifier {spec!r} must be a finite number, got {weight!r}")
        parts.append((spec, float(weight), load_verifier(spec)))

    scoped = [spec for spec, _, verifier in parts if verifier.plan.scope != "response"]
    if scoped:
        raise ValueError(f"weighted verifier parts score one response each; {scoped[0]!r} scores several at once")

    def verify_weighted(
        response: str,
        ground_truth: Any,
        prompt: Any = None,
        data_source: Any = None,
        extra_info: Any = None,
        row: Any = None,
        trajectory: Any = None,
    ) -> RewardResult:
        fields = {"prompt": prompt, "data_source": data_source, "extra_info": extra_info, "row": row}
        fields["trajectory"] = trajectory
        score = 0.0
        breakdown: dict[str, float] = {}
        extracted = None
        for spec, weight, verifier in parts:
            result = verifier(response, ground_truth, fields)
            score += weight * result.score
            breakdown[spec] = result.score
            breakdown.update({f"{spec}/{k}": v for k, v in result.breakdown.items()})
            if extracted is None:
                extracted = result.extracted
        return RewardResult(score, breakdown, extracted)

    return verify_weighted
