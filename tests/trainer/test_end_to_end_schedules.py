"""Trainer paths of the whole loop (``armor-train`` in a subprocess, the tiny model, TP=1) that the
main end-to-end runs do not take: a step whose groups all have equal rewards (dynamic sampling
refills in vain, the step is skipped), and the reference-reset schedules other than ``every``.

Whether θ_ref was replaced is read from ``train/approx_kl_ref``: right after a reset π_ref = π_θ, so
the next step's KL(π_θ‖π_ref) is 0; without one it has drifted away from 0."""

import pytest

from tests.trainer.test_end_to_end import _train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HOOKS = "tests.trainer.user_hooks"


def _resets(metrics):
    return sorted(step for step, m in metrics.items() if m.get("reference/reset") == 1.0)


def test_no_signal_steps_are_skipped_and_validation_best_waits_for_the_start_evaluation(tiny, tmp_path):
    metrics = _train(
        tiny,
        tmp_path,
        "parallelism.tp=1",
        f"reward.verifier={HOOKS}:never_right",
        "data.type_key=no_such_column",  # the tiny rows name "math" as their verifier: use the default
        "algorithm.dynamic_sampling.max_oversample_rounds=1",
        "reference.reset=validation_best",
        "train.steps=2",
        "eval.every_steps=1",
        "checkpoint.every_steps=0",
    )
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        m = metrics[step]
        # all groups scored 0: dynamic sampling drew 1 + max_oversample_rounds rounds, kept none
        assert m["train/skipped_no_signal"] == 1.0 and "train/loss" not in m and "train/tokens" not in m
        assert m["dynamic_sampling/rounds"] == 2.0 and m["dynamic_sampling/groups_seen"] == 16.0
        assert m["dynamic_sampling/keep_rate"] == 0.0
        assert m["anchor/found_rate"] == 0.0 and m["anchor/dropped"] == 0.0
    # pass@1 is 0 at steps 0, 1 and 2: never better than the evaluation before training, which the
    # schedule saw (observe_start); without it step 1's first evaluation would count as a new best
    assert [metrics[s]["eval/mean/pass@1"] for s in (0, 1, 2)] == [0.0, 0.0, 0.0]
    assert _resets(metrics) == []


@pytest.mark.parametrize(
    "schedule, resets",
    [
        # τ = 1 for stage one (steps 1..1), then frozen
        (["reference.reset=two_stage", "reference.stage_one_steps=1", "reference.tau=1", "eval.every_steps=0"], [1]),
        # the user's hook, asked with each step's metrics: it resets on evaluated steps (only step 2)
        (
            [
                "reference.reset=validation_hook",
                f"reference.validation_hook={HOOKS}:reset_when_evaluated",
                "eval.every_steps=2",
            ],
            [2],
        ),
    ],
    ids=["two_stage", "validation_hook"],
)
def test_reset_schedules_replace_the_reference_exactly_when_due(tiny, tmp_path, schedule, resets):
    metrics = _train(
        tiny,
        tmp_path,
        "parallelism.tp=1",
        *schedule,
        "train.steps=3",
        "checkpoint.every_steps=0",
    )
    assert _resets(metrics) == resets
    kl = {step: metrics[step]["train/approx_kl_ref"] for step in (1, 2, 3)}
    assert kl[1] < 1e-9, kl  # π_ref starts as π_θ
    for step in (2, 3):  # 0 right after a reset, drifted otherwise
        assert (kl[step] < 1e-9) == (step - 1 in resets), (step, kl, resets)
