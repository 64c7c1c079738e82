import time

import pytest

from armor_megatron.rewards.extract import (
    box_spans,
    extract_choice,
    final_answer_text,
    final_box_segment,
    final_math_answer,
    final_math_answers,
    find_boxed,
    is_blank,
    last_answer_line,
    last_boxed,
    option_letter,
    strip_option_wrappers,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{ 204 }", "204"),
        (r"\boxed{\frac{a}{b^{2}}}", r"\frac{a}{b^{2}}"),  # nested groups
        (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not close the group
        (r"\boxed{\}}", r"\}"),
        (r"\fbox{7}", "7"),
        (r"\boxed{1} and \fbox{2}", "2"),
        (r"\boxed 5$ more", "5"),  # brace-less form ends at $ or whitespace
        (r"\boxed {3}", "3"),
        ("\\boxed\n{4}", "4"),  # TeX allows a line break before the argument
        (r"\boxed{1} \boxed{2", None),  # last one unterminated: no answer, not the earlier box
        ("no box", None),
        (r"\boxedfoo{1}", None),  # not the \boxed command
        (r"\boxed", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_find_boxed_lists_every_box_in_order():
    assert find_boxed(r"\boxed{1}, \fbox{x^{2}}, \boxed{") == ["1", "x^{2}", None]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("work...\nAnswer: 42", "42"),
        ("Answer: 1\nAnswer: 2.", "2"),  # last one, trailing period dropped
        ("**Answer:** $\\frac{1}{2}$", r"\frac{1}{2}"),
        ("answer : -3", "-3"),
        ("no answer line", None),
        ("Answer:   \n", None),
    ],
)
def test_last_answer_line(text, expected):
    assert last_answer_line(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Reasoning...\nAnswer: C", "C"),
        ("**Answer:** (B)", "B"),
        ("**Answer**: D", "D"),
        ("Therefore, the answer is (J).", "J"),
        ("The correct answer is A.", "A"),
        ("Answer: option H", "H"),
        (r"\boxed{C}", "C"),
        (r"\boxed{(E)}", "E"),
        (r"\boxed{\text{B. 42 apples}}", "B"),
        (r"Answer: A. On reflection \boxed{D}", "D"),  # the box wins over the phrase
        ("Answer: B\nWait. Answer: C", "C"),  # the last phrase wins
        ("I pick\n(C)", "C"),  # final line holding only the letter
        ("G", "G"),
        ("**F.**", "F"),
        ("The answer is a tricky one.", None),  # lower-case article is not option A
        ("Options (A) and (B) both look wrong to me.", None),
        (r"\boxed{42}", None),  # a box that is not a letter
        ("Answer: K", None),  # not an option (A-J)
        ("", None),
    ],
)
def test_extract_choice(text, expected):
    assert extract_choice(text, "ABCDEFGHIJ") == expected


def test_extract_choice_respects_the_option_count():
    assert extract_choice("Answer: E", "ABCD") is None
    assert extract_choice("Answer: E", "ABCDE") == "E"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The final answer is $G$.", "G"),
        ("Work.\nFinal Answer: The final answer is $\\frac{3}{5}$. I hope it is correct.", r"\frac{3}{5}"),
        ("So the final answer is $$x^2$$", "x^2"),
        ("The final answer is \\(7\\).", "7"),
        ("The final answer is 42.", "42"),
        ("The final answer is 42. I hope it is correct.", "42"),
        ("**Final Answer:** 17", "17"),
        ("### Answer: 3", "3"),
        ("Answer: 204\n\n", "204"),
        ("Answer: The answer is $7$.", "7"),
        ("Answer: the answer is 7, but wait", None),
        # not at the end: a mention on the way, or reasoning cut off after it
        ("Answer: 204\nWait, let me check that again", None),
        ("… the candidate answer: \\frac{14}{3}. Hmm, but wait", None),
        ("The final answer is $5$. Hmm, no, let me", None),
        ("So the final answer is 5, but wait", None),
        ("The final answer is $5", None),  # unclosed math
        ("I think the answer: 12", None),  # "Answer:" must start the line
    ],
)
def test_final_answer_text_reads_only_the_end(text, expected):
    assert final_answer_text(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Answer: 204\nWait, recompute... \\boxed{205", None),  # unterminated last box: no answer at all
        ("\\boxed{204} hmm \\boxed{", None),
        ("\\boxed{204.}", "204"),  # trailing punctuation stripped like "Answer: 204."
        ("\\boxed{ $204$ ;}", "204"),
        ("\\boxed{2.5}", "2.5"),
        ("Answer: 204.", "204"),
        ("The final answer is $G$.", "G"),
        ("no answer", None),
    ],
)
def test_final_math_answer(text, expected):
    assert final_math_answer(text) == expected


