r"""Pull the final answer out of a model response (pure string work, no math library).

Answer forms, in priority order:

1. A final-answer statement written after the last box, at the very END of the response: a
   DAPO-style answer line ``Answer: 42`` (``**Final Answer:** 42``, ``Answer: The answer is
   42``) that starts the last non-empty line, or a Minerva-style ``The final answer is $42$.
   I hope it is correct.`` on it. The last stated answer wins: an earlier ``\boxed{200}`` on
   an intermediate step does not outrank a closing ``Final Answer: The final answer is
   $10,455$.`` A statement in words alone (``Answer: see above``, ``The final answer is boxed
   above.``) states no answer of its own and leaves the boxes standing.
2. The boxes ``\boxed{...}`` / ``\fbox{...}`` (balanced braces; escaped ``\{`` ``\}`` do not
   count; also the brace-less ``\boxed 5``) of the FINAL ANSWER SEGMENT. The final answer
   segment is the last box together with the boxes before it that are joined to it by nothing
   but joiners, box after box back from the last:

   * blanks and line breaks, ``,`` ``;`` ``&`` and markdown bold ``**``;
   * math delimiters ``$`` ``$$`` ``\(`` ``\)`` ``\[`` ``\]`` and LaTeX line breaks ``\\``;
   * LaTeX spacing ``~`` ``\,`` ``\;`` ``\:`` ``\!`` ``\ `` ``\quad`` ``\qquad``;
   * the words ``and`` / ``or``, bare or as ``\text{ and }`` (also ``\textrm``, ``\mbox``,
     ``\mathrm``);
   * a variable being assigned: ``x =``, ``x_2 =``, ``x_{2} =``, ``\lambda =``.

   Any other text between two boxes (``wait``, ``so``, ``hence``, a sentence's ``.``, an
   operator such as ``=`` or ``-`` without a variable) ends the segment: the boxes before it
   were said on the way, and the response discarded them. So do a blank box, a box left
   unclosed, and a box nested in (or overlapping) the argument of the one after it. Thus
   ``\boxed{(2, 2)} \quad\text{and}\quad \boxed{(6, 2)}``, ``\boxed{1},\boxed{2},\boxed{3}``
   and ``$x = \boxed{-2}$ and $\boxed{1}$`` are segments of several boxes, while
   ``\boxed{1}, wait, \boxed{2}`` is the one box ``2``. If the last box is never closed (a
   response cut off at the length limit) there is no final answer, and nothing earlier is
   taken in its place.
3. Without any box, the final-answer statement of rule 1 ending the response. A mention
   earlier in the text (``... the candidate answer: 14/3. Hmm, but wait``) or followed by
   more reasoning is not a final answer: a truncated response must not score by what it said
   on its way.
4. Multiple-choice letters (``\boxed{C}``, ``the answer is (C).``, a last line ``C``), see
   :func:`extract_choice`, with the same rules (one box, no segment).

Reasoning models write their thoughts between ``<think>`` and ``</think>``: only the text after
the last ``</think>`` holds the final answer, and a response whose ``<think>`` is never closed
(cut off at the length limit while thinking) has none, whatever it boxed on its way.

Every answer is cleaned the same way (:func:`clean_answer`): surrounding ``$``, markdown
bold and trailing ``.``/``,``/``;`` are dropped, so ``\boxed{204.}`` reads as ``Answer: 204.``.
Inside a statement an escaped ``\$`` is currency, not a math delimiter, and ``\!`` / ``\;`` /
``\:`` / ``\.`` are LaTeX, not a sentence's end: ``The final answer is $\$32,\!348$.`` reads
``\$32,\!348`` and ``Answer: 11,\! 111,\! 100`` reads ``11,\! 111,\! 100``.

Every function here runs in time linear in the length of the text, whatever the text
(no regex with nested or adjacent ambiguous quantifiers, one forward pass for the braces,
each gap between boxes scanned once): the trainer calls them outside the verifier's worker
process.
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
_ANSWER_IS = re.compile(r"answer is\b[ \t:]*", re.I)  # "Answer: The answer is 3"
_WORDS = re.compile(r"[A-Za-z\s.,;:!?'\"]*")  # "see above": no answer of its own
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# a sentence's end, or a separator before a word; \! \; \: before a digit are LaTeX spaces
_SENTENCE_BREAK = re.compile(r"(?<!\\)[.!?;:]\s|[,;:!]\s*[A-Za-z]{2,}")
_CLOSING_CHARACTERS = " \t.,;!*$)"
_HOPE = "i hope it is correct"  # Minerva's answer format ends with it


# --- boxes ----------------------------------------------------------------------------------


def box_spans(text: str) -> list[tuple[int, int] | None]:
    r"""The argument spans of every box command, in order.

    ``(start, end)`` of every ``\boxed``/``\fbox`` argument (``text[start:end]``), in order;
    ``None`` for a command whose argument is missing or never closed. One pass over ``text``.
    """
    return [box[:2] if box is not None else None for _, box in _boxes(text)]


def _boxes(text: str) -> list[tuple[int, tuple[int, int, int] | None]]:
    """Every box command and its argument span, in one pass.

    Every box command as ``(command_start, (arg_start, arg_end, after))``, ``after`` being
    the position past its closing brace; the second item is ``None`` for a command whose
    argument is missing or never closed. One pass over ``text``.
    """
    pairs = _matching_braces(text)
    boxes: list[tuple[int, tuple[int, int, int] | None]] = []
    for match in _BOX_COMMAND.finditer(text):
        pos = _skip_blanks(text, match.end())
        if pos < len(text) and text[pos] == "{":
            close = pairs.get(pos)
            boxes.append((match.start(), (pos + 1, close, close + 1) if close is not None else None))
        else:
            span = _bare_span(text, pos)
            boxes.append((match.start(), (*span, span[1]) if span is not None else None))
    return boxes


def find_boxed(text: str) -> list[str | None]:
    r"""Every ``\boxed``/``\fbox`` argument in ``text``, in order (see :func:`box_spans`).

    An argument is the balanced ``{...}`` group after the command, or, in the ``\boxed 5``
    form, the run of characters up to the next whitespace or ``$``. Each argument is copied:
    with nested boxes the output (not the scan) grows with the square of the length; the
    verifiers use :func:`box_spans` / :func:`last_boxed` instead.
    """
    return [text[s[0] : s[1]] if s is not None else None for s in box_spans(text)]


def is_blank(text: str, span: tuple[int, int]) -> bool:
    """Whether ``text[start:end]`` is empty or whitespace, without copying it."""
    return _NON_SPACE.search(text, span[0], span[1]) is None


def last_box_command(text: str) -> int | None:
    r"""End position of the last ``\boxed``/``\fbox`` command in ``text``, ``None`` if none."""
    end = None
    for match in _BOX_COMMAND.finditer(text):
        end = match.end()
    return end


def last_boxed(text: str) -> str | None:
    r"""Content of the last box, cleaned; None if absent or unterminated.

    Content of the LAST ``\boxed{...}`` (or ``\fbox``), cleaned (:func:`clean_answer`);
    ``None`` if there is none or the last one is unterminated (an earlier box is never taken
    in its place).
    """
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
    r"""Past the whitespace TeX allows between a command and its argument (``\boxed\n{5}``)."""
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def match_end(pattern: re.Pattern[str], text: str, pos: int = 0) -> int:
    """Where ``pattern``'s match at ``pos`` ends; the pattern matches the empty string, so it always matches."""
    match = pattern.match(text, pos)
    assert match is not None
    return match.end()


