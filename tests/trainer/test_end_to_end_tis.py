"""The whole loop at a sampling temperature other than 1 with truncated importance sampling on,
the local engine (the SGLang protocol's run: test_end_to_end_sglang.py): engine and trainer
log-probs are both log_softmax(logits / T), so they agree and every TIS weight is 1."""

import pytest

from tests.trainer.test_end_to_end import _train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_tis_at_temperature_0_7(tiny, tmp_path):
    metrics = _train(
        tiny,
        tmp_path,
        "parallelism.tp=1",
        "rollout.temperature=0.7",
        "algorithm.tis.enabled=true",
        "train.steps=2",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
    )
    assert sorted(metrics) == [1, 2]
    for step in (1, 2):
        m = metrics[step]
        assert m["train/skipped"] == 0.0 and m["train/num_tokens"] > 0
        assert m["rollout/logprob_abs_diff"] < 1e-5
        # the on-policy tokens (anchors weigh 1 and are not counted) were all weighted, none capped
        assert m["train/tis_num_tokens"] > 0 and m["train/tis_capped_frac"] == 0.0
        assert abs(m["train/tis_weight_mean"] - 1.0) < 1e-4 and m["train/tis_weight_max"] < 1.0 + 1e-4
