import pytest

from armor_megatron.algo.reset import (
    EveryTau,
    Never,
    OnValidationBest,
    ResetSchedule,
    TwoStage,
    ValidationHook,
    build_reset_schedule,
)


def reset_on_even_steps(step, metrics):
    """A user hook loaded by its 'module:function' path."""
    return step % 2 == 0


def _resets(schedule, steps=10):
    return [s for s in range(1, steps + 1) if schedule.should_reset(s)]


def test_every_tau():
    assert _resets(EveryTau(3)) == [3, 6, 9]
    assert _resets(EveryTau(1), 3) == [1, 2, 3]
    assert _resets(build_reset_schedule("every", tau=160), 500) == [160, 320, 480]


def test_two_stage_resets_then_freezes():
    # paper (8B): τ = 1 for the first 180 steps, then a frozen reference
    assert _resets(TwoStage(first_stage_steps=4)) == [1, 2, 3, 4]
    assert _resets(TwoStage(first_stage_steps=6, tau=2)) == [2, 4, 6]
    assert _resets(build_reset_schedule("two_stage", first_stage_steps=180), 400) == list(range(1, 181))


def test_never():
    assert _resets(Never(), 1000) == [] and isinstance(build_reset_schedule("never"), ResetSchedule)


def test_validation_hook_callable_and_path():
    assert _resets(ValidationHook(lambda step, m: bool(m and m["val/acc"] > 0.5)), 3) == []
    assert ValidationHook(lambda step, m: m["val/acc"] > 0.5).should_reset(7, {"val/acc": 0.6})
    hook = build_reset_schedule("validation_hook", hook=f"{__name__}:reset_on_even_steps")
    assert _resets(hook, 5) == [2, 4]
    with pytest.raises(ValueError, match="cannot load 'no_such_module_xyz:f'"):
        ValidationHook("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="expected 'module:function'"):
        ValidationHook("just_a_name")


def test_reset_on_new_validation_best_and_its_state():
    schedule = OnValidationBest("val/acc", min_delta=0.01)
    seen = [
        schedule.should_reset(step, metrics)
        for step, metrics in [
            (1, {"train/loss": 1.0}),  # no validation this step
            (2, {"val/acc": 0.30}),  # first value is a best
            (3, {"val/acc": 0.305}),  # not better by more than 0.01
            (4, {"val/acc": 0.40}),  # new best
            (5, {"val/acc": 0.35}),
        ]
    ]
    assert seen == [False, True, False, True, False]
    restored = OnValidationBest("val/acc")
    restored.load_state_dict(schedule.state_dict())
    assert not restored.should_reset(6, {"val/acc": 0.39}) and restored.should_reset(7, {"val/acc": 0.41})
    lower_is_better = OnValidationBest("val/loss", mode="min")
    assert [lower_is_better.should_reset(s, {"val/loss": v}) for s, v in [(1, 2.0), (2, 2.5), (3, 1.5)]] == [
        True,
        False,
        True,
    ]


def test_bad_schedules_raise():
    with pytest.raises(ValueError, match="tau must be >= 1"):
        EveryTau(0)
    with pytest.raises(ValueError, match="two-stage"):
        TwoStage(-1)
    with pytest.raises(ValueError, match="mode"):
        OnValidationBest("val/acc", mode="best")
    with pytest.raises(ValueError, match="unknown reset schedule 'sometimes'"):
        build_reset_schedule("sometimes")
    with pytest.raises(ValueError, match="reset schedule 'every'"):
        build_reset_schedule("every", period=3)
    with pytest.raises(ValueError, match="count completed steps from 1"):
        EveryTau(2).should_reset(0)


def test_the_evaluation_before_training_is_the_first_best():
    schedule = OnValidationBest("val/acc")
    schedule.observe_start({"val/acc": 0.40})
    assert not schedule.should_reset(5, {"val/acc": 0.30})  # worse than the initial reference
    assert schedule.should_reset(10, {"val/acc": 0.45})
    schedule.observe_start({"val/acc": 0.0})  # only ever the start: a later call changes nothing
    assert schedule.best == 0.45


@pytest.mark.parametrize("mode, values", [("max", [0.5, 0.5, 0.75]), ("min", [2.0, 2.0, 1.75])])
def test_a_tie_with_the_best_is_no_new_best(mode, values):
    """Equal evaluations (common: accuracy over a few prompts) must not reset π_ref again and again."""
    schedule = OnValidationBest("val/m", mode=mode)
    assert [schedule.should_reset(s, {"val/m": v}) for s, v in zip((2, 4, 6), values)] == [True, False, True]
    by_delta = OnValidationBest("val/m", mode=mode, min_delta=0.25)
    by_delta.observe_start({"val/m": values[0]})
    assert not by_delta.should_reset(2, {"val/m": values[2]})  # better by exactly min_delta: not more
