r"""Math final-answer verifier.

The final answer (its boxes, or a closing statement) vs the ground truth, equivalence by
math-verify.

score = 1 if the response's final answer equals the ground truth mathematically, else 0.
"Equal" is math-verify's judgement (``verify(parse(gold), parse(answer))``): ``\frac{1}{2}``,
``\dfrac12``, ``0.5`` and ``1/2`` agree; so do ``50\%`` and ``0.5``, ``x=3`` and ``3``, sets in any
order, and intervals written with or without ``\left``/``\right``. Floats are compared after
rounding to 6 decimals, so ``0.333`` is not ``1/3``; two plain numbers are compared as decimals
(integers exactly, others within a relative 1e-6), and competition forms math-verify misreads
are read first (``\textbf{(D)}\ 24``, ``4.5e33``, ``10\,000``: see
:mod:`armor_megatron.rewards.math_equivalence`).

The answer is read by :func:`~armor_megatron.rewards.extract.final_math_answers` (linear time:
a final ``Answer:`` line / ``final answer is`` sentence ending the response after its last box,
else the boxes of the final answer segment, the last box and those joined to it by
``,``/``and``/``\quad``/``x =`` alone; an unterminated last box is no answer). Several boxes
match a gold when their union equals it as a set, or when each of them equals it
(:func:`~armor_megatron.rewards.math_equivalence.answers_match`). The comparison runs in a pooled worker
process under a hard timeout (:mod:`armor_megatron.rewards.isolated`). ``timeout_s`` bounds
the scoring of one response as a whole: extraction and the comparisons with every
acceptable gold answer share it, so a pathological answer such as ``9^{9^{9^{9}}}`` scores 0
with ``timed_out = 1`` after ``timeout_s`` seconds, from any thread or process, and the
parent never imports sympy. (Waiting for a free worker when more threads than workers score
at once is not counted; neither is the start-up of a worker.) A worker that dies
mid-comparison also scores 0 (logged as an error); an exception inside the worker (a bug,
math-verify missing) is raised.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections.abc import Sequence
from typing import Any

from armor_megatron.rewards.extract import final_math_answers, last_boxed
from armor_megatron.rewards.isolated import IsolatedTimeout, WorkerDied, run_isolated
from armor_megatron.rewards.registry import register_verifier
from armor_megatron.rewards.result import RewardResult, Verifier

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
_EQUIVALENT = "armor_megatron.rewards.math_equivalence:answers_match"  # runs in worker processes only


def make_math_verifier(*, timeout_s: float = DEFAULT_TIMEOUT_S, answer_line_fallback: bool = True) -> Verifier:
    r"""Build a math verifier.

    The answer is what the response states last: with ``answer_line_fallback`` set, a final
    ``Answer: X`` line or ``The final answer is $X$.`` sentence ending the response after its
    last box (the DAPO and Minerva prompt formats); else the boxes ``\boxed{...}``/``\fbox{...}``
    of its final answer segment (the last box and the boxes joined to it by nothing but
    blanks, ``,``, ``and``/``or``, LaTeX spacing or ``x =``; see
    :mod:`armor_megatron.rewards.extract`). No answer -> score 0. Several boxes score 1 when
    their union equals the ground truth as a set (``\boxed{1}, \boxed{2}`` for ``\{1, 2\}``)
    or each of them equals it; never when only the last does.

    ground_truth: a string (plain ``1/2``, LaTeX ``\frac{1}{2}``, optionally ``$``-wrapped, or a
    whole reference solution, whose final box segment is then used: ``\boxed{1}`` and
    ``\boxed{-2}`` reads ``1, -2``), a number, or a list of acceptable answers (correct if any
    matches; all share the one ``timeout_s``).

    breakdown: ``answer_found``, ``correct``, ``timed_out`` (each 0 or 1); ``extracted``: the
    answers read, joined by ``", "``.
    """
    if not timeout_s > 0:
        raise ValueError(f"math verifier timeout_s must be > 0, got {timeout_s}")

    def verify_math(response: str, ground_truth: Any) -> RewardResult:
        start = time.monotonic()
        golds = gold_answers(ground_truth)
        answers = final_math_answers(response, answer_line_fallback=answer_line_fallback)
        if not answers:
            return RewardResult(0.0, {"answer_found": 0.0, "correct": 0.0, "timed_out": 0.0}, None)
        answer = ", ".join(answers)
        correct = timed_out = False
        left = timeout_s - (time.monotonic() - start)
        if answer in golds:
            correct = True
        elif left <= 0:
            timed_out = True
            logger.warning("math verifier: reading the answer of a response took over %gs", timeout_s)
        else:
            try:
                correct = bool(run_isolated(_EQUIVALENT, answers, golds, timeout_s=left))
            except IsolatedTimeout:
                timed_out = True
                logger.warning(
                    "math verifier: comparing %.80r with %.80r timed out after %gs", answer, golds, timeout_s
                )
            except WorkerDied as exc:  # input-driven (e.g. the OS killed it): score 0, do not stop training
                logger.error("math verifier: comparing %.80r with %.80r killed its worker (%s)", answer, golds, exc)
        score = float(correct)
        return RewardResult(score, {"answer_found": 1.0, "correct": score, "timed_out": float(timed_out)}, answer)

    return verify_math


def gold_answers(ground_truth: Any) -> list[str]:
    """Normalise a math ground truth into a non-empty list of answer strings."""
    items = (
        list(ground_truth)
        if isinstance(ground_truth, Sequence) and not isinstance(ground_truth, str)
        else [ground_truth]
    )
    if not items:
        raise ValueError("math ground truth is an empty list")
    golds = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (str, numbers.Real)):
            raise TypeError(f"math ground truth must be a string or number, got {type(item).__name__}")
        text = str(item).strip()
        boxed = last_boxed(text)
        if boxed is not None:  # a reference solution: its final box segment, read as a response's
            answers = final_math_answers(text, answer_line_fallback=False)
            text = ", ".join(answers) if answers else boxed
        elif len(text) >= 2 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$").strip()
        if not text:
            raise ValueError(f"math ground truth {item!r} is empty")
        golds.append(text)
    return golds


register_verifier("math", check_ground_truth=gold_answers)(make_math_verifier())
