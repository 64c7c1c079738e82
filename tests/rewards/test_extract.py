import pytest

from armor_megatron.rewards.extract import extract_choice, find_boxed, last_answer_line, last_boxed


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
