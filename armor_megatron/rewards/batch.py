"""Score one response or a batch of them."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from armor_megatron.rewards.isolated import default_workers
from armor_megatron.rewards.registry import VerifierResultError, load_verifier
from armor_megatron.rewards.result import RewardResult


def compute_score(response: str, ground_truth: Any, verifier: str = "math") -> RewardResult:
    """Score one response against its ground truth.

    ``verifier``: a registered name or ``"package.module:function"``.
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    return load_verifier(verifier)(response, ground_truth)


def score_batch(
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    verifier: str = "math",
    max_workers: int | None = None,
    labels: Sequence[str] | None = None,
) -> list[RewardResult]:
    """Score responses against ground truths, in order, on threads.

    ``[compute_score(r, g, verifier) for r, g in zip(responses, ground_truths)]``, in order,
    on ``max_workers`` threads (default: this process's CPUs, at most 32).

    Threads suffice: the math verifier's heavy part and every user (``module:function``)
    verifier run in worker processes (one per thread at most, see
    :mod:`armor_megatron.rewards.isolated`), and I/O-bound verifiers (sandboxes, HTTP judges)
    overlap. The first exception a verifier raises is re-raised; a result that is no reward
    (NaN, a string) raises VerifierResultError naming the verifier and the response: its entry in
    ``labels`` (e.g. ``"row 17"``, the dataset row), else ``"response <i>"``.
    """
    if len(responses) != len(ground_truths):
        raise ValueError(f"score_batch got {len(responses)} responses but {len(ground_truths)} ground truths")
    if labels is not None and len(labels) != len(responses):
        raise ValueError(f"score_batch got {len(labels)} labels for {len(responses)} responses")
    fn = load_verifier(verifier)
    for response in responses:
        if not isinstance(response, str):
            raise TypeError(f"response must be a str, got {type(response).__name__}")
    workers = max_workers if max_workers is not None else default_workers()
    if workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {workers}")

    def one(i: int) -> RewardResult:
        try:
            return fn(responses[i], ground_truths[i])
        except VerifierResultError as err:
            where = labels[i] if labels else f"response {i}"
            raise VerifierResultError(
                f"{where}: {err}, for the response {responses[i]!r:.80} (ground truth {ground_truths[i]!r:.40})"
            ) from None

    if workers == 1 or len(responses) <= 1:
        return [one(i) for i in range(len(responses))]
    pool = ThreadPoolExecutor(max_workers=min(workers, len(responses)), thread_name_prefix="reward")
    try:
        return list(pool.map(one, range(len(responses))))
    finally:  # after a failure, the responses not started yet are not scored
        pool.shutdown(wait=True, cancel_futures=True)
