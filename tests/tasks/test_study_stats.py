import math

import pytest

from armor_megatron.tasks.study_stats import pooled_se, variant_curves, verdict


def run(vals: dict[int, float], train: dict[int, float], resets=()) -> list[dict]:
    """Step records: validation at ``vals``' steps, on-policy accuracy at ``train``'s."""
    steps = sorted(set(vals) | set(train))
    return [
        {
            "step": s,
            **({"eval/mean/pass@1": vals[s]} if s in vals else {}),
            **({"rollout/on_policy_accuracy": train[s]} if s in train else {}),
            **({"reference/reset": 1.0} if s in resets else {}),
        }
        for s in steps
    ]


def test_curves_average_seeds_at_common_evaluation_steps():
    a = run({0: 0.5, 2: 0.7, 4: 0.4}, {1: 0.2, 2: 0.4, 3: 0.6, 4: 0.8}, resets=(2,))
    b = run({0: 0.5, 2: 0.5, 4: 0.2, 6: 0.9}, {1: 0.0, 2: 0.2, 3: 0.4, 4: 0.6})
    c = variant_curves("dapo", [a, b])
    assert c.steps == [0, 2, 4]  # step 6 was evaluated by one seed only
    assert c.val_mean == pytest.approx([0.5, 0.6, 0.3])
    assert c.val_sd == pytest.approx([0.0, math.sqrt(0.02), math.sqrt(0.02)])
    # training reward: per seed the mean since the previous evaluation, then over seeds; none at step 0
    assert math.isnan(c.train_mean[0])
    assert c.train_mean[1:] == pytest.approx([(0.3 + 0.1) / 2, (0.7 + 0.5) / 2])
    assert (c.start, c.peak, c.peak_step, c.end) == pytest.approx((0.5, 0.6, 2, 0.3))
    assert c.resets == [2]
    assert variant_curves("recovery", [a], step_offset=400).steps == [400, 402, 404]


def test_peak_takes_the_earliest_of_equal_points_and_one_seed_has_no_spread():
    c = variant_curves("x", [run({0: 0.3, 5: 0.6, 10: 0.6}, {})])
    assert c.peak_step == 5 and math.isnan(c.end_sd)


def test_verdict_uses_pooled_standard_errors():
    # 2 seeds, sd √0.0008 ≈ 0.028 everywhere: DAPO peak 0.5 at step 0, end 0.3; ARMOR end 0.4
    dapo = variant_curves("dapo", [run({0: 0.52, 9: 0.32}, {}), run({0: 0.48, 9: 0.28}, {})])
    armor = variant_curves("armor", [run({0: 0.52, 9: 0.42}, {}), run({0: 0.48, 9: 0.38}, {})])
    v = verdict(dapo, armor)
    se = pooled_se(math.sqrt(0.0008), math.sqrt(0.0008), 2)
    assert se == pytest.approx(math.sqrt(0.0008))
    assert (v.dapo_drop, v.dapo_drop_se) == pytest.approx((0.2, se))
    assert (v.armor_gain, v.armor_gain_se) == pytest.approx((0.1, se))
    assert v.overoptimisation_seen and v.armor_beats_dapo  # 0.2 and 0.1 both ≥ 2 · 0.028
    weaker = variant_curves("armor", [run({0: 0.5, 9: 0.33}, {}), run({0: 0.5, 9: 0.29}, {})])
    assert not verdict(dapo, weaker).armor_beats_dapo  # a gain of 0.01 is inside 2 SE (0.057)


def test_one_seed_gives_no_verdict():
    one = variant_curves("dapo", [run({0: 0.9, 9: 0.1}, {})])
    assert not verdict(one, one).overoptimisation_seen


def test_curves_need_runs_and_a_common_evaluation():
    with pytest.raises(ValueError, match="no runs"):
        variant_curves("x", [])
    with pytest.raises(ValueError, match="no evaluation step is common"):
        variant_curves("x", [run({0: 0.1}, {}), run({5: 0.1}, {})])
