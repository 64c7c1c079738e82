"""The whole loop against SGLang's HTTP protocol: ``armor-train`` with ``rollout.engine: sglang``
attached to two SGLang test-double processes (policy group and the frozen reference's group)
started by :class:`~armor_megatron.rollout.sglang.launcher.SGLangLauncher`, weights pushed by
``disk`` sync, engines colocated (memory released while the trainer updates), sampling at
T = 0.7 with truncated importance sampling on, seeded (deterministic inference), so the run
samples the same under any load."""

import contextlib
import json
import urllib.request
from collections.abc import Iterator

import pytest

from armor_megatron.rollout.sglang.launcher import LauncherConfig, SGLangLauncher
from tests.trainer.test_end_to_end import _train, assert_anchors_found_and_trained_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read() or b"null")


def tiny_model_path(tiny) -> str:
    """The tiny fixture's HF model directory (its ``model.path=`` override)."""
    return next(o.split("=", 1)[1] for o in tiny if o.startswith("model.path="))


@contextlib.contextmanager
def launched_doubles(tiny, tmp_path, **config) -> Iterator[SGLangLauncher]:
    """SGLang test-double processes on the tiny model, started by the launcher (``config``: more
    `LauncherConfig` fields; one colocated engine unless said), stopped after the block."""
    launcher = SGLangLauncher(
        LauncherConfig(
            **{"num_engines": 1, "colocated": True, **config},
            model_path=tiny_model_path(tiny),
            server_module="armor_megatron.rollout.testing.sglang_test_server",
            log_dir=str(tmp_path / "engines"),
            startup_timeout=120,
        )
    )
    try:
        launcher.start()
        yield launcher
    finally:
        launcher.stop()


@pytest.fixture
def servers(tiny, tmp_path, monkeypatch):
    """Two test-double SGLang servers on the tiny model, started by the launcher; yields their URLs."""
    # A user's environment may carry it; the launcher must not hand it to the servers, whose
    # log-probs would then be temperature-1 values while the trainer computes them at T.
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with launched_doubles(
        tiny,
        tmp_path,
        num_engines=2,
        # seeded sampling: the client sends its requests concurrently, and an unseeded server's
        # samples depend on the order they arrive in, which the machine's load decides; the
        # checks on anchors below then held for most orders, not all
        deterministic=True,
        mem_fraction_static=0.4,  # real SGLang flags, ignored by the double
    ) as launcher:
        yield launcher.worker_urls


def test_training_through_sglang_servers(tiny, tmp_path, servers):
    policy_url, reference_url = servers
    metrics = _train(
        tiny,
        tmp_path,
        "rollout.engine=sglang",
        f"rollout.sglang.urls=[{policy_url}]",
        f"anchor.reference_urls=[{reference_url}]",
        "rollout.sglang.weight_sync=disk",
        "rollout.sglang.placement=colocated",
        "parallelism.tp=2",
        "train.steps=2",
        "eval.every_steps=2",
        "checkpoint.every_steps=0",
        "reference.tau=1",
        "rollout.temperature=0.7",
        "algorithm.tis.enabled=true",
        "rollout.sglang.deterministic=true",  # every sample its own seed: the same run under any load
    )
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        m = metrics[step]
        assert m["train/num_tokens"] > 0
        # the engine sampled with exactly the trainer's weights, pushed through safetensors on disk, and
        # both report log_softmax(logits / 0.7): equal log-probs, TIS weights of 1
        assert m["rollout/logprob_abs_diff"] < 1e-5
        assert m["train/tis_num_tokens"] > 0 and m["train/tis_capped_frac"] == 0.0
        assert abs(m["train/tis_weight_mean"] - 1.0) < 1e-4 and m["train/tis_weight_max"] < 1.0 + 1e-4
        assert m["reference/reset"] == 1.0  # tau = 1: the reference group got the new weights too
    assert "eval/val/pass@1" in metrics[2]
    assert_anchors_found_and_trained_on(metrics, steps=(1, 2))  # sampled by the reference group's server

    policy, reference = (_get(url + "/test_double/requests") for url in servers)
    # colocated, per step: released before the update; the policy's weights resumed for the sync
    # and its KV cache and graphs after it; released and resumed once more around the reset
    # (tau = 1) and the final checkpoint, which bring the trainer back (tests/trainer/test_colocated_memory.py);
    # at the start both groups release everything before the trainer is built, then take their
    # weights back for the first push and their KV cache and graphs after it
    assert policy["/release_memory_occupation"] == 1 + 2 * 2 and policy["/resume_memory_occupation"] == 2 + 2 * 3
    assert reference["/release_memory_occupation"] == 1 + 2 * 2 and reference["/resume_memory_occupation"] == 2 + 2 * 2
    # initial weights + one sync per step (policy); initial + one per reset (reference)
    assert policy["/update_weights_from_disk"] == 3 and reference["/update_weights_from_disk"] == 3
    assert reference["/generate"] >= 2 and policy["/generate"] >= 2
    assert _get(policy_url + "/model_info")["weight_version"] == "step-2"
    assert _get(reference_url + "/model_info")["weight_version"] == "ref-2"
