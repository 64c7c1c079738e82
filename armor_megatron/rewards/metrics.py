"""Evaluation metrics over k sampled responses per prompt: avg@k and unbiased pass@k.

Two measures, never mixed: the **mean score** (avg@k, ``rollout/score``: partial credit counts
as it is) and **accuracy**, the share of responses *correct*, i.e. scoring at least
:data:`CORRECT_THRESHOLD` (pass@k, ``rollout/accuracy``, ``armor-eval``'s domain accuracy). With a
0/1 verifier they are equal; with partial credit (a format bonus, a weighted verifier) they differ.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

CORRECT_THRESHOLD = 1.0
"""A response counts as correct when its score is at least this (the built-in verifiers score 0 or 1)."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained on Code").

    From n samples of which c are correct, the probability that at least one of k samples drawn
    without replacement is correct,

        pass@k = 1 − C(n−c, k) / C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k/i),

    the product form avoiding huge binomials. It is exactly 1 when n − c < k (every k-subset
    holds a correct sample) and 0 when c = 0.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"pass_at_k {name} must be an int, got {type(value).__name__}")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def avg_at_k(scores: Iterable[Any]) -> float:
    """Mean score of one prompt's samples, or mean over prompts.

    Mean score: over one prompt's k samples (a flat sequence of numbers), or, given one
    sequence per prompt, the mean over prompts of each prompt's mean.
    """
    items = list(scores)
    if not items:
        raise ValueError("avg_at_k got no scores")
    if all(_is_number(s) for s in items):
        return math.fsum(float(s) for s in items) / len(items)
    if all(isinstance(s, Sequence) and not isinstance(s, str) for s in items):
        return math.fsum(avg_at_k(group) for group in items) / len(items)
    raise TypeError("avg_at_k takes a sequence of numbers, or one sequence of numbers per prompt")


def group_metrics(
    groups: Sequence[Sequence[float]], ks: Sequence[int] = (1,), threshold: float = CORRECT_THRESHOLD
) -> dict[str, float]:
    """Metrics for one dataset from per-prompt score lists (same length n for every prompt).

    Returns ``{"num_prompts", "avg@n", "pass@k" for each k}``: avg@n is the mean score (partial
    credit as it is); a sample counts as correct when its score >= ``threshold``, and pass@k is the
    mean over prompts of :func:`pass_at_k` (pass@1: the share of samples correct, the accuracy).
    """
    if not groups:
        raise ValueError("group_metrics got no prompts")
    sizes = {len(group) for group in groups}
    if len(sizes) != 1:
        raise ValueError(f"every prompt needs the same number of samples, got {min(sizes)}..{max(sizes)}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("group_metrics got prompts with no samples")
    for k in ks:
        if not isinstance(k, numbers.Integral) or not 1 <= k <= n:
            raise ValueError(f"pass@{k} needs 1 <= k <= {n} (samples per prompt)")
    out = {"num_prompts": float(len(groups)), f"avg@{n}": avg_at_k(groups)}
    correct = [sum(1 for s in group if s >= threshold) for group in groups]
    for k in ks:
        out[f"pass@{k}"] = math.fsum(pass_at_k(n, c, k) for c in correct) / len(groups)
    return out


def metrics_by_dataset(
    records: Iterable[tuple[str, Hashable, float]], ks: Sequence[int] = (1,), threshold: float = CORRECT_THRESHOLD
) -> dict[str, dict[str, float]]:
    """Per-dataset metrics from ``(dataset, prompt_id, score)`` records.

    Group ``(dataset, prompt_id, score)`` records by dataset and prompt, then apply
    :func:`group_metrics` to each dataset: ``{dataset: {"num_prompts", "avg@n", "pass@k"...}}``.
    """
    by_dataset: dict[str, dict[Hashable, list[float]]] = defaultdict(lambda: defaultdict(list))
    for dataset, prompt_id, score in records:
        if not _is_number(score):
            raise TypeError(
                f"dataset {dataset!r} prompt {prompt_id!r}: score must be a number, got {type(score).__name__}"
            )
        by_dataset[dataset][prompt_id].append(float(score))
    out = {}
    for dataset, prompts in by_dataset.items():
        try:
            out[dataset] = group_metrics(list(prompts.values()), ks, threshold)
        except ValueError as exc:
            raise ValueError(f"dataset {dataset!r}: {exc}") from None
    return out


def accuracy_by_domain(
    records: Iterable[tuple[str, float]], threshold: float = CORRECT_THRESHOLD
) -> dict[str, dict[str, float]]:
    """Per-domain accuracy of scored samples.

    ``(domain, score)`` records (the domain is the row's verifier, e.g. ``math``, ``safety``,
    ``knowledge``) -> ``{domain: {"num_samples": n, "accuracy": share of scores >= threshold}}``,
    domains in order of first appearance.
    """
    counts: dict[str, list[int]] = {}
    for domain, score in records:
        if not _is_number(score):
            raise TypeError(f"domain {domain!r}: score must be a number, got {type(score).__name__}")
        seen = counts.setdefault(str(domain), [0, 0])
        seen[0] += 1
        seen[1] += score >= threshold
    return {d: {"num_samples": float(n), "accuracy": correct / n} for d, (n, correct) in counts.items()}


def flatten_metrics(metrics: Mapping[str, Mapping[str, float]], prefix: str = "eval") -> dict[str, float]:
    """``{"aime": {"pass@1": x}}`` -> ``{"eval/aime/pass@1": x}`` for loggers."""
    return {
        f"{prefix}/{dataset}/{name}": value for dataset, values in metrics.items() for name, value in values.items()
    }


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real)
