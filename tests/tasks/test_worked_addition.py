"""The visible-shortcut task: its two response modes, where the cue sits, and the mode metrics."""

import pytest

from armor_megatron.rewards import score_batch
from armor_megatron.tasks import worked_addition as wa


def test_worked_response_writes_units_sum_then_tens_plus_carry_then_the_box():
    assert wa.worked(18, 29) == "17,4\\boxed{47}"  # 8+9 = 17, 1+2+1 = 4
    assert wa.worked(3, 4) == "7,0\\boxed{7}"
    assert wa.worked(30, 30) == "0,6\\boxed{60}"
    assert wa.direct(18, 29) == "\\boxed{47}"
    tok = wa.build_tokenizer()
    for text in (wa.worked(18, 29), "#4 18+29="):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids and tok.decode(ids) == text


def test_both_modes_pass_the_math_verifier_and_the_mode_classifier_tells_them_apart():
    responses = [wa.worked(18, 29), wa.direct(18, 29), "17,3\\boxed{37}", "4\\boxed{47}"]
    assert [r.score for r in score_batch(responses, ["47"] * 4, verifier="math")] == [1.0, 1.0, 0.0, 1.0]
    assert [wa.mode(r) for r in responses] == ["W", "D", "W", "other"]


def test_cue_only_in_a_fraction_rho_of_training_rows_never_in_warm_up_or_validation():
    train, val, warm = wa.split_problems(256, seed=3, rho=0.5)
    assert len(train) == 31 * 31 - 256 and len(val) == 256 and len(warm) == len(train) * 7

    def tag_is_tens(row):
        return int(row["prompt"][1]) == int(row["answer"]) // 10

    cue = sum(map(tag_is_tens, train)) / len(train)
    # 0.5 carry the cue, the other rows hit it by chance (P(tag = tens) ≈ 0.2 under the tens distribution)
    assert 0.55 < cue < 0.7
    assert sum(map(tag_is_tens, val)) / len(val) < 0.35
    assert not {r["prompt"].split(" ")[1] for r in val} & {r["prompt"].split(" ")[1] for r in train}
    assert 0.8 < sum(wa.mode(r["response"]) == "W" for r in warm) / len(warm) < 0.9
    # every training pair appears under every tag in the warm-up corpus: the tag carries nothing there
    assert len({r["prompt"] for r in warm}) == len(warm)


def test_rho_changes_only_the_training_tags():
    a = wa.split_problems(256, seed=5, rho=0.0)
    b = wa.split_problems(256, seed=5, rho=1.0)
    assert a[1] == b[1] and a[2] == b[2]
    assert [r["answer"] for r in a[0]] == [r["answer"] for r in b[0]]
    assert all(int(r["prompt"][1]) == int(r["answer"]) // 10 for r in b[0])
    with pytest.raises(ValueError, match="rho=1.5"):
        wa.split_problems(256, seed=5, rho=1.5)


def test_mode_metrics_split_on_policy_samples_and_anchors():
    samples = [
        {"response": wa.worked(1, 2), "score": 1.0},
        {"response": wa.direct(1, 2), "score": 0.0},
        {"response": wa.direct(1, 2), "score": 1.0},
        {"response": "junk", "score": 0.0},
        {"response": wa.worked(1, 2), "score": 1.0, "is_anchor": True},
    ]
    m = wa.mode_metrics(samples)
    assert m == {
        "w_share": 0.25,
        "d_share": 0.5,
        "other_share": 0.25,
        "acc_w": 1.0,
        "acc_d": 0.5,
        "anchor_d_share": 0.0,
        "anchor_w_share": 1.0,
    }
    assert "acc_d" not in wa.mode_metrics(samples[:1])
