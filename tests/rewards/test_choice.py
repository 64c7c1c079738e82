import pytest

from armor_megatron.rewards import get_verifier, make_choice_verifier


@pytest.mark.parametrize(
    "response, gold, score",
    [
        ("... so the answer is (C).", "C", 1.0),
        ("Answer: C", "(C)", 1.0),  # gold written with parentheses
        ("Answer: C", " c ", 1.0),  # lower-case gold with spaces
        ("Answer: C\nvalue: \\boxed{42}", "C", 0.0),  # the box is the final answer, and not a letter
        (r"\boxed{B}", 1, 1.0),  # 0-based index, MMLU-Pro answer_index
        ("Answer: J", 9, 1.0),
        ("Answer: B", "C", 0.0),
        ("I cannot decide.", "C", 0.0),
        (r"$\boxed{\textbf{(B)}\ 12}$", "B", 1.0),  # AMC: the option, a LaTeX space, its value
        (r"\boxed{\text{(B)}~12}", "B", 1.0),
        (r"<think>It is \boxed{A}... or is it</think>\boxed{B}", "B", 1.0),  # after the reasoning
        (r"<think>It is \boxed{B}, but let me check the other opt", "B", 0.0),  # cut off while thinking
        # golds in LaTeX wrappers match the letter in any wrapper, and no other letter
        (r"\boxed{\text{(C)}}", r"\text{C}", 1.0),
        ("The answer is (C).", r"\textbf{C}", 1.0),
        ("C", r"\mathrm{C}", 1.0),
        (r"\boxed{\mathrm{C}}", r"\textbf{(C)}", 1.0),
        (r"\boxed{\text{(D)}}", r"\text{C}", 0.0),
        ("The answer is (D).", r"\textbf{C}", 0.0),
        ("D", r"\mathrm{C}", 0.0),
        # the last stated answer wins over an earlier box
        ("\\boxed{B}\nOn reflection, the answer is (C).", "C", 1.0),
        ("\\boxed{B}\nOn reflection, the answer is (C).", "B", 0.0),
    ],
)
def test_multiple_choice(response, gold, score):
    result = get_verifier("multiple_choice")(response, gold)
    assert result.score == score
    assert result.breakdown["correct"] == score


def test_breakdown_and_extracted():
    result = get_verifier("multiple_choice")("Answer: B", "C")
    assert result.breakdown == {"answer_found": 1.0, "correct": 0.0}
    assert result.extracted == "B"
    none = get_verifier("multiple_choice")("hmm", "C")
    assert none.breakdown == {"answer_found": 0.0, "correct": 0.0} and none.extracted is None


def test_gpqa_four_options():
    verify = make_choice_verifier(num_options=4)
    assert verify("Answer: D", "D").score == 1.0
    with pytest.raises(ValueError, match="not one of the option letters A-D"):
        verify("Answer: D", "E")


@pytest.mark.parametrize(
    "gold, match",
    [
        ("K", "option letters A-J"),
        ("CD", "option letters"),
        (r"\text{K}", "option letters A-J"),
        (r"\text{C} + 1", "option letters"),
        (10, "outside 0..9"),
        (None, "None"),
    ],
)
def test_bad_gold_is_one_clear_error(gold, match):
    with pytest.raises(ValueError, match=match):
        get_verifier("multiple_choice")("Answer: C", gold)


def test_bad_option_count():
    with pytest.raises(ValueError, match="num_options must be in"):
        make_choice_verifier(num_options=1)
