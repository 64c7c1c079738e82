"""The pre-registered analysis on hand-made metric records: endpoint, checks and verdicts."""

import pytest

from armor_megatron.tasks.overopt_checks import decide, mean_curve, summarize_run, validity_checks


def _run(vals, d_share=0.8, acc_w=(0.5, 0.5), found=0.6, anchor_w=0.9):
    """Records of a 200-step run evaluated every 20 steps; ``vals`` are the 11 validation accuracies."""
    steps = list(range(0, 201, 20))
    records = []
    for step, v in zip(steps, vals):
        records.append(
            {
                "step": step,
                "eval/mean/pass@1": v,
                "eval/worked-val/pass@1": v,
                "eval/worked-val/d_share": 0.1 if step == 0 else d_share,
                "eval/worked-val/acc_w": acc_w[0] if step == 0 else acc_w[1],
                "anchor/found_rate": found,
                "rollout/anchor_w_share": anchor_w,
                "rollout/d_share": d_share,
            }
        )
    return summarize_run(records)


RISE_FALL = [0.40, 0.45, 0.50, 0.52, 0.50, 0.45, 0.40, 0.36, 0.34, 0.32, 0.30]
FLAT = [0.40, 0.41, 0.42, 0.42, 0.41, 0.42, 0.42, 0.41, 0.42, 0.42, 0.41]


def test_endpoint_is_the_mean_over_the_last_40_steps():
    r = _run(RISE_FALL)
    assert r.endpoint == pytest.approx((0.32 + 0.30) / 2)  # evaluations at 180 and 200 (> 160)
    assert r.final_d_share == pytest.approx(0.8) and r.acc_w_start == 0.5
    c = mean_curve([r, _run([v + 0.02 for v in RISE_FALL])])
    assert (c.peak_step, c.peak) == (60, pytest.approx(0.53))


def test_all_checks_hold_on_a_rise_then_collapse_with_a_flat_control():
    dapo = [_run([v + 0.01 * i for v in RISE_FALL]) for i in range(3)]
    checks = validity_checks(dapo, [_run(FLAT)] * 3, [_run(FLAT)] * 3)
    assert [c.name for c in checks] == ["M1", "M2", "M3", "M4", "M5"]
    assert all(c.passed for c in checks), [c.detail for c in checks]


@pytest.mark.parametrize(
    ("dapo_kw", "control", "armor_kw", "failing"),
    [
        ({"vals": [0.6] + RISE_FALL[1:]}, FLAT, {}, "M1"),  # peak at step 0
        ({"vals": RISE_FALL, "d_share": 0.5}, FLAT, {}, "M3"),  # the collapse is not onto D
        ({"vals": RISE_FALL}, RISE_FALL, {}, "M3"),  # the control falls too
        ({"vals": RISE_FALL}, FLAT, {"anchor_w": 0.5}, "M4"),
        ({"vals": RISE_FALL, "acc_w": (0.5, 0.4)}, FLAT, {}, "M5"),
    ],
)
def test_each_check_fails_on_its_own_defect(dapo_kw, control, armor_kw, failing):
    checks = validity_checks([_run(**dapo_kw)] * 2, [_run(control)] * 2, [_run(FLAT, **armor_kw)] * 2)
    assert [c.name for c in checks if not c.passed] == [failing]


def test_verdicts():
    dapo = [_run([v + 0.01 * i for v in RISE_FALL]) for i in range(4)]
    control = [_run(FLAT)] * 4
    better = [_run(RISE_FALL[:8] + [0.44 + 0.01 * i, 0.45, 0.46 + 0.005 * i]) for i in range(4)]
    same = [_run([v + 0.01 * i + 0.001 * (-1) ** i for v in RISE_FALL]) for i in range(4)]
    assert decide(dapo, better, control).verdict == "ARMOR mitigates"
    assert decide(dapo, same, control).verdict == "null"
    noisy = [_run(RISE_FALL[:9] + [v, v]) for v in (0.20, 0.45, 0.25, 0.48)]
    assert decide(dapo, noisy, control).verdict == "inconclusive"
    assert decide([_run([0.6] + RISE_FALL[1:])] * 4, better, control).verdict == "no claim"
