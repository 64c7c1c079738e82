import pytest

from armor_megatron.rewards import VerifierSpecError, weighted_verifier


def test_weighted_sum_and_namespaced_breakdown():
    verify = weighted_verifier({"math": 0.9, "format": 0.1})
    # correct answer, but two boxes: math (last box) = 1, format (exactly one box) = 0
    result = verify(r"\boxed{2} no, \boxed{3}", "3")
    assert result.score == pytest.approx(0.9)
    assert result.breakdown == {
        "math": 1.0,
        "math/answer_found": 1.0,
        "math/correct": 1.0,
        "math/timed_out": 0.0,
        "format": 0.0,
        "format/boxed": 0.0,
    }
    assert result.extracted == "3"
    assert verify(r"\boxed{3}", "3").score == pytest.approx(1.0)


def test_user_verifier_and_negative_weight():
    verify = weighted_verifier({"tests.rewards.user_verifiers:exact_match": 1.0, "format": -0.5})
    # exact_match("7", 7) = 1; format has no box -> 0; then the penalty applies to the boxed one
    assert verify("7", 7).score == 1.0
    assert verify(r"\boxed{7}", 7).score == pytest.approx(-0.5)


@pytest.mark.parametrize(
    "weights, error, match",
    [
        ({}, ValueError, "at least one verifier"),
        ({"math": float("nan")}, ValueError, "weight of verifier 'math' must be a finite number"),
        ({"math": "1"}, ValueError, "weight of verifier 'math'"),
        ({"mathh": 1.0}, VerifierSpecError, "did you mean 'math'"),
    ],
)
def test_bad_weights(weights, error, match):
    with pytest.raises(error, match=match):
        weighted_verifier(weights)


def test_parts_of_a_weighted_verifier_get_the_row_fields_they_name():
    combined = weighted_verifier({"tests.rewards.row_verifiers:compute_score": 0.5, "format": 0.5})
    fields = {"data_source": "openai/gsm8k", "extra_info": {"split": "test"}, "prompt": "q"}
    assert (
        combined("#### 7 \\boxed{7}", "7", data_source=fields["data_source"], extra_info=fields["extra_info"]).score
        == 1.0
    )
    with pytest.raises(ValueError, match="scores several at once"):
        weighted_verifier({"tests.rewards.row_verifiers:ranks": 1.0})