# The final answer segment: the last box and the boxes joined to it by joiners alone.
@pytest.mark.parametrize(
    "text, expected",
    [
        # several boxes that together state the answer
        (r"so \boxed{(2, 2)} \quad\text{and}\quad \boxed{(6, 2)}", ["(2, 2)", "(6, 2)"]),
        (r"\boxed{1},\boxed{2},\boxed{3}", ["1", "2", "3"]),
        (r"$x = \boxed{-2}$ and $\boxed{1}$", ["-2", "1"]),
        (r"x = \boxed{-2} and \boxed{1}.", ["-2", "1"]),
        (r"$x_1 = \boxed{-2}$,\ $x_{2} = \boxed{1}$", ["-2", "1"]),
        (r"\lambda = \boxed{3} \text{ or } \lambda = \boxed{4}", ["3", "4"]),
        (r"**\boxed{1}** and **\boxed{2}**", ["1", "2"]),
        ("\\[\\boxed{1}\\]\n\\[\\boxed{2}\\]", ["1", "2"]),
        (r"\boxed 5 and \boxed 6", ["5", "6"]),
        (r"\boxed{1}, \boxed{2}, \boxed{1}", ["2", "1"]),  # each once, the last box last
        (r"\boxed{5} and \boxed{5}", ["5"]),
        # boxes the response left behind: any other text between two boxes ends the segment
        (r"\boxed{1}, wait, \boxed{2}", ["2"]),
        (r"\boxed{1}. Hmm, actually \boxed{2}", ["2"]),
        (r"$x = \boxed{-2}$, so $\boxed{1}$", ["1"]),
        (r"\boxed{3} then \boxed{4}", ["4"]),
        (r"\boxed{6} = \boxed{6}", ["6"]),  # an operator, not a joiner
        (r"\boxed{2} - \boxed{1}", ["1"]),
        (r"\boxed{1} and \boxed{}", None),  # the last box is blank
        (r"\boxed{} and \boxed{2}", ["2"]),  # a blank box ends the segment
        (r"\boxed{1} and \boxed{2", None),  # unterminated last box: no answer
        (r"\boxed{\boxed{1}}", ["1"]),  # nested: the inner (last) box alone
        (r"\boxed{a \boxed{1}}, \boxed{2}", ["2"]),
        (r"\boxed{1}\text{, the smallest, and }\boxed{2}", ["2"]),  # words in \text{} are text
    ],
)
def test_final_answer_segment(text, expected):
    assert final_math_answers(text) == expected
    segment = final_box_segment(text)
    if expected is not None and segment is not None:
        assert text[segment[-1][0] : segment[-1][1]].strip() == last_boxed(text)


@pytest.mark.parametrize(
    "text, expected",
    [
        # a closing statement after the last box is the last stated answer: it wins
        ("First \\boxed{200}.\n\nFinal Answer: The final answer is $10,455$. I hope it is correct.", ["10,455"]),
        ("so \\boxed{200} is a subtotal. The final answer is $10,455$.", ["10,455"]),
        ("\\boxed{5}\n\nAnswer: 6", ["6"]),
        ("\\boxed{5}\n\nAnswer: The answer is 6.", ["6"]),
        ("\\boxed{24}\n\nAnswer: (D)", ["(D)"]),  # an option letter is an answer
        # a statement in words alone states no answer of its own: the boxes stand
        ("\\boxed{5}\n\nAnswer: see above", ["5"]),
        ("\\boxed{5}\n\nThe final answer is boxed above.", ["5"]),
        ("\\boxed{5}\n\nAnswer: five", ["5"]),
        # ...and only a closing one: a statement inside a box, or followed by more text, does not
        ("Answer: \\boxed{5}", ["5"]),
        ("The final answer is $\\boxed{7}$. I hope it is correct.", ["7"]),
        ("\\boxed{5}\nThe final answer is $6$. Hmm, no, let me", ["5"]),
        ("\\boxed{5}\nAnswer: 6\nWait, that is not right", ["5"]),
        ("The final answer is $10,455$.\n\\boxed{200}", ["200"]),  # the box comes last
        ("Answer: 6\n\\boxed{5", None),  # cut off inside the last box
    ],
)
def test_the_last_stated_answer_wins(text, expected):
    assert final_math_answers(text) == expected


def test_the_statement_after_a_box_needs_the_fallback():
    text = "\\boxed{200}\nAnswer: 10455"
    assert final_math_answers(text, answer_line_fallback=False) == ["200"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The final answer is $\\$32,\\!348$.", r"\$32,\!348"),  # an escaped $ does not close the math
        ("The final answer is $\\$32,\\!348$. I hope it is correct.", r"\$32,\!348"),
        ("Answer: $\\$5$", r"\$5"),
        ("The final answer is \\$32,\\!348.", r"\$32,\!348"),
        ("Answer: 11,\\! 111,\\! 111,\\! 100", r"11,\! 111,\! 111,\! 100"),  # \! is LaTeX, not a sentence end
        ("Answer: 1\\; 000", r"1\; 000"),
        # twins: an unescaped $ closes the math, a real sentence end still ends the answer
        ("The final answer is $\\$32$, \\!348. Let me check", None),
        ("The final answer is $\\$32,\\!348", None),  # math cut off: only the escaped dollar inside
        ("Answer: 11! Hmm, wait", None),
        ("Answer: 5\\; but actually 6", None),
        ("Answer: 11; 111 more to go", None),
    ],
)
def test_statements_read_escaped_dollars_and_latex_spaces(text, expected):
    assert final_answer_text(text) == expected


