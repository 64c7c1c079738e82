"""Pull the final answer out of a model response (pure string work, no math library).

Three answer forms are read:

* ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (escaped ``\\{`` ``\\}`` do not count),
  and the brace-less ``\\boxed 5`` form;
* a DAPO-style answer line, ``Answer: 42`` (the last one wins);
* multiple-choice letters (``Answer: C``, ``\\boxed{C}``, ``(C)``), see :func:`extract_choice`.
"""

from __future__ import annotations

import re

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_ANSWER_LINE = re.compile(r"(?i:answer)\s*\**\s*:\s*([^\n]+)")


def find_boxed(text: str) -> list[str | None]:
    """Every ``\\boxed``/``\\fbox`` argument in ``text``, in order.

    An argument is the balanced ``{...}`` group after the command, or, in the ``\\boxed 5``
    form, the run of characters up to the next whitespace or ``$``. A command whose argument
    is missing or never closed (a response cut off at the length limit) gives ``None``.
    """
    found: list[str | None] = []
    for match in _BOX_COMMAND.finditer(text):
        found.append(_box_argument(text, match.end()))
    return found


def last_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox``), stripped; ``None`` if there is none
    or the last one is unterminated (an earlier box is never taken in its place)."""
    boxes = find_boxed(text)
    if not boxes or boxes[-1] is None:
        return None
    return boxes[-1].strip()


def last_answer_line(text: str) -> str | None:
    """The text after the last ``Answer:`` (case-insensitive; markdown bold and surrounding
    ``$`` removed), or ``None``."""
    matches = _ANSWER_LINE.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip().strip("*").strip()
    if len(answer) >= 2 and answer[0] == "$" and answer[-1] == "$":
        answer = answer.strip("$").strip()
    answer = answer.rstrip(".").strip()
    return answer or None


def _box_argument(text: str, pos: int) -> str | None:
    n = len(text)
    while pos < n and text[pos] in " \t":
        pos += 1
    if pos >= n:
        return None
    if text[pos] != "{":
        # "\boxed 5": the argument is one whitespace/$-delimited token.
        if pos == 0 or text[pos - 1] not in " \t":
            return None
        end = pos
        while end < n and not text[end].isspace() and text[end] != "$":
            end += 1
        return text[pos:end] or None
    depth = 0
    i = pos
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character, e.g. \{ or \}, never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[pos + 1 : i]
        i += 1
    return None


# --- multiple choice ------------------------------------------------------------------------

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")


def extract_choice(text: str, letters: str) -> str | None:
    """The option letter a response chose, or ``None``.

    ``letters`` are the valid options, e.g. ``"ABCD"`` (GPQA) or ``"ABCDEFGHIJ"`` (MMLU-Pro);
    matching is case-sensitive on the letter so the article "a" is never read as option A.
    Priority: the last ``\\boxed{}`` (``\\boxed{C}``, ``\\boxed{(C)}``, ``\\boxed{\\text{C. 42}}``);
    then the last answer phrase (``Answer: C``, ``**Answer:** (C)``, ``the answer is C``);
    then a final line holding nothing but the letter (``C``, ``(C)``, ``**C.**``).
    """
    cls = "[" + re.escape(letters) + "]"
    boxed = last_boxed(text)
    if boxed is not None:
        inner = _TEXT_WRAPPER.sub(r"\1", boxed).strip()
        match = re.fullmatch(rf"\(?({cls})\)?(?:[.:)]?(?:\s.*)?)", inner, flags=re.S)
        return match.group(1) if match else None
    phrase = re.compile(rf"(?i:answer)(?:\s+(?i:is))?[\s*]*[:：]?[\s*]*(?i:option\s+)?\(?({cls})\)?(?![A-Za-z0-9])")
    matches = phrase.findall(text)
    if matches:
        return matches[-1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if lines:
        last = lines[-1].strip("*$ ").rstrip(".").strip("* ")
        match = re.fullmatch(rf"\(?({cls})\)?", last)
        if match:
            return match.group(1)
    return None
