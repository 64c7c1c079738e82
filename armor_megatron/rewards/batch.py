"""Score one response or a batch of them."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

from armor_megatron.rewards.isolated import default_workers
from armor_megatron.rewards.registry import VerifierResultError, load_verifier
from armor_megatron.rewards.result import RewardResult


def compute_score(
    response: str, ground_truth: Any, verifier: str = "math", fields: Mapping[str, Any] | None = None
) -> RewardResult:
    """Score one response against its ground truth.

    Score ``response`` against ``ground_truth`` with the verifier named by ``verifier``
    (a registered name or ``"package.module:function"``), which is given the row ``fields`` it
    names (:mod:`armor_megatron.rewards.fields`).
    """
    if not isinstance(response, str):
        raise TypeError(f"response must be a str, got {type(response).__name__}")
    return load_verifier(verifier)(response, ground_truth, fields)


def score_batch(
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    verifier: str = "math",
    max_workers: int | None = None,
    labels: Sequence[str] | None = None,
    fields: Sequence[Mapping[str, Any]] | None = None,
    groups: Sequence[Hashable] | None = None,
) -> list[RewardResult]:
    """Score responses against ground truths, in order, on threads.

    ``fields[i]``: response ``i``'s row fields (``prompt``, ``data_source``, ``extra_info``,
    ``row``, ``trajectory``; :mod:`armor_megatron.rewards.fields`), given to a verifier that names
    them; ``groups[i]``: the prompt response ``i`` answers (any hashable key, e.g. the row index):
    a group verifier is called once per key on its responses, in order; default: each response
    alone. A batch verifier is called once on all of them; every other verifier once per response,
    ``[compute_score(r, g, verifier) for r, g in zip(responses, ground_truths)]``.

    Calls run on ``max_workers`` threads (default: this process's CPUs, at most 32). Threads
    suffice: the math verifier's heavy part and every user (``module:function``) verifier run in
    worker processes (one per thread at most, see :mod:`armor_megatron.rewards.isolated`), and
    I/O-bound verifiers (sandboxes, HTTP judges) overlap. The first exception a verifier raises
    is re-raised; a result that is no reward (NaN, a string, a group's list of another length)
    raises VerifierResultError naming the verifier and the response: its entry in ``labels``
    (e.g. ``"row 17"``, the dataset row), else ``"response <i>"``.
    """
    n = len(responses)
    for what, given in (("ground truths", ground_truths), ("labels", labels), ("fields", fields), ("groups", groups)):
        if given is not None and len(given) != n:
            raise ValueError(f"score_batch got {len(given)} {what} for {n} responses")
    fn = load_verifier(verifier)
    for response in responses:
        if not isinstance(response, str):
            raise TypeError(f"response must be a str, got {type(response).__name__}")
    workers = max_workers if max_workers is not None else default_workers()
    if workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {workers}")
    row_fields: Sequence[Mapping[str, Any]] = fields if fields is not None else [{}] * n
    if fn.plan.scope == "batch":
        calls = [list(range(n))] if n else []
    elif fn.plan.scope == "group" and groups is not None:
        by_key: dict[Hashable, list[int]] = {}
        for i, key in enumerate(groups):
            by_key.setdefault(key, []).append(i)
        calls = list(by_key.values())
    else:
        calls = [[i] for i in range(n)]

    def one(call: list[int]) -> list[RewardResult]:
        try:
            return fn.score(
                [responses[i] for i in call], [ground_truths[i] for i in call], [row_fields[i] for i in call]
            )
        except VerifierResultError as err:
            i = call[0]
            where = labels[i] if labels else f"response {i}"
            if len(call) > 1:
                where += f" and {len(call) - 1} more"
            raise VerifierResultError(
                f"{where}: {err}, for the response {responses[i]!r:.80} (ground truth {ground_truths[i]!r:.40})"
            ) from None

    out: list[RewardResult | None] = [None] * n
    if workers == 1 or len(calls) <= 1:
        results = [one(call) for call in calls]
    else:
        pool = ThreadPoolExecutor(max_workers=min(workers, len(calls)), thread_name_prefix="reward")
        try:
            results = list(pool.map(one, calls))
        finally:  # after a failure, the calls not started yet are not made
            pool.shutdown(wait=True, cancel_futures=True)
    for call, scored in zip(calls, results):
        for i, result in zip(call, scored):
            out[i] = result
    return cast(list[RewardResult], out)
