"""Multiple-choice verifier (GPQA, MMLU-Pro): the chosen option letter vs the gold letter.

score = 1 if the letter read by :func:`~armor_megatron.rewards.extract.extract_choice`
equals the gold letter, else 0. breakdown: ``answer_found``, ``correct``.
"""

from __future__ import annotations

import string
from typing import Any

from armor_megatron.rewards.extract import extract_choice, strip_option_wrappers
from armor_megatron.rewards.registry import register_verifier
from armor_megatron.rewards.result import RewardResult, Verifier


def make_choice_verifier(num_options: int = 10) -> Verifier:
    r"""Verifier for questions with options ``A``.. (``num_options`` of them; 10 = A–J, MMLU-Pro).

    ground_truth: the gold letter (``"C"``, ``"(C)"``, ``"c"``, in LaTeX wrappers such as
    ``\text{C}``, ``\textbf{(C)}``, ``\mathrm{C}``) or its 0-based index (``2``, as in MMLU-Pro's
    ``answer_index``). The response's letter may be wrapped too (``\boxed{\text{(C)}}``, ``(C)``,
    ``C``): see :func:`~armor_megatron.rewards.extract.extract_choice`.
    """
    if not 2 <= num_options <= 26:
        raise ValueError(f"multiple-choice num_options must be in [2, 26], got {num_options}")
    letters = string.ascii_uppercase[:num_options]

    def verify_choice(response: str, ground_truth: Any) -> RewardResult:
        gold = gold_letter(ground_truth, letters)
        chosen = extract_choice(response, letters)
        correct = float(chosen == gold)
        return RewardResult(correct, {"answer_found": float(chosen is not None), "correct": correct}, chosen)

    return verify_choice


def gold_letter(ground_truth: Any, letters: str) -> str:
    """The gold option letter from a letter string or a 0-based index.

    A letter string may carry any wrappers :func:`~armor_megatron.rewards.extract.strip_option_wrappers`
    removes (``(C)``, ``$C$``).
    """
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        if not 0 <= ground_truth < len(letters):
            raise ValueError(f"multiple-choice ground truth index {ground_truth} is outside 0..{len(letters) - 1}")
        return letters[ground_truth]
    if isinstance(ground_truth, str):
        letter = strip_option_wrappers(ground_truth).strip("()").strip().upper()
        if len(letter) == 1 and letter in letters:
            return letter
    raise ValueError(
        f"multiple-choice ground truth {ground_truth!r} is not one of the option letters {letters[0]}-{letters[-1]}"
    )


register_verifier("multiple_choice", check_ground_truth=lambda truth: gold_letter(truth, string.ascii_uppercase[:10]))(
    make_choice_verifier()
)