def _bare_span(text: str, pos: int) -> tuple[int, int] | None:
    r"""``\boxed 5``: one whitespace/``$``-delimited token, only after a blank."""
    if pos >= len(text) or pos == 0 or text[pos - 1] not in " \t":
        return None
    end = match_end(_BARE_TOKEN, text, pos)
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


_JOINER = re.compile(
    r"""\s+|[,;&]|\*\*|\$+|\\[()\[\]]|\\\\|~|\\[,;:! ]|\\q?quad(?![A-Za-z])
    |(?:and|or)(?![A-Za-z])
    |\\(?:text|textrm|textnormal|mbox|mathrm)\s*\{[\s,;~]*(?:(?:and|or)[\s,;~]*)?\}
    |(?:[A-Za-z]|\\[A-Za-z]+)(?:_(?:\w|\{\w+\}))?\s*=""",
    re.X,
)


def final_box_segment(text: str) -> list[tuple[int, int]] | None:
    """Argument spans of the boxes in the final answer segment (module docstring).

    In order, the last box last; ``None`` if ``text`` has no box or its last box is never
    closed. Each gap between two boxes is scanned once: linear time.
    """
    return _segment(text, _boxes(text))


def _segment(text: str, boxes: list[tuple[int, tuple[int, int, int] | None]]) -> list[tuple[int, int]] | None:
    if not boxes or boxes[-1][1] is None:
        return None
    segment = [boxes[-1][1]]
    start = boxes[-1][0]
    for command_start, box in reversed(boxes[:-1]):
        if box is None or box[2] > start or is_blank(text, box[:2]) or not _only_joiners(text, box[2], start):
            break
        segment.append(box)
        start = command_start
    return [box[:2] for box in reversed(segment)]


