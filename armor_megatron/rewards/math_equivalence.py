r"""math-verify equivalence, imported only inside reward worker processes.

Importing this module loads math-verify and sympy and warms their first-use caches (the
LaTeX grammar, sympy's simplifier), so that the worker's timed calls measure comparison
work only. The caller (:mod:`armor_megatron.rewards.math_answer`) enforces the timeout, so
math-verify's signal-based one is switched off.

Before math-verify sees them, both texts are read the way competition answers are written
where its LaTeX parser reads them otherwise:

* a thousands separator written as a LaTeX space (``10\,000``, ``2\ 500``) is dropped
  (math-verify reads ``10\,000`` as ``10·000 = 0``);
* plain numbers on both sides (``033``, ``2.50``, ``4.5e33``, ``1e-07``) are compared as decimals:
  integers exactly, others within a relative 1e-6 (math-verify rounds to 6 decimals, which
  makes ``1e-7`` equal ``2e-7``); a number in E-notation against LaTeX becomes
  ``m\times10^{k}`` (math-verify reads ``4.5e33`` as ``4.5·e·33``, e being Euler's number);
* an option letter in any wrapper (``C``, ``(C)``, ``\text{C}``, ``\textbf{(C)}``,
  ``\mathrm{C}``) matches the same letter in any wrapper, and no other letter (math-verify alone
  tells ``\text{(C)}`` and ``(C)`` from ``\text{C}``);
* an AMC-style answer that names an option and its value, ``\textbf{(D)}\ 24`` (math-verify
  reads ``d·24``), matches the gold letter (``D``, ``(D)``, ``\text{(D)}``) or, against a gold
  value, by its value. A text naming two options (``\text{(C)}, \text{(D)}``,
  ``(C) \text{ or } (D)``) names no single option.

The answers of a final answer segment of several boxes
(:func:`~armor_megatron.rewards.extract.final_math_answers`) match a gold when their union,
``a, b, c``, equals it (math-verify reads a comma list as a set: order-free), or when each of
them equals it on its own (the same answer restated, ``\boxed{x = 6}``, ``\boxed{6}``). Boxes
that name different values of which only the last equals the gold (``\boxed{2}`` or
``\boxed{3}`` for gold 3) do not match: a response claiming both is not right, and a hedge
must not score what a committed answer scores.
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from armor_megatron.rewards.extract import match_end, option_letter

logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled" warnings

_CONFIG = [LatexExtractionConfig(), ExprExtractionConfig()]
_RELATIVE_TOLERANCE = Decimal("1e-6")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_E_NOTATION = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))[eE]([+-]?\d+)")
_SPACED_THOUSANDS = re.compile(r"(?<=\d)(?:\\[,;:! ]|~)(?=\d{3}(?!\d))")
_OPTION = re.compile(r"\s*(\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{)?\s*\(([A-E])\)")
_OPTION_GAP = re.compile(r"(?:\s|~|\\[ ,;:!]|\\q?quad(?![A-Za-z]))*")
_ANY_OPTION = re.compile(r"\(\s*[A-Z]\s*\)")


def equivalent(answer: str, gold: str) -> bool:
    """Whether ``answer`` equals ``gold`` mathematically.

    Both are answer texts, LaTeX or plain. math-verify's ``verify`` is not symmetric: the gold
    goes first.
    """
    answer_letter, gold_letter = option_letter(answer), option_letter(gold)
    if answer_letter and gold_letter:
        return answer_letter == gold_letter
    answer_option, answer_value = _split_option(answer)
    gold_option, gold_value = _split_option(gold)
    if answer_option and gold_option:
        return answer_option == gold_option
    if answer_option or gold_option:
        option, value, other = (
            (answer_option, answer_value, gold) if answer_option else (gold_option, gold_value, answer)
        )
        if option_letter(other) == option:
            return True
        if not value:
            return False
        return _values_equal(value, other) if answer_option else _values_equal(other, value)
    return _values_equal(answer, gold)


def equivalent_to_any(answer: str, golds: list[str]) -> bool:
    """Whether ``answer`` equals one of ``golds`` (tried in order, stopping at the first match)."""
    return any(equivalent(answer, gold) for gold in golds)


def answers_match(answers: list[str], golds: list[str]) -> bool:
    """Whether a response's final answers match one of ``golds``.

    Whether the answers of a response's final answer segment (one or several boxes, or one
    statement) match one of ``golds``: one answer equal to it, or several whose union
    ``", ".join(answers)`` equals it, or several each equal to it (module docstring).
    """
    if len(answers) == 1:
        return equivalent_to_any(answers[0], golds)
    union = ", ".join(answers)
    return any(equivalent(union, gold) or all(equivalent(a, gold) for a in answers) for gold in golds)


def _values_equal(answer: str, gold: str) -> bool:
    answer, gold = _SPACED_THOUSANDS.sub("", answer).strip(), _SPACED_THOUSANDS.sub("", gold).strip()
    answer_number, gold_number = _plain_number(answer), _plain_number(gold)
    if answer_number is not None and gold_number is not None:
        return _numbers_equal(answer, answer_number, gold, gold_number)
    answer, gold = _E_NOTATION.sub(r"\1\\times10^{\2}", answer), _E_NOTATION.sub(r"\1\\times10^{\2}", gold)
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=_CONFIG, parsing_timeout=None)
    answer_parsed = parse("\\boxed{" + answer + "}", extraction_config=_CONFIG, parsing_timeout=None)
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _plain_number(text: str) -> Decimal | None:
    if _PLAIN_NUMBER.fullmatch(text) is None:
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def _numbers_equal(answer: str, a: Decimal, gold: str, g: Decimal) -> bool:
    if a == g:
        return True
    integers = not any(c in text for text in (answer, gold) for c in ".eE")
    if integers:
        return False
    return abs(a - g) <= _RELATIVE_TOLERANCE * max(abs(a), abs(g))


def _split_option(text: str) -> tuple[str | None, str]:
    r"""Split an answer that starts by naming an option into (letter, value).

    ``(letter, value)`` of an answer that starts by naming an option ``(A)``..``(E)``, bare or
    in ``\text{}``/``\textbf{}`` (``\textbf{(D)}\ 24`` -> ``("D", "24")``, ``\text{(C)}`` ->
    ``("C", "")``); ``(None, text)`` otherwise.
    """
    match = _OPTION.match(text)
    if match is None:
        return None, text
    rest = text[match.end() :]
    inside = 0
    if match.group(1):  # the wrapper's closing brace, after an optional gap inside it
        inside = match_end(_OPTION_GAP, rest)
        if not rest[inside:].startswith("}"):
            rest = rest[inside:]
            close = rest.find("}")
            if close < 0:
                return None, text
            rest = rest[:close] + rest[close + 1 :]
        else:
            rest = rest[inside + 1 :]
    gap = match_end(_OPTION_GAP, rest)
    if rest and not gap and not inside:
        return None, text  # "(A)\cup(B)", "\text{(C)}, \text{(D)}": not one option and its value
    value = rest[gap:].strip()
    if _ANY_OPTION.search(value):
        return None, text  # "\text{(C)} \text{ or } \text{(D)}" names two options
    return match.group(2), value


for _answer, _gold in ((r"\frac{1}{2}", "0.5"), ("x^2+2x+1", "(x+1)^2"), (r"\{1,2\}", "(1,2]")):
    equivalent(_answer, _gold)
