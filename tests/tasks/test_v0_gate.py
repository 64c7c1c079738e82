"""The V0 gate's arithmetic on scored samples, by hand."""

import math

import pytest

from armor_megatron.tasks.v0_gate import V0Result, v0_statistics


def _mode(response: str) -> str:
    return response[0]  # "C..." copy, "W..." worked, anything else other


def test_statistics_by_hand():
    # 3 prompts × 4 samples: 2 of 12 samples copy (s = 1/6), 9 worked of which 6 right (a_G = 2/3),
    # forced copies right 8 of 12 (a_S = 2/3). Anchors = each prompt's first right sample:
    # prompt 0 -> C (the copy comes first), prompt 1 -> W, prompt 2 -> none.
    samples = [
        [("C1", 1.0), ("W1", 1.0), ("W2", 0.0), ("W3", 1.0)],
        [("W4", 0.0), ("W5", 1.0), ("C2", 0.0), ("W6", 1.0)],
        [("W7", 0.0), ("x", 0.0), ("W8", 0.0), ("W9", 1.0)],
    ]
    samples[2][3] = ("W9", 0.0)  # prompt 2 gets no anchor; W right: W1 W3 W5 W6 = 4 of 9
    forced = [[("C", 1.0)] * 3 + [("C", 0.0)], [("C", 1.0)] * 2 + [("C", 0.0)] * 2, [("C", 1.0)] * 3 + [("C", 0.0)]]
    r = v0_statistics(samples, forced, _mode, shortcut="C", general="W")
    s, a_s, a_g = 2 / 12, 8 / 12, 4 / 9
    assert (r.prompts, r.samples_per_prompt) == (3, 4)
    assert r.short_share == pytest.approx(s) and r.short_forced_acc == pytest.approx(a_s)
    assert r.general_acc == pytest.approx(a_g) and r.general_share == pytest.approx(9 / 12)
    assert r.advantage == pytest.approx(a_s - a_g)
    assert r.anchor_short_predicted == pytest.approx(s * a_s / (s * a_s + (1 - s) * a_g))
    assert r.anchor_short_measured == 0.5 and r.anchor_found == pytest.approx(2 / 3)
    # s = 0.167 > 0.10 and a_G = 0.444 < 0.5 and the predicted anchor share 0.231 > 0.15: three failures
    assert not r.passed and len(r.failures) == 3 and "FAIL" in r.line()


def test_a_reference_that_fits_the_design_passes():
    r = V0Result(
        prompts=512,
        samples_per_prompt=4,
        short_share=0.05,
        short_forced_acc=0.8,
        general_share=0.95,
        general_acc=0.6,
        anchor_short_predicted=0.05 * 0.8 / (0.05 * 0.8 + 0.95 * 0.6),
        anchor_short_measured=0.06,
        anchor_found=0.9,
    )
    assert r.passed and r.line().endswith("PASS")
    # the same reference whose shortcut does not pay on training rows fails (no reason for it to spread)
    weak = V0Result(**{**r.__dict__, "short_forced_acc": 0.5})
    assert weak.failures == ["the shortcut does not pay on training rows (Δ = -0.100)"]


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="same prompts"):
        v0_statistics([[("W", 1.0)]], [], _mode, shortcut="C", general="W")
    r = v0_statistics([[("x", 0.0)]], [[("C", 0.0)]], _mode, shortcut="C", general="W")
    assert math.isnan(r.general_acc) and math.isnan(r.anchor_short_measured) and not r.passed
