"""The whole loop against SGLang's HTTP protocol: ``armor-train`` with ``rollout.engine: sglang``
attached to two SGLang test-double processes (policy group and the frozen reference's group),
weights pushed by ``disk`` sync, engines colocated (memory released while the trainer updates)."""

import json
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.trainer.test_end_to_end import _env, _train, assert_anchors_found_and_trained_on

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read() or b"null")


LISTENING = re.compile(r"sglang test server listening on (http://\S+)")


def _listening_url(proc, log_path, deadline):
    """The URL the server printed once it had bound its port (it binds port 0: no port race)."""
    while True:
        found = LISTENING.search(log_path.read_text())
        if found:
            return found.group(1)
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, f"{log_path.name}: the server did not come up"
        time.sleep(0.2)


@pytest.fixture
def servers(tiny, tmp_path):
    """Two test-double SGLang servers on the tiny model; yields their URLs, stops them after."""
    model = next(o.split("=", 1)[1] for o in tiny if o.startswith("model.path="))
    procs, logs = [], []
    for name in ("policy", "reference"):
        logs.append(tmp_path / f"{name}-server.log")
        log = open(logs[-1], "w")
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "armor_megatron.rollout.testing.sglang_test_server",
                    "--model-path",
                    model,
                    "--port",
                    "0",
                    "--mem-fraction-static",
                    "0.4",
                ],  # a real SGLang flag, ignored by the double
                env=_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        deadline = time.monotonic() + 120
        urls = [_listening_url(proc, log_path, deadline) for proc, log_path in zip(procs, logs)]
        for url in urls:
            _get(url + "/health")  # it printed its URL once listening: this answers at once
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


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
    )
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        m = metrics[step]
        assert m["train/num_tokens"] > 0
        # the engine sampled with exactly the trainer's weights, pushed through safetensors on disk
        assert m["rollout/logprob_abs_diff"] < 1e-5
        assert m["reference/reset"] == 1.0  # tau = 1: the reference group got the new weights too
    assert "eval/val/pass@1" in metrics[2]
    assert_anchors_found_and_trained_on(metrics, steps=(1, 2))  # sampled by the reference group's server

    policy, reference = (_get(url + "/test_double/requests") for url in servers)
    # colocated, per step: released before the update; the policy's weights resumed for the sync
    # and its KV cache and graphs after it; released and resumed once more around the reset
    # (tau = 1) and the final checkpoint, which bring the trainer back (tests/trainer/test_colocated_memory.py)
    assert policy["/release_memory_occupation"] == 2 * 2 and policy["/resume_memory_occupation"] == 2 * 3
    assert reference["/release_memory_occupation"] == reference["/resume_memory_occupation"] == 2 * 2
    # initial weights + one sync per step (policy); initial + one per reset (reference)
    assert policy["/update_weights_from_disk"] == 3 and reference["/update_weights_from_disk"] == 3
    assert reference["/generate"] >= 2 and policy["/generate"] >= 2
    assert _get(policy_url + "/model_info")["weight_version"] == "step-2"
    assert _get(reference_url + "/model_info")["weight_version"] == "ref-2"
