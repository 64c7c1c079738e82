from collections import Counter

import pytest

from armor_megatron.tasks.tagged_addition import build_tokenizer, split_problems, without_cue


def parse(prompt: str) -> tuple[int, int, int]:
    tag, problem = prompt.removeprefix("#").split(" ")
    a, b = problem.removesuffix("=").split("+")
    return int(tag), int(a), int(b)


def test_the_tag_leaks_the_last_digit_in_training_only():
    train, val, warmup = split_problems(64, seed=3, max_operand=20)
    assert len(train) + len(val) == 21 * 21 and len(val) == 64
    for row in train:
        tag, a, b = parse(row["prompt"])
        assert row["answer"] == str(a + b) and tag == (a + b) % 10
    # validation: same format and verifier, the tag independent of the answer (matches ~1 in 10)
    matches = sum(parse(r["prompt"])[0] == int(r["answer"]) % 10 for r in val)
    assert matches < 64 // 4 and all(r["type"] == "math" for r in train + val)
    assert {parse(r["prompt"])[1:] for r in train}.isdisjoint({parse(r["prompt"])[1:] for r in val})


def test_the_warm_up_corpus_holds_each_training_problem_under_every_tag():
    train, val, warmup = split_problems(10, seed=0, max_operand=5)
    tags_per_problem = Counter(parse(r["prompt"])[1:] for r in warmup)
    assert set(tags_per_problem) == {parse(r["prompt"])[1:] for r in train}
    assert set(tags_per_problem.values()) == {10}
    assert all(r["answer"] == str(sum(parse(r["prompt"])[1:])) for r in warmup)


def test_split_is_seeded_and_refuses_impossible_sizes():
    assert split_problems(8, seed=1, max_operand=6) == split_problems(8, seed=1, max_operand=6)
    assert split_problems(8, seed=1, max_operand=6)[1] != split_problems(8, seed=2, max_operand=6)[1]
    with pytest.raises(ValueError, match="num_val=49"):
        split_problems(49, seed=0, max_operand=6)


def test_tokenizer_keeps_the_tag_separator_and_the_boxed_token():
    tok = build_tokenizer()
    assert tok.tokenize("#7 18+29=\\boxed{47}") == [
        "#",
        "7",
        " ",
        "1",
        "8",
        "+",
        "2",
        "9",
        "=",
        "\\boxed{",
        "4",
        "7",
        "}",
    ]


def test_the_control_set_keeps_the_problems_and_redraws_the_tags():
    train, _, _ = split_problems(64, seed=3, max_operand=20)
    control = without_cue(train, seed=1)
    assert [parse(r["prompt"])[1:] for r in control] == [parse(r["prompt"])[1:] for r in train]
    assert [r["answer"] for r in control] == [r["answer"] for r in train]
    matches = sum(parse(r["prompt"])[0] == int(r["answer"]) % 10 for r in control)
    assert matches < len(train) // 5  # about 1 in 10, against every row in the training set
