"""The noisy-cue task: its modes, where the tag is right, the dormant design's order, the mode metrics."""

import random

import pytest

from armor_megatron.rewards import score_batch
from armor_megatron.tasks import noisy_cue as nc


def _tag(row):
    return int(row["prompt"][1:].split(" ")[0]) if row["prompt"].startswith("#") else None


def test_the_copy_mode_is_right_exactly_when_the_tag_is_and_the_classifier_tells_the_modes_apart():
    responses = [nc.copy(47), nc.copy(46), nc.worked(18, 29), "\\boxed{47}", "47"]
    assert [r.score for r in score_batch(responses, ["47"] * 5, verifier="math")] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert [nc.mode(r) for r in responses] == ["C", "C", "W", "D", "other"]
    tok = nc.build_tokenizer()
    for text in (nc.copy(47), "#47 18+29=", "18+29="):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids and tok.decode(ids) == text


def test_rare_cue_rows_warm_up_and_validation():
    train, val, warm = nc.split_problems(256, seed=3, q=0.85, copy_prob=0.03, warm_right=0.5)
    assert len(train) == 31 * 31 - 256 and len(val) == 256 and len(warm) == len(train) * 9
    right = sum(_tag(r) == int(r["answer"]) for r in train) / len(train)
    assert 0.8 < right < 0.9  # q, the rest near misses
    assert all(abs(_tag(r) - int(r["answer"])) in (1, 10) for r in train if _tag(r) != int(r["answer"]))
    assert all(abs(_tag(r) - int(r["answer"])) in (1, 10) for r in val)  # validation: near misses only
    assert not {r["prompt"].split(" ")[1] for r in val} & {r["prompt"].split(" ")[1] for r in train}
    modes = [nc.mode(r["response"]) for r in warm]
    tagged = [r for r in warm if r["prompt"].startswith("#")]
    assert 0.02 < modes.count("C") / len(tagged) < 0.04 and set(modes) == {"W", "C"}
    assert all(_tag(r) == int(r["answer"]) for r in warm if nc.mode(r["response"]) == "C")  # copy rows: right tags
    w_tagged = [r for r in tagged if nc.mode(r["response"]) == "W"]
    assert 0.45 < sum(_tag(r) == int(r["answer"]) for r in w_tagged) / len(w_tagged) < 0.55
    assert sum(not r["prompt"].startswith("#") for r in warm) == len(train)  # one tagless worked row per pair
    assert [r["prompt"] for r in nc.tagless_rows(val[:2])] == [r["prompt"].split(" ")[1] for r in val[:2]]


def test_rl_pairs_are_kept_out_of_the_warm_up():
    train, val, warm = nc.split_problems(256, seed=3, max_operand=49, rl_pairs=768)
    assert len(train) == 768 and len(val) == 256 and len(warm) == (50 * 50 - 256 - 768) * 9

    def problems(rows):
        return {r["prompt"].split(" ")[-1] for r in rows}

    assert not problems(train) & problems(warm) and not problems(val) & problems(warm)
    warm = nc.split_problems(256, seed=3, w_slip=0.3)[2]
    w_rows = [r for r in warm if nc.mode(r["response"]) == "W"]
    wrong = [r for r in w_rows if not r["response"].endswith(f"{{{r['answer']}}}")]
    assert 0.25 < len(wrong) / len(w_rows) < 0.35  # slips: the tens line off by one, the box with it
    assert all(abs(int(r["response"].split("{")[1][:-1]) - int(r["answer"])) == 10 for r in wrong)
    assert nc.slipped(18, 29, random.Random(0)) in ("17,3\\boxed{37}", "17,5\\boxed{57}")
    drills = nc.split_problems(256, seed=3, copy_drills=50)[2][-50:]
    assert all(r["prompt"] == f"#{r['answer']} =" and r["response"] == nc.copy(int(r["answer"])) for r in drills)
    with pytest.raises(nc.NoisyCueError, match="leave no warm-up pair"):
        nc.split_problems(256, seed=3, rl_pairs=705)


def test_dormant_rows_start_tagless_then_ramp_in_right_tags():
    train, _, _ = nc.split_problems(256, seed=3, design="dormant", q=0.9, tagless_rows=1000, ramp_rows=1000)
    assert len(train) == 6400 and all(_tag(r) is None for r in train[:1000])
    assert all(_tag(r) is not None for r in train[1000:])
    ramp = sum(_tag(r) == int(r["answer"]) for r in train[1000:2000]) / 1000
    late = sum(_tag(r) == int(r["answer"]) for r in train[2000:]) / len(train[2000:])
    assert 0.38 < ramp < 0.52 and 0.87 < late < 0.93  # the ramp's mean q/2, then q


def test_bad_options_fail_in_one_line():
    with pytest.raises(nc.NoisyCueError, match="^noisy_cue: unknown design 'later'; known: rare_cue, dormant$"):
        nc.split_problems(256, seed=0, design="later")
    with pytest.raises(ValueError, match=r"^noisy_cue: q=1.5 must be in \[0.0, 1.0\]$"):
        nc.split_problems(256, seed=0, q=1.5)


def test_mode_metrics_shares_accuracies_and_anchors():
    samples = [
        {"response": nc.copy(5), "score": 1.0},
        {"response": nc.copy(6), "score": 0.0},
        {"response": nc.worked(2, 3), "score": 1.0},
        {"response": "junk", "score": 0.0},
        {"response": nc.worked(2, 3), "score": 1.0, "is_anchor": True},
    ]
    m = nc.mode_metrics(samples)
    assert m == {
        "short_share": 0.5,
        "w_share": 0.25,
        "d_share": 0.0,
        "other_share": 0.25,
        "acc_w": 1.0,
        "acc_short": 0.5,
        "anchor_short_share": 0.0,
        "anchor_w_share": 1.0,
    }
