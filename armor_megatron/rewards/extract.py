"""Pull the final answer out of a model response (pure string work, no math library).

Answer forms, in priority order:

1. ``\\boxed{...}`` / ``\\fbox{...}`` with balanced braces (escaped ``\\{`` ``\\}`` do not count),
   and the brace-less ``\\boxed 5`` form. Only the LAST box counts; if it is never closed (a
   response cut off at the length limit) there is no final answer, and nothing earlier is
   taken in its place.
2. Without any box, a final answer written at the very END of the response, on its last
   non-empty line: a DAPO-style answer line ``Answer: 42`` (``**Final Answer:** 42``) that
   starts the line, or a Minerva-style ``The final answer is $42$. I hope it is correct.``
   A mention earlier in the text (``... the candidate answer: 14/3. Hmm, but wait``) or
   followed by more reasoning is not a final answer: a truncated response must not score
   by what it said on its way.
3. Multiple-choice letters (``\\boxed{C}``, ``the answer is (C).``, a last line ``C``), see
   :func:`extract_choice`, with the same two rules.

Reasoning models write their thoughts between ``<think>`` and ``</think>``: only the text after
the last ``</think>`` holds the final answer, and a response whose ``<think>`` is never closed
(cut off at the length limit while thinking) has none, whatever it boxed on its way.

Every answer is cleaned the same way (:func:`clean_answer`): surrounding ``$``, markdown
bold and trailing ``.``/``,``/``;`` are dropped, so ``\\boxed{204.}`` reads as ``Answer: 204.``.

Every function here runs in time linear in the length of the text, whatever the text
(no regex with nested or adjacent ambiguous quantifiers, one forward pass for the braces):
the trainer calls them outside the verifier's worker process.
"""

from __future__ import annotations

import re

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BRACE_TOKEN = re.compile(r"\\.|[{}]", re.S)  # an escaped character, or a brace
_BARE_TOKEN = re.compile(r"[^\s$]*")
_NON_SPACE = re.compile(r"\S")
_TRAILING_PUNCTUATION = ".,;"
_ANSWER_LINE = re.compile(r"[\s*#>_]*(?:final\s+)?answer[\s*_]*[:：][\s*_]*", re.I)
_FINAL_PHRASE = re.compile(r"final answer is\b[ \t:]*", re.I)
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_SENTENCE_BREAK = re.compile(r"[.!?;:]\s|,\s*[A-Za-z]{2,}")
_CLOSING_CHARACTERS = " \t.,;!*$)"
_HOPE = "i hope it is correct"  # Minerva's answer format ends with it


# --- boxes ----------------------------------------------------------------------------------


def box_spans(text: str) -> list[tuple[int, int] | None]:
    """``(start, end)`` of every ``\\boxed``/``\\fbox`` argument (``text[start:end]``), in order;
    ``None`` for a command whose argument is missing or never closed. One pass over ``text``."""
    pairs = _matching_braces(text)
    spans: list[tuple[int, int] | None] = []
    for match in _BOX_COMMAND.finditer(text):
        pos = _skip_blanks(text, match.end())
        if pos < len(text) and text[pos] == "{":
            close = pairs.get(pos)
            spans.append((pos + 1, close) if close is not None else None)
        else:
            spans.append(_bare_span(text, pos))
    return spans


def find_boxed(text: str) -> list[str | None]:
    """Every ``\\boxed``/``\\fbox`` argument in ``text``, in order (see :func:`box_spans`).

    An argument is the balanced ``{...}`` group after the command, or, in the ``\\boxed 5``
    form, the run of characters up to the next whitespace or ``$``. Each argument is copied:
    with nested boxes the output (not the scan) grows with the square of the length; the
    verifiers use :func:`box_spans` / :func:`last_boxed` instead.
    """
    return [text[s[0] : s[1]] if s is not None else None for s in box_spans(text)]


def is_blank(text: str, span: tuple[int, int]) -> bool:
    """Whether ``text[start:end]`` is empty or whitespace, without copying it."""
    return _NON_SPACE.search(text, span[0], span[1]) is None


