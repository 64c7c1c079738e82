"""Weight-update sessions and group set-up recover from failures (against the SGLang test double).

SGLang 0.5.23 refuses ``/begin_weight_update`` while a session is open ("already open"), so a
session a failed push leaves open would refuse every later push.
"""

import time

import pytest

from armor_megatron.rollout.engine import RolloutError, WeightUpdateError
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import SGLangClient
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import tiny_weights

from .conftest import FAST_RETRY

pytestmark = [pytest.mark.timeout(120), pytest.mark.double_only]


def _server(path):
    return SGLangTestServer(LocalEngine.from_pretrained(path, weight_version="default"), model_path=path).start()


def _engine(servers, **sync):
    sync.setdefault("mode", "tensor")
    return SGLangEngine(
        [s.url for s in servers], retry=FAST_RETRY, request_timeout=30, weight_sync=WeightSyncConfig(**sync)
    )


def test_an_unreachable_engine_at_begin_leaves_no_session_open_on_the_others(tiny_ckpt):
    path, cfg, _ = tiny_ckpt
    a, b = _server(path), _server(path)
    try:
        engine = _engine([a, b])
        b.crash()  # a's session opens, b's begin cannot even connect
        with pytest.raises(RolloutError):
            engine.update_weights(tiny_weights(cfg, seed=3), version="v1")
        b.restart()
        engine.update_weights(tiny_weights(cfg, seed=3), version="v1")
        assert a.engine.weight_version == b.engine.weight_version == "v1"
    finally:
        a.stop(), b.stop()


def test_a_session_whose_end_failed_is_closed_before_the_next_push(tiny_ckpt):
    path, cfg, _ = tiny_ckpt
    a = _server(path)
    try:
        engine = _engine([a])
        a.inject_failures("/update_weights_from_tensor", 1, status=400)
        a.inject_failures("/end_weight_update", 1, status=503)  # the push fails and its session stays open
        with pytest.raises(WeightUpdateError, match="injected failure"):
            engine.update_weights(tiny_weights(cfg, seed=3), version="v1")
        engine.update_weights(tiny_weights(cfg, seed=3), version="v1")
        assert a.engine.weight_version == "v1"
    finally:
        a.stop()


def test_a_stale_session_is_cleared_at_start_up(tiny_ckpt):
    path, cfg, _ = tiny_ckpt
    a = _server(path)
    try:
        SGLangClient(a.url).post("/begin_weight_update", {})  # left open by a trainer that died mid-push
        engine = _engine([a])
        engine.update_weights(tiny_weights(cfg, seed=3), version="v1")
        assert a.engine.weight_version == "v1"
    finally:
        a.stop()


def test_a_failed_group_init_surfaces_the_servers_error_within_seconds(tiny_ckpt):
    path, cfg, _ = tiny_ckpt
    a = _server(path)
    try:
        engine = _engine([a], mode="distributed", backend="gloo", timeout=90)
        a.inject_failures("/init_weights_update_group", 1, status=400)
        start = time.monotonic()
        with pytest.raises(WeightUpdateError, match="init_weights_update_group.*injected failure"):
            engine.update_weights(tiny_weights(cfg, seed=3), version="v1")
        # the server's refusal ends the push, not the 90 s group timeout (bound generous for any load)
        assert time.monotonic() - start < 60
    finally:
        a.stop()
