import math

import pytest

from armor_megatron.megatron.stability import StabilityGuard


def test_non_finite_loss_or_grad_norm_is_skipped_and_counted():
    guard = StabilityGuard(10.0)
    assert guard.check(float("nan"), 1.0) == "non-finite loss nan"
    assert guard.check(0.5, float("inf")) == "non-finite grad norm inf"
    assert guard.check(0.5, 1.0) is None
    assert guard.skipped_total == 2 and list(guard.history) == [1.0]


def test_spike_rule_uses_the_median_of_accepted_steps_once_warm():
    guard = StabilityGuard(3.0, window=4, min_history=3)
    # fewer than 3 accepted steps: only finiteness is checked, even for a large norm
    assert guard.check(0.1, 1.0) is None and guard.check(0.1, 100.0) is None
    assert guard.threshold() is None
    assert guard.check(0.1, 2.0) is None
    # history [1, 100, 2]: median 2, limit 3·2 = 6
    assert guard.threshold() == 6.0
    assert guard.check(0.1, 6.0) is None  # equal to the limit passes; history [1, 100, 2, 6]
    # median of [1, 2, 6, 100] = 4 -> limit 12; a spike of 13 is skipped and not recorded
    assert guard.check(0.1, 13.0) == "grad norm 13 > 3 x running median 4"
    assert list(guard.history) == [1.0, 100.0, 2.0, 6.0] and guard.skipped_total == 1
    # the window keeps the last 4 accepted norms: [100, 2, 6, 5] -> median 5.5
    assert guard.check(0.1, 5.0) is None and guard.threshold() == 16.5


def test_state_round_trip_and_bad_config():
    guard = StabilityGuard(2.0, window=3, min_history=1)
    for norm in (1.0, 2.0, 3.0, 4.0):
        guard.check(0.0, norm)
    guard.check(math.nan, 1.0)
    other = StabilityGuard(2.0, window=3, min_history=1)
    other.load_state_dict(guard.state_dict())
    assert list(other.history) == [2.0, 3.0, 4.0] and other.skipped_total == 1
    with pytest.raises(ValueError, match="max_ratio must be > 1"):
        StabilityGuard(1.0)
    with pytest.raises(ValueError, match="min_history <= window"):
        StabilityGuard(2.0, window=2, min_history=3)
