import time

import pytest

from armor_megatron.rewards.extract import (
    box_spans,
    extract_choice,
    final_answer_text,
    final_math_answer,
    find_boxed,
    is_blank,
    last_answer_line,
    last_boxed,
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


def test_final_math_answer_without_fallback_reads_boxes_only():
    assert final_math_answer("Answer: 3", answer_line_fallback=False) is None
    assert final_math_answer("\\boxed{3}", answer_line_fallback=False) == "3"


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


# Each takes O(n^2) or worse with a scan per box or backtracking regexes (minutes at this size).
ADVERSARIAL = [
    "\\boxed{" * 150_000,
    "\\boxed{" * 70_000 + "}" * 70_000,
    "answer" + " " * 1_000_000,
    "Answer:" + " " * 1_000_000 + "x",
    "the answer is" + " " * 1_000_000 + "A",
    "final answer is 5" + ", " * 500_000 + "x",
    "answer " * 150_000,
    "\\boxed " * 150_000,
    "{" * 1_000_000,
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", range(len(ADVERSARIAL)))
def test_extraction_is_linear_on_adversarial_text(index):
    text = ADVERSARIAL[index]
    start = time.monotonic()
    final_math_answer(text)
    extract_choice(text, "ABCDEFGHIJ")
    box_spans(text)
    assert time.monotonic() - start < 20.0  # ~1 s here; the quadratic versions take hours at 1M characters