def _only_joiners(text: str, pos: int, end: int) -> bool:
    """Whether ``text[pos:end]`` is a run of joiners (module docstring), scanning it once."""
    while pos < end:
        match = _JOINER.match(text, pos, end)
        if match is None or match.end() == pos:
            return False
        pos = match.end()
    return True


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
    r"""The answer written at the end of ``text`` without a box, or ``None``.

    Read from the last non-empty line only: ``Answer: X`` starting the line (optionally
    ``Final``, markdown ``**``/``#``), or ``... the final answer is X`` where ``X`` is a
    closed ``$..$``/``$$..$$``/``\(..\)``/``\[..\]`` followed by nothing but punctuation and
    an optional ``I hope it is correct.``, or else the rest of the line provided it holds no
    sentence break (``5, but wait`` is reasoning cut off, not an answer).
    """
    line = last_line(text)
    answer_line = _ANSWER_LINE.match(line)
    if answer_line is not None:
        line = line[answer_line.end() :]
        phrase = _last_match(_ANSWER_IS, line)
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
        close = _find_closing(body, closing, len(opening))
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


def _find_closing(text: str, closing: str, pos: int) -> int:
    r"""Index of the first unescaped ``closing`` delimiter from ``pos``, or -1.

    ``\$`` is a dollar sign inside ``$..$``, not its end. One forward scan.
    """
    for token in re.compile(re.escape(closing) + r"|\\.", re.S).finditer(text, pos):
        if token.group() == closing:
            return token.start()
    return -1


def _opening_delimiter(text: str) -> tuple[str, str] | None:
    """The math delimiter pair ``text`` starts with (after blanks), if any."""
    text = text.lstrip()
    for opening, closing in _MATH_DELIMITERS:
        if text.startswith(opening):
            return opening, closing
    return None


def _without_hope(text: str) -> str:
    """``text`` without a trailing "I hope it is correct."."""
    stripped = text.rstrip(_CLOSING_CHARACTERS)
    if stripped.lower().endswith(_HOPE):
        return stripped[: -len(_HOPE)]
    return text


def _only_closing(text: str) -> bool:
    """Whether ``text`` holds nothing but closing punctuation and ``I hope it is correct``."""
    return not _without_hope(text).strip(_CLOSING_CHARACTERS)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def after_reasoning(text: str) -> str | None:
    """The part of a response after its reasoning: after the last ``</think>``.

    The whole text if it has no ``<think>``; ``None`` if a ``<think>`` is never closed (no final
    answer).
    """
    close = text.rfind(THINK_CLOSE)
    if close >= 0:
        return text[close + len(THINK_CLOSE) :]
    return None if THINK_OPEN in text else text


def final_math_answers(text: str, answer_line_fallback: bool = True) -> list[str] | None:
    """The final answer of a math response, as the list of what it states.

    The final answer of a math response (after its reasoning, :func:`after_reasoning`), as
    the list of what it states, or ``None`` if it states nothing (module docstring, rules 1-3):

    * a final-answer statement (:func:`final_answer_text`) in the text after the last box
      (with ``answer_line_fallback``): ``[statement]``, the last stated answer, unless it is
      words alone (``Answer: see above``, ``The final answer is boxed above.``, ``three``:
      letters, blanks and punctuation, other than an option letter), which leave the boxes
      standing;
    * else the cleaned contents of the boxes of the final answer segment
      (:func:`final_box_segment`), in order, each once (at its last place, so the last box
      comes last); ``None`` if the last box is unterminated (nothing earlier replaces it)
      or blank;
    * without a box, with ``answer_line_fallback``, ``[statement]`` of the whole text.
    """
    answer_part = after_reasoning(text)
    if answer_part is None:
        return None
    text = answer_part
    boxes = _boxes(text)
    if not boxes:
        statement = final_answer_text(text) if answer_line_fallback else None
        return [statement] if statement else None
    last = boxes[-1][1]
    if last is None:
        return None
    if answer_line_fallback:
        statement = final_answer_text(text[last[2] :])
        if statement and (_WORDS.fullmatch(statement) is None or option_letter(statement) is not None):
            return [statement]
    answers: list[str] = []
    seen: set[str] = set()
    for start, stop in reversed(_segment(text, boxes) or []):  # not None: the last box is closed
        answer = clean_answer(text[start:stop])
        if answer not in seen and (answer or not answers):
            seen.add(answer)
            answers.append(answer)
    return answers[::-1] if answers[0] else None  # answers[0]: the last box, blank or not


def final_math_answer(text: str, answer_line_fallback: bool = True) -> str | None:
    """The last answer :func:`final_math_answers` reads, or None.

    That is the final-answer statement, or the last box of the final answer segment.
    """
    answers = final_math_answers(text, answer_line_fallback)
    return answers[-1] if answers else None


