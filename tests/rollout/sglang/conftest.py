"""Servers for the client tests.

By default each test gets the SGLang TEST DOUBLE (armor_megatron.rollout.testing.sglang_test_server)
on 127.0.0.1, backed by the tiny local model. ``tools/gpu_smoke.sh`` sets ARMOR_SGLANG_URL (a real
SGLang server started from ARMOR_SGLANG_MODEL) and the tests marked ``double_only`` are skipped,
since they use hooks that only the double has (injected failures, crash, restart).
"""

import os

import pytest

from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import RetryPolicy
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

REAL_URL = os.environ.get("ARMOR_SGLANG_URL")
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.05, multiplier=2.0, max_backoff=0.2)


def pytest_collection_modifyitems(config, items):
    if REAL_URL:
        skip = pytest.mark.skip(reason="uses test-double hooks; running against a real SGLang server")
        for item in items:
            if "double_only" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def server(tiny_ckpt):
    """A fresh test server (or the real one under gpu_smoke.sh)."""
    if REAL_URL:
        yield _RealServer(REAL_URL)
        return
    path, _, _ = tiny_ckpt
    engine = LocalEngine.from_pretrained(path, weight_version="default")
    with SGLangTestServer(engine, model_path=path) as s:
        yield s


class _RealServer:
    def __init__(self, url):
        self.url = url
