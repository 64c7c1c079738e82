import pytest

from armor_megatron.rewards import get_verifier, make_format_verifier


@pytest.mark.parametrize(
    "response, score",
    [
        (r"work \boxed{3}", 1.0),
        ("no box", 0.0),
        (r"\boxed{3} or \boxed{4}", 0.0),  # exactly one
        (r"\boxed{}", 0.0),  # empty
        (r"\boxed{3", 0.0),  # unterminated
    ],
)
def test_exactly_one_box(response, score):
    result = get_verifier("format")(response, None)
    assert result.score == score and result.breakdown == {"boxed": score}


def test_at_least_one_box():
    verify = make_format_verifier(boxed="at_least_one")
    assert verify(r"\boxed{3} or \boxed{4}", None).score == 1.0
    assert verify(r"\boxed{3} or \boxed{", None).score == 0.0


@pytest.mark.parametrize(
    "response, think, boxed",
    [
        ("<think>reasoning</think> so \\boxed{1}", 1.0, 1.0),
        ("reasoning</think> \\boxed{1}", 1.0, 1.0),  # opening tag was in the prompt
        ("<think>reasoning \\boxed{1}</think> done", 1.0, 0.0),  # the box must follow the reasoning
        ("<think>a</think><think>b</think>\\boxed{1}", 0.0, 1.0),  # two blocks
        ("<think></think>\\boxed{1}", 0.0, 1.0),  # empty reasoning
        ("text <think>a</think>\\boxed{1}", 0.0, 1.0),  # text before the opening tag
        ("<think>reasoning</think>", 0.0, 0.0),  # nothing after
        ("\\boxed{1}", 0.0, 1.0),  # no tags
    ],
)
def test_think_then_boxed(response, think, boxed):
    result = get_verifier("think_format")(response, None)
    assert result.breakdown == {"think": think, "boxed": boxed}
    assert result.score == float(think == boxed == 1.0)


def test_think_only_and_custom_tags():
    verify = make_format_verifier(boxed=None, think=True, think_open="<reason>", think_close="</reason>")
    result = verify("<reason>x</reason> 42", None)
    assert result.score == 1.0 and result.breakdown == {"think": 1.0}


@pytest.mark.parametrize(
    "kwargs, match", [({"boxed": "two"}, "boxed must be one of"), ({"boxed": None}, "no rule enabled")]
)
def test_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_format_verifier(**kwargs)