def test_final_math_answer_without_fallback_reads_boxes_only():
    assert final_math_answer("Answer: 3", answer_line_fallback=False) is None
    assert final_math_answer("\\boxed{3}", answer_line_fallback=False) == "3"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{B}\nOn reflection, the answer is (C).", "C"),  # the last stated answer wins
        ("value: \\boxed{42}\nThe answer is \\text{(C)}.", "C"),
        ("\\boxed{B}\nThe answer is (C). Hmm, wait", "B"),  # not a closing statement: the box
        ("The answer is (C).\n\\boxed{B}", "B"),
        ("\\boxed{B}\nC", "B"),  # a bare letter line does not outrank a box
        ("So we pick\n$\\text{(C)}$", "C"),
        ("Answer: \\textbf{(C)}", "C"),
        ("Answer: \\mathrm{C}.", "C"),
        (r"\boxed{\mathrm{(C)}}", "C"),
    ],
)
def test_extract_choice_statements_and_wrappers(text, expected):
    assert extract_choice(text, "ABCD") == expected


@pytest.mark.parametrize(
    "text, letter",
    [
        ("C", "C"),
        ("(C)", "C"),
        (r"\text{C}", "C"),
        (r"\textbf{C}", "C"),
        (r"\mathrm{C}", "C"),
        (r"\text{(C)}", "C"),
        (r"\textbf{(C)}", "C"),
        (r"(\mathrm{C})", "C"),
        (r"$\textbf{ (C) }$", "C"),
        ("c", None),  # lower case is a variable, not an option
        ("CD", None),
        (r"\text{C} + \text{D}", None),
        (r"\text{(C)}, \text{(D)}", None),
        (r"(C)\cup(D)", None),
        (r"\textbf{(C)}\ 24", None),  # an option and its value: math_equivalence reads those
        ("(" * 40 + "C" + ")" * 40, None),  # too long to be a wrapped letter
    ],
)
def test_option_letter(text, letter):
    assert option_letter(text) == letter


def test_strip_option_wrappers_keeps_the_case():
    assert strip_option_wrappers(r" \text{(c)} ") == "c"


def test_choice_needs_a_closed_last_box_and_an_answer_at_the_end():
    assert extract_choice("Answer: A\nWait, maybe \\boxed{B", "ABCD") is None
    assert extract_choice("So the answer is A. Hmm, but wait, let me", "ABCD") is None
    assert extract_choice("Answer: A\nHmm, let me reconsider this", "ABCD") is None
    assert extract_choice("The answer is (B). I hope it is correct.", "ABCD") == "B"


def test_box_spans_and_blank_arguments():
    text = r"\boxed{ }, \fbox{x^{2}}, \boxed{"
    spans = box_spans(text)
    assert spans[2] is None and text[spans[1][0] : spans[1][1]] == "x^{2}"
    assert is_blank(text, spans[0]) and not is_blank(text, spans[1])


# Each takes O(n^2) or worse with a scan per box or backtracking regexes (minutes at this size: 250k characters).
ADVERSARIAL = [
    "\\boxed{" * 37_500,
    "\\boxed{" * 17_500 + "}" * 17_500,
    "answer" + " " * 250_000,
    "Answer:" + " " * 250_000 + "x",
    "the answer is" + " " * 250_000 + "A",
    "final answer is 5" + ", " * 125_000 + "x",
    "answer " * 37_500,
    "\\boxed " * 37_500,
    "{" * 250_000,
    # several boxes: a long segment, distinct boxes, gaps whose joiner scan fails late
    "\\boxed{1}, " * 37_500,
    "".join(f"\\boxed{{{i}}} and " for i in range(25_000)),
    "\\boxed{1} \\text{" + " " * 250_000 + "\\boxed{2}",
    "\\boxed{1} x" + " " * 250_000 + "\\boxed{2}",
    "\\boxed{1} x_{" + "a" * 250_000 + "\\boxed{2}",
    "\\boxed{1}" + " and" * 62_500 + "\\boxed{2}",
    # statements: escaped dollars, LaTeX spaces, wrappers
    "The final answer is $" + "\\$" * 125_000,
    "Answer: " + "1,\\! " * 50_000,
    "\\boxed{1}\n" + "\\text{" * 37_500,
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(ADVERSARIAL)))
def test_extraction_is_linear_on_adversarial_text(index):
    text = ADVERSARIAL[index]
    start = time.monotonic()
    final_math_answer(text)
    extract_choice(text, "ABCDEFGHIJ")
    box_spans(text)
    assert time.monotonic() - start < 10.0  # ~0.3 s here; the quadratic versions take many minutes at 250k characters
