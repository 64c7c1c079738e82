"""Partial rollouts in the whole loop: ``armor-train`` with ``rollout.partial`` on, attached to an
SGLang test double that decodes one token per 50 ms (so groups finish at different times). Each step
keeps twice the groups it needs in flight, trains on the first ones complete, and hands the rest
(aborted with their tokens, or complete after the target) to the next step first; with anchors, each
group's anchor is looked up when the group starts, and a reference reset discards the anchors of the
groups still in progress."""

import json
import urllib.request

import pytest

from tests.trainer.test_end_to_end import _train
from tests.trainer.test_end_to_end_sglang import launched_doubles

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def server(tiny, tmp_path):
    """One slow-decoding test-double SGLang server on the tiny model; yields its URL."""
    with launched_doubles(tiny, tmp_path, extra_args=["--seconds-per-token", "0.05"]) as launcher:
        yield launcher.worker_urls[0]


def _partial_run(url):
    """Three steps of 4 groups of 4 on the double at ``url``, twice the groups needed in flight."""
    return [
        "rollout.engine=sglang",
        f"rollout.sglang.urls=[{url}]",
        "rollout.sglang.weight_sync=disk",
        "rollout.sglang.placement=colocated",
        "rollout.partial.enabled=true",
        "rollout.partial.over_provision=2",
        "rollout.partial.max_versions=2",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_response_len=16",
        "algorithm.dynamic_sampling.enabled=false",
        "algorithm.tis.enabled=true",
        "train.steps=3",
        "train.mini_batches_per_step=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
    ]


def test_partial_rollouts_train_abort_the_surplus_and_continue_it(tiny, tmp_path, server):
    metrics = _train(
        tiny,
        tmp_path,
        "anchor.enabled=false",
        *_partial_run(server),
    )
    steps = (1, 2, 3)
    for step in steps:
        m = metrics[step]
        assert m["train/num_tokens"] > 0
        assert m["partial/wasted_tokens"] == 0.0  # stale rule finish: nothing thrown away
        if m["partial/continued"] == 0:  # every response of the step was generated whole by one version
            assert m["partial/versions_spanned_max"] == 1.0, (step, m)
        assert m["train/tis_num_tokens"] > 0  # every token weighed by its own engine log-prob
    # step 1 kept twice the groups it needed in flight: it generated more than it trained on, and the
    # surplus (aborted with its tokens, or complete after the target) is handed to step 2 first; whether a
    # surplus response is cut mid-decode depends on the double's timing: tests/rollout/test_partial_generation.py
    # checks abort and continuation exactly
    assert metrics[1]["partial/generated_tokens"] > metrics[1]["rollout/generated_tokens"]
    assert metrics[1]["partial/continued"] == 0.0  # nothing was carried into the first step
    with urllib.request.urlopen(server + "/model_info", timeout=5) as response:
        assert json.loads(response.read())["weight_version"] == "step-3"  # one push per step


def test_partial_rollouts_with_anchors_train_only_anchors_of_the_current_reference(tiny, tmp_path, server):
    """ARMOR's groups under partial rollouts: anchors from π_ref swapped into the one policy server (only
    while no on-policy request decodes there), a reset after every step, so the groups a step leaves in
    progress hold anchors of a reference the next step no longer has: they are discarded and looked up
    again, and every anchor that trains is of the current reference (``rollout/anchor_reference``)."""
    metrics = _train(
        tiny,
        tmp_path,
        "anchor.enabled=true",
        "anchor.source=swap",
        "anchor.max_tries=16",  # most prompts get an anchor, so groups in progress hold some at each reset
        "anchor.tries_per_request=16",
        "reference.reset=every",
        "reference.tau=1",
        "logging.sample_metrics=tests.trainer.test_loop_in_process:anchor_reference",
        *_partial_run(server),
    )
    steps = (1, 2, 3)
    for step in steps:
        m = metrics[step]
        assert m["reference/reset"] == 1.0 and m["train/num_tokens"] > 0
        if m["anchor/found_rate"] > 0:  # the step trained anchors, all sampled by the reference of its start
            assert m["rollout/anchor_reference"] == step - 1, (step, m)
    assert max(metrics[step]["anchor/found_rate"] for step in steps) > 0
    assert metrics[1]["partial/anchors_discarded"] == 0.0  # nothing was in progress before the first step
    # the groups each step left in progress held anchors of the reference the reset after it replaced
    assert sum(metrics[step]["partial/anchors_discarded"] for step in (2, 3)) > 0
