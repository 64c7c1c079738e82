r"""Knowledge verifier.

Short-answer factual questions (rows ``type: knowledge``), scored by normalised exact match against
the gold answer and its aliases, as TriviaQA's scorer does.

score = 1 if normalise(answer) equals normalise(alias) for some alias, else 0, where
normalise lower-cases, strips accents (NFD), turns ``_`` into a space, drops punctuation and
the articles ``a``/``an``/``the``, and collapses white space: ``"The Beatles!"`` ==
``"beatles"``, ``"Pelé"`` == ``"pele"``.

The answer is the response's final answer as the math verifier reads it (the last
``\boxed{}``, else a final ``Answer:`` line or ``The final answer is X.`` at the very end);
a response without one counts as its own answer only if it is short (at most
``MAX_BARE_WORDS`` words: a bare ``Paris``), so that a long explanation that merely contains
the right words scores 0.

ground_truth: a string, a list of acceptable strings, or a TriviaQA-style dict with
``value`` and/or ``aliases`` (``normalized_aliases`` is also read). breakdown:
``answer_found``, ``correct``.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from armor_megatron.rewards.extract import final_math_answer, last_box_command
from armor_megatron.rewards.registry import register_verifier
from armor_megatron.rewards.result import RewardResult
from armor_megatron.rewards.safety import reply_text

MAX_BARE_WORDS = 10
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_PUNCTUATION = str.maketrans("", "", string.punctuation + "‘’´`“”")


def normalize_answer(text: str) -> str:
    """TriviaQA-style normalisation (module docstring)."""
    text = unicodedata.normalize("NFD", text)
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    text = text.lower().replace("_", " ").translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def gold_aliases(ground_truth: Any) -> list[str]:
    """The acceptable answers of a knowledge row; one-line error if there is none."""
    if isinstance(ground_truth, Mapping):
        items = [
            ground_truth.get("value"),
            *ground_truth.get("aliases", ()),
            *ground_truth.get("normalized_aliases", ()),
        ]
    elif isinstance(ground_truth, Sequence) and not isinstance(ground_truth, str):
        items = list(ground_truth)
    else:
        items = [ground_truth]
    aliases = [str(item) for item in items if isinstance(item, (str, int, float)) and not isinstance(item, bool)]
    aliases = [a for a in aliases if normalize_answer(a)]
    if not aliases:
        raise ValueError(f"knowledge ground truth has no non-empty answer: {ground_truth!r}")
    return aliases


def knowledge_answer(response: str) -> str | None:
    """The answer a response gives (module docstring), or ``None``."""
    reply = reply_text(response)
    answer = final_math_answer(reply)
    if answer is None and last_box_command(reply) is None:
        bare = reply.strip()
        if bare and len(bare.split()) <= MAX_BARE_WORDS:
            answer = bare.rstrip(".")
    if answer:
        answer = _TEXT_WRAPPER.sub(r"\1", answer).strip()
    return answer or None


def verify_knowledge(response: str, ground_truth: Any) -> RewardResult:
    """1 when the response's answer matches one of the ground truth's aliases after normalisation, else 0."""
    aliases = {normalize_answer(a) for a in gold_aliases(ground_truth)}
    answer = knowledge_answer(response)
    correct = answer is not None and normalize_answer(answer) in aliases
    return RewardResult(float(correct), {"answer_found": float(answer is not None), "correct": float(correct)}, answer)


register_verifier("knowledge")(verify_knowledge)
