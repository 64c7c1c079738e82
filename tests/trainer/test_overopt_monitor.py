import pytest

from armor_megatron.trainer.overopt_monitor import OverOptimizationMonitor


def test_warns_only_when_train_rises_and_val_falls():
    mon = OverOptimizationMonitor(window=3)
    assert mon.update(0.5, 0.40)[1] is None
    assert mon.update(0.6, 0.38)[1] is None  # window not full yet
    metrics, warning = mon.update(0.7, 0.35)
    assert warning and "over-optimisation" in warning
    assert metrics["overopt/train_val_gap"] == pytest.approx(0.35)
    assert metrics["overopt/train_reward_slope"] == pytest.approx(0.1)  # least squares over (0.5, 0.6, 0.7)
    assert metrics["overopt/val_acc_slope"] == pytest.approx(-0.025)  # (0.40, 0.38, 0.35)


def test_both_rising_is_healthy_and_state_round_trips():
    mon = OverOptimizationMonitor(window=2)
    mon.update(0.5, 0.3)
    assert mon.update(0.6, 0.4)[1] is None
    again = OverOptimizationMonitor(window=2)
    again.load_state_dict(mon.state_dict())
    assert again.update(0.7, 0.2)[1] is not None
    with pytest.raises(ValueError, match="window"):
        OverOptimizationMonitor(window=1)