def last_answer_line(text: str) -> str | None:
    """Compatibility name for :func:`final_answer_text`."""
    return final_answer_text(text)


def _last_match(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    last = None
    for match in pattern.finditer(text):
        last = match
    return last


# --- multiple choice ------------------------------------------------------------------------

_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_LETTER_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mbox)\s*\{(.*)\}", re.S)
_MAX_LETTER_TEXT = 64  # an option letter in its wrappers is short; longer texts are not read


def strip_option_wrappers(text: str) -> str:
    r"""``text`` without the wrappers an option letter is written in.

    Surrounding ``$``, text commands (``\text{}``, ``\textbf{}``, ``\textrm{}``, ``\mathrm{}``,
    ``\mathbf{}``, ``\mbox{}``) and parentheses, any number, in any order: ``\textbf{(C)}`` ->
    ``C``, ``(\mathrm{C})`` -> ``C``. Texts longer than 64 characters are returned stripped only.
    """
    text = text.strip()
    if len(text) > _MAX_LETTER_TEXT:
        return text
    while True:
        text = text.strip().strip("$").strip()
        wrapped = _LETTER_WRAPPER.fullmatch(text)
        if wrapped is not None:
            text = wrapped.group(1)
        elif len(text) >= 2 and text[0] == "(" and text[-1] == ")":
            text = text[1:-1]
        else:
            return text


def option_letter(text: str) -> str | None:
    r"""The option letter ``text`` names and nothing else, or ``None``.

    One capital letter in any wrappers (:func:`strip_option_wrappers`): ``C``, ``(C)``,
    ``\text{C}``, ``\textbf{C}``, ``\mathrm{C}``, ``\text{(C)}``, ``$\textbf{(C)}$`` all name ``C``;
    ``c``, ``CD``, ``\text{C} + 1`` name none.
    """
    letter = strip_option_wrappers(text)
    return letter if len(letter) == 1 and "A" <= letter <= "Z" else None


def extract_choice(text: str, letters: str) -> str | None:
    r"""The option letter a response chose, or ``None``.

    ``letters`` are the valid options, e.g. ``"ABCD"`` (GPQA) or ``"ABCDEFGHIJ"`` (MMLU-Pro);
    matching is case-sensitive on the letter so the article "a" is never read as option A.
    Read after the reasoning (:func:`after_reasoning`). Priority: an answer phrase on the
    last non-empty line after the last box (``Answer: C``, ``**Answer:** (C)``,
    ``the answer is \text{(C)}.``) followed by nothing but punctuation: the last stated answer
    wins; else the last ``\boxed{}`` (``\boxed{C}``, ``\boxed{(C)}``, ``\boxed{\text{(C)}}``,
    ``\boxed{\text{C. 42}}``; an unterminated last box means no answer); without a box, that
    answer phrase, or a last line holding nothing but the letter (``C``, ``(C)``, ``**C.**``,
    ``$\text{(C)}$``).
    """
    answer_part = after_reasoning(text)
    if answer_part is None:
        return None
    text = answer_part
    cls = "[" + re.escape(letters) + "]"
    boxes = _boxes(text)
    if boxes:
        last = boxes[-1][1]
        if last is None:
            return None
        stated = _stated_choice(text[last[2] :], cls)
        if stated is not None:
            return stated
        inner = _TEXT_WRAPPER.sub(r"\1", text[last[0] : last[1]]).strip()
        match = re.fullmatch(rf"\(?({cls})\)?(?:[.:)]?(?:(?:\s|~|\\[ ,;:!]).*)?)", inner, flags=re.S)
        return match.group(1) if match else None
    stated = _stated_choice(text, cls)
    if stated is not None:
        return stated
    bare = _TEXT_WRAPPER.sub(r"\1", last_line(text)).strip().strip("*$ ").rstrip(".").strip("* ")
    match = re.fullmatch(rf"\(?({cls})\)?", bare)
    return match.group(1) if match else None


def _stated_choice(text: str, cls: str) -> str | None:
    """The letter of an answer phrase on the last non-empty line, or None.

    Only closing punctuation (or ``I hope it is correct``) may follow the phrase: ``the answer
    is (C).`` counts, ``the answer is (C) because ...`` does not.
    """
    line = _TEXT_WRAPPER.sub(r"\1", last_line(text))
    phrase = re.compile(rf"(?i:answer)(?:\s+(?i:is))?[\s*:：]*(?i:option\s+)?\(?({cls})\)?(?![A-Za-z0-9])")
    match = _last_match(phrase, line)
    if match is not None and _only_closing(line[match.end() :]):
        return match.group(1)
    return None
