"""``anchor.source: swap``: π_ref is pushed into the policy engine for each anchor request and
the policy swapped back, which must be the policy of the current step, not the first one."""

import pytest

from tests.trainer.test_end_to_end import _train, assert_anchors_found_and_trained_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_swapped_engines_sample_on_policy_with_the_current_weights(tiny, tmp_path):
    metrics = _train(
        tiny,
        tmp_path,
        "anchor.source=swap",
        "anchor.cache=false",
        "train.steps=3",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "reference.tau=2",
    )
    assert_anchors_found_and_trained_on(metrics)  # sampled from π_ref swapped into the policy engine
    for step in (1, 2, 3):
        # on-policy samples come after the anchors' swap: the engine's log-probs are the trainer's
        assert metrics[step]["rollout/logprob_abs_diff"] < 1e-5, (step, metrics[step]["rollout/logprob_abs_diff"])
    assert metrics[2]["reference/reset"] == 1.0