def last_box_command(text: str) -> int | None:
    """End position of the last ``\\boxed``/``\\fbox`` command in ``text``, ``None`` if none."""
    end = None
    for match in _BOX_COMMAND.finditer(text):
        end = match.end()
    return end


def last_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox``), cleaned (:func:`clean_answer`);
    ``None`` if there is none or the last one is unterminated (an earlier box is never taken
    in its place)."""
    end = last_box_command(text)
    if end is None:
        return None
    span = _box_argument(text, end)
    if span is None:
        return None
    return clean_answer(text[span[0] : span[1]])


def _box_argument(text: str, pos: int) -> tuple[int, int] | None:
    """Span of the argument of a box command ending at ``pos``, scanning forward once."""
    pos = _skip_blanks(text, pos)
    if pos >= len(text) or text[pos] != "{":
        return _bare_span(text, pos)
    depth = 0
    for token in _BRACE_TOKEN.finditer(text, pos):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            depth -= 1
            if depth == 0:
                return pos + 1, token.start()
    return None


def _skip_blanks(text: str, pos: int) -> int:
    """Past the whitespace TeX allows between a command and its argument (``\\boxed\\n{5}``)."""
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _bare_span(text: str, pos: int) -> tuple[int, int] | None:
    """``\\boxed 5``: one whitespace/``$``-delimited token, only after a blank."""
    if pos >= len(text) or pos == 0 or text[pos - 1] not in " \t":
        return None
    end = _BARE_TOKEN.match(text, pos).end()
    return (pos, end) if end > pos else None


def _matching_braces(text: str) -> dict[int, int]:
    """Index of each ``{`` -> index of the ``}`` closing it (escaped braces skipped)."""
    open_at: list[int] = []
    pairs: dict[int, int] = {}
    for token in _BRACE_TOKEN.finditer(text):
        if token.group() == "{":
            open_at.append(token.start())
        elif token.group() == "}" and open_at:
            pairs[open_at.pop()] = token.start()
    return pairs


# --- answers written at the end -------------------------------------------------------------


def clean_answer(answer: str) -> str:
    """Strip blanks, markdown bold, one pair of surrounding ``$``/``$$`` and trailing ``.,;``."""
    answer = answer.strip().rstrip(_TRAILING_PUNCTUATION + " \t").strip("*").strip()
    for opening in ("$$", "$"):
        if len(answer) >= 2 * len(opening) and answer.startswith(opening) and answer.endswith(opening):
            answer = answer[len(opening) : -len(opening)].strip()
            break
    return answer.rstrip(_TRAILING_PUNCTUATION + " \t").strip()


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (``""`` if there is none)."""
    text = text.rstrip()
    return text[text.rfind("\n") + 1 :]


def final_answer_text(text: str) -> str | None:
    """The answer written at the end of ``text`` without a box, or ``None``.

    Read from the last non-empty line only: ``Answer: X`` starting the line (optionally
    ``Final``, markdown ``**``/``#``), or ``... the final answer is X`` where ``X`` is a
    closed ``$..$``/``$$..$$``/``\\(..\\)``/``\\[..\\]`` followed by nothing but punctuation and
    an optional ``I hope it is correct.``, or else the rest of the line provided it holds no
    sentence break (``5, but wait`` is reasoning cut off, not an answer).
    """
    line = last_line(text)
    answer_line = _ANSWER_LINE.match(line)
    if answer_line is not None:
        line = line[answer_line.end() :]
        phrase = _last_match(_FINAL_PHRASE, line)
        rest = line[phrase.end() :] if phrase is not None else line
    else:
        phrase = _last_match(_FINAL_PHRASE, line)
        if phrase is None:
            return None
        rest = line[phrase.end() :]
    delimited = _opening_delimiter(rest)
    if delimited is not None:
        opening, closing = delimited
        body = rest.lstrip()
        close = body.find(closing, len(opening))
        if close < 0:
            return None  # math cut off before its closing delimiter
        if _only_closing(body[close + len(closing) :]):
            answer = body[len(opening) : close]
        elif phrase is None:
            answer = rest  # a DAPO answer line is read whole, e.g. "$x=1$ or $x=2$"
        else:
            return None  # "the final answer is $5$. Hmm, no": reasoning goes on
    else:
        answer = clean_answer(_without_hope(rest) if phrase is not None else rest)
        if _SENTENCE_BREAK.search(answer):
            return None  # "5, but wait": reasoning goes on, this is no final answer
    answer = clean_answer(answer)
    return answer or None


