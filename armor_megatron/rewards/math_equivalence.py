"""math-verify equivalence, imported only inside reward worker processes.

Importing this module loads math-verify and sympy and warms their first-use caches (the
LaTeX grammar, sympy's simplifier), so that the worker's timed calls measure comparison
work only. The caller (:mod:`armor_megatron.rewards.math_answer`) enforces the timeout, so
math-verify's signal-based one is switched off.
"""

from __future__ import annotations

import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings

_CONFIG = [LatexExtractionConfig(), ExprExtractionConfig()]


def equivalent(answer: str, gold: str) -> bool:
    """Whether ``answer`` equals ``gold`` mathematically (both are answer texts, LaTeX or
    plain; math-verify's verify is not symmetric, the gold goes first)."""
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=_CONFIG, parsing_timeout=None)
    answer_parsed = parse("\\boxed{" + answer + "}", extraction_config=_CONFIG, parsing_timeout=None)
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def equivalent_to_any(answer: str, golds: list[str]) -> bool:
    """Whether ``answer`` equals one of ``golds`` (tried in order, stopping at the first match)."""
    return any(equivalent(answer, gold) for gold in golds)


for _answer, _gold in ((r"\frac{1}{2}", "0.5"), ("x^2+2x+1", "(x+1)^2"), (r"\{1,2\}", "(1,2]")):
    equivalent(_answer, _gold)
