r"""Format verifier: does the response have the shape the prompt asked for?

Criteria (each 0/1 in the breakdown; score = 1 only if every enabled one holds):

* ``boxed``: ``"exactly_one"`` complete ``\boxed{}`` (default), ``"at_least_one"``, or ``None`` (off);
* ``think``: the reasoning is closed by exactly one ``</think>``, preceded by at most one
  ``<think>`` (chat templates such as Qwen3's may put the opening tag in the prompt), with
  non-empty text on both sides; the ``boxed`` rule then applies to the text after it.

The ground truth is ignored.
"""

from __future__ import annotations

from typing import Any

from armor_megatron.rewards.extract import THINK_CLOSE, THINK_OPEN, box_spans, is_blank
from armor_megatron.rewards.registry import register_verifier
from armor_megatron.rewards.result import RewardResult, Verifier

_BOXED_RULES = ("exactly_one", "at_least_one", None)


def make_format_verifier(
    *,
    boxed: str | None = "exactly_one",
    think: bool = False,
    think_open: str = THINK_OPEN,
    think_close: str = THINK_CLOSE,
) -> Verifier:
    r"""A verifier scoring format only: the ``\boxed{}`` rule and/or a closed think block."""
    if boxed not in _BOXED_RULES:
        raise ValueError(f"format verifier boxed must be one of {_BOXED_RULES}, got {boxed!r}")
    if boxed is None and not think:
        raise ValueError("format verifier has no rule enabled (boxed=None and think=False)")

    def verify_format(response: str, ground_truth: Any = None) -> RewardResult:
        breakdown: dict[str, float] = {}
        answer_part = response
        if think:
            ok, answer_part = _split_think(response, think_open, think_close)
            breakdown["think"] = float(ok)
        if boxed is not None:
            spans = box_spans(answer_part)  # spans, not the arguments: nested boxes cost no copies
            if boxed == "exactly_one":
                ok = len(spans) == 1 and spans[0] is not None and not is_blank(answer_part, spans[0])
            else:
                ok = bool(spans) and spans[-1] is not None and not is_blank(answer_part, spans[-1])
            breakdown["boxed"] = float(ok)
        return RewardResult(float(all(v == 1.0 for v in breakdown.values())), breakdown)

    return verify_format


def _split_think(response: str, open_tag: str, close_tag: str) -> tuple[bool, str]:
    """(rule holds, text after the closing tag)."""
    if response.count(close_tag) != 1:
        return False, response
    reasoning, answer = response.split(close_tag)
    opens = reasoning.count(open_tag)
    if opens > 1 or open_tag in answer:
        return False, answer
    if opens == 1:
        before, reasoning = reasoning.split(open_tag)
        if before.strip():
            return False, answer
    return bool(reasoning.strip() and answer.strip()), answer


register_verifier("format")(make_format_verifier())
register_verifier("think_format")(make_format_verifier(think=True))