def _opening_delimiter(text: str) -> tuple[str, str] | None:
    """The math delimiter pair ``text`` starts with (after blanks), if any."""
    text = text.lstrip()
    for opening, closing in _MATH_DELIMITERS:
        if text.startswith(opening):
            return opening, closing
    return None


def _without_hope(text: str) -> str:
    """``text`` without a trailing ``I hope it is correct.``"""
    stripped = text.rstrip(_CLOSING_CHARACTERS)
    if stripped.lower().endswith(_HOPE):
        return stripped[: -len(_HOPE)]
    return text


def _only_closing(text: str) -> bool:
    """Whether ``text`` holds nothing but closing punctuation and ``I hope it is correct``."""
    return not _without_hope(text).strip(_CLOSING_CHARACTERS)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def after_reasoning(text: str) -> str | None:
    """The part of a response after its reasoning: after the last ``</think>``; the whole text
    if it has no ``<think>``; ``None`` if a ``<think>`` is never closed (no final answer)."""
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    return None if THINK_OPEN in text else text


def final_math_answer(text: str, answer_line_fallback: bool = True) -> str | None:
    """The final answer of a math response (after its reasoning, :func:`after_reasoning`): the
    last box's content if the response has a box command (``None`` if that box is
    unterminated: nothing earlier replaces it), else, with ``answer_line_fallback``,
    :func:`final_answer_text`."""
    text = after_reasoning(text)
    if text is None:
        return None
    if last_box_command(text) is not None:
        return last_boxed(text)
    return final_answer_text(text) if answer_line_fallback else None


def last_answer_line(text: str) -> str | None:
    """Compatibility name for :func:`final_answer_text`."""
    return final_answer_text(text)


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    last = None
    for match in pattern.finditer(text):
        last = match
    return last


# --- multiple choice ------------------------------------------------------------------------

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")


def extract_choice(text: str, letters: str) -> str | None:
    """The option letter a response chose, or ``None``.

    ``letters`` are the valid options, e.g. ``"ABCD"`` (GPQA) or ``"ABCDEFGHIJ"`` (MMLU-Pro);
    matching is case-sensitive on the letter so the article "a" is never read as option A.
    Read after the reasoning (:func:`after_reasoning`). Priority: the last ``\\boxed{}`` (``\\boxed{C}``, ``\\boxed{(C)}``, ``\\boxed{\\text{C. 42}}``;
    an unterminated last box means no answer); then, on the last non-empty line, an answer
    phrase (``Answer: C``, ``**Answer:** (C)``, ``the answer is C.``) followed by nothing but
    punctuation, or a line holding nothing but the letter (``C``, ``(C)``, ``**C.**``).
    """
    text = after_reasoning(text)
    if text is None:
        return None
    cls = "[" + re.escape(letters) + "]"
    end = last_box_command(text)
    if end is not None:
        span = _box_argument(text, end)
        if span is None:
            return None
        inner = _TEXT_WRAPPER.sub(r"\1", text[span[0] : span[1]]).strip()
        match = re.fullmatch(rf"\(?({cls})\)?(?:[.:)]?(?:(?:\s|~|\\[ ,;:!]).*)?)", inner, flags=re.S)
        return match.group(1) if match else None
    line = last_line(text)
    phrase = re.compile(rf"(?i:answer)(?:\s+(?i:is))?[\s*:：]*(?i:option\s+)?\(?({cls})\)?(?![A-Za-z0-9])")
    match = _last_match(phrase, line)
    if match is not None and _only_closing(line[match.end() :]):
        return match.group(1)
    last = line.strip().strip("*$ ").rstrip(".").strip("* ")
    match = re.fullmatch(rf"\(?({cls})\)?", last)
    return match.group(1) if match else None
