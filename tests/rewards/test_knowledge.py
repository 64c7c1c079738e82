import pytest

from armor_megatron.rewards import compute_score
from armor_megatron.rewards.knowledge import gold_aliases, knowledge_answer, normalize_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Beatles!", "beatles"),
        ("Pelé", "pele"),
        ("  New_York   City. ", "new york city"),
        ("an Apple a day", "apple day"),
        ("Theodore", "theodore"),  # "the" only as a word
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


TRIVIA = {"value": "Mount Everest", "aliases": ["Everest", "Chomolungma", "Sagarmatha"]}


@pytest.mark.parametrize(
    "response, gold, score",
    [
        ("Paris", "Paris", 1.0),
        ("paris.", "Paris", 1.0),
        (r"The answer is \boxed{\text{Paris}}", "Paris", 1.0),
        ("Let me think.\nAnswer: the Everest", TRIVIA, 1.0),
        ("Sagarmatha", TRIVIA, 1.0),
        ("<think>K2? No.</think>Mount Everest", TRIVIA, 1.0),
        ("K2", TRIVIA, 0.0),
        ("Lyon", ["Paris", "Paris, France"], 0.0),
        ("Paris, France", ["Paris", "Paris, France"], 1.0),
        # a long explanation containing the right words is not a short answer
        ("Many people think of Lyon but the real capital, as every atlas shows, is Paris", "Paris", 0.0),
        (r"\boxed{Paris", "Paris", 0.0),  # cut off inside the box
        ("everest", {"normalized_aliases": ["everest"]}, 1.0),
    ],
)
def test_exact_match_with_aliases(response, gold, score):
    result = compute_score(response, gold, "knowledge")
    assert result.score == score
    assert result.breakdown["correct"] == score


def test_answer_found_and_bad_ground_truth():
    assert knowledge_answer("word " * 30) is None
    assert compute_score("word " * 30, "x", "knowledge").breakdown == {"answer_found": 0.0, "correct": 0.0}
    assert gold_aliases(TRIVIA) == ["Mount Everest", "Everest", "Chomolungma", "Sagarmatha"]
    with pytest.raises(ValueError, match="knowledge ground truth has no non-empty answer"):
        compute_score("Paris", "  ", "knowledge")
