"""Generation through the REAL ``sglang-router`` binary (0.3.2, CPU) in front of SGLang TEST DOUBLES.

The doubles run in this process (so ``tensor`` weight sync can hand them CPU tensors) or, in the
launcher test, as processes that are killed with SIGKILL. Skipped only where ``sglang_router``
is not installed; the ``test`` extra installs it, so CI runs these.
"""

import importlib.util
import json
import os
import signal
import time

import pytest

from armor_megatron.config.load import load_config
from armor_megatron.config.typed import ConfigError
from armor_megatron.rollout.engine import EngineUnavailableError, RolloutError, SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import SGLangClient, SGLangHTTPError
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.sglang.launcher import LauncherConfig, SGLangLauncher
from armor_megatron.rollout.sglang.router import NOT_INSTALLED, SGLangRouter
from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import encode, tiny_weights

from .conftest import FAST_RETRY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TEST_SERVER = "armor_megatron.rollout.testing.sglang_test_server"
needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install 'armor_megatron[test]' installs it)",
)
pytestmark = pytest.mark.double_only

PROMPTS = ["12+3=", "what is 7*8?", "zebra", "(1)(2)(3)", "the end.", "99-1", "Quiz: 4/2", "xyz"]


def _double(path, health_generation=None):
    engine = LocalEngine.from_pretrained(path, weight_version="default")
    return SGLangTestServer(engine, model_path=path, health_generation=health_generation).start()


def _generate_counts(servers):
    return [s.requests.get("/generate", 0) for s in servers]


def _wait_dropped(router: SGLangRouter, url: str, timeout: float = 30.0) -> None:
    """Until the router's health checks mark ``url`` unhealthy (the test runs them every second)."""
    deadline = time.monotonic() + timeout
    while router.workers().get(url, True):
        assert time.monotonic() < deadline, f"the router still routes to {url}: {router.workers()}"
        time.sleep(0.2)


def test_router_command_keeps_the_key_off_the_command_line():
    router = SGLangRouter(["http://h:1/", "http://h:2"], policy="round_robin", api_key="secret")
    cmd = router.command(31000, 31001)
    assert cmd[1:4] == ["-m", "armor_megatron.rollout.sglang.launcher", "sglang_router.launch_router"]
    assert "secret" not in cmd and "--api-key" not in cmd
    assert cmd[cmd.index("--worker-urls") + 1 :][:2] == ["http://h:1", "http://h:2"]
    flags = dict(zip(cmd, cmd[1:]))
    # its own metrics port: the default (29000 on all interfaces) would clash between two routers
    assert flags["--port"] == "31000" and flags["--prometheus-port"] == "31001"
    assert flags["--policy"] == "round_robin" and flags["--health-check-interval-secs"] == "5"
    assert SGLangRouter(["http://h:1"]).command(1, 2)[1:3] == ["-m", "sglang_router.launch_router"]


def test_a_missing_router_binary_is_one_clear_line():
    router = SGLangRouter(["http://127.0.0.1:1"], module="armor_no_such_router.launch_router")
    with pytest.raises(EngineUnavailableError) as err:
        router.start()
    assert str(err.value) == NOT_INSTALLED
    assert router.proc is None


def test_bad_router_settings_name_their_key():
    with pytest.raises(ConfigError, match="rollout.sglang.router.policy"):
        load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), ["rollout.sglang.router.policy=fastest"])
    with pytest.raises(ConfigError, match="rollout.sglang.router.port: 80 must be 0"):
        load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), ["rollout.sglang.router.port=80"])
    cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), ["rollout.sglang.router.enabled=true"])
    assert cfg.rollout.sglang.router.enabled and cfg.rollout.sglang.router.policy == "cache_aware"


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rollouts_weight_sync_and_engine_deaths_through_the_real_router(tiny_ckpt, tmp_path):
    path, hf_cfg, tok = tiny_ckpt
    a, b = _double(path), _double(path)
    router = SGLangRouter(
        [a.url, b.url],
        policy="round_robin",
        health_check_interval_s=1,
        health_failure_threshold=1,
        startup_timeout=120,
        log_path=str(tmp_path / "router.log"),
    )
    engine = None
    try:
        router.start()
        assert router.workers() == {a.url: True, b.url: True}
        engine = SGLangEngine(
            [a.url, b.url],
            router_process=router,
            retry=FAST_RETRY,
            request_timeout=60,
            weight_sync=WeightSyncConfig(mode="tensor"),
        )
        prompts = [encode(tok, p) for p in PROMPTS]
        sampling = SamplingParams(max_new_tokens=3)

        # rollouts: one request per prompt, all through the router, spread over both engines
        groups = engine.generate(prompts, 2, sampling)
        assert [len(g) for g in groups] == [2] * len(prompts)
        counts = _generate_counts([a, b])
        assert sum(counts) == len(prompts) and min(counts) > 0, counts

        # deterministic mode's per-sample seeds: the router refuses a list of params (422), so each
        # sample is its own request
        with pytest.raises(SGLangHTTPError, match="HTTP 422"):
            SGLangClient(router.url).generate(prompts[0], [{"max_new_tokens": 2}] * 2)
        engine.deterministic = True
        engine.reseed(5)
        groups = engine.generate(prompts, 3, sampling)
        assert [len(g) for g in groups] == [3] * len(prompts)
        assert sum(_generate_counts([a, b])) == len(prompts) + 3 * len(prompts)  # the refused one reached none

        # weight sync goes to each engine directly; what the router returns then comes from the new weights
        before = dict(a.requests)
        engine.update_weights(tiny_weights(hf_cfg, seed=3), version="v1")
        assert a.engine.weight_version == b.engine.weight_version == "v1"
        assert a.requests.get("/update_weights_from_tensor", 0) == before.get("/update_weights_from_tensor", 0) + 1
        groups = engine.generate(prompts, 2, sampling)
        assert {s.weight_version for g in groups for s in g} == {"v1"}

        # an engine dies: the router drops it, health names it, generation goes on through the other
        a.crash()
        _wait_dropped(router, a.url)
        assert engine.unhealthy_workers(timeout=5) == [a.url]
        assert not engine.health(timeout=5)
        b_before = _generate_counts([b])[0]
        groups = engine.generate(prompts, 2, sampling)
        assert [len(g) for g in groups] == [2] * len(prompts)
        assert _generate_counts([b])[0] == b_before + 2 * len(prompts)  # still deterministic: a request per sample
        # a weight sync cannot skip it: one line naming the dead engine
        with pytest.raises(RolloutError) as err:
            engine.update_weights(tiny_weights(hf_cfg, seed=4), version="v2")
        assert a.url in str(err.value) and "\n" not in str(err.value)

        # the last engine dies: one line naming the router and both engines
        b.crash()
        _wait_dropped(router, b.url)
        with pytest.raises(EngineUnavailableError) as err:
            engine.generate(prompts[:2], 2, sampling)
        message = str(err.value)
        assert "\n" not in message and router.url in message and a.url in message and b.url in message
        assert "No available workers" in message
    finally:
        if engine is not None:
            engine.shutdown()
        router.stop()
        a.stop(), b.stop()
    assert not router.running


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launcher_starts_the_router_and_survives_a_killed_engine_process(tiny_ckpt, tmp_path):
    path, _, tok = tiny_ckpt
    cfg = LauncherConfig(
        model_path=path,
        num_engines=2,
        api_key="secret",
        use_router=True,
        router_health_check_interval_s=1,
        router_health_failure_threshold=1,
        server_module=TEST_SERVER,
        log_dir=str(tmp_path),
        startup_timeout=200,
    )
    launcher = SGLangLauncher(cfg)
    engine = SGLangEngine.launch(launcher, retry=FAST_RETRY, request_timeout=60)
    router_proc = launcher.router.proc
    try:
        assert engine.router.url == launcher.router_url
        with open(f"/proc/{router_proc.pid}/cmdline", "rb") as f:
            assert b"secret" not in f.read()
        with pytest.raises(SGLangHTTPError, match="HTTP 401"):  # the router wants the key of its clients too
            SGLangClient(launcher.router_url).get("/workers", retry=False)
        prompts = [encode(tok, p) for p in PROMPTS[:4]]
        assert [len(g) for g in engine.generate(prompts, 2, SamplingParams(max_new_tokens=3))] == [2] * 4

        dead = launcher._procs[0]
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait(timeout=30)
        _wait_dropped(launcher.router, launcher.worker_urls[0])
        assert engine.unhealthy_workers(timeout=5) == [launcher.worker_urls[0]]
        assert [len(g) for g in engine.generate(prompts, 2, SamplingParams(max_new_tokens=3))] == [2] * 4
        live = SGLangClient(launcher.worker_urls[1], api_key="secret").get("/test_double/requests")
        assert live["/generate"] >= len(prompts)
    finally:
        engine.shutdown()
    assert router_proc.poll() is not None and not launcher.running


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_trainer_factory_puts_a_router_in_front_of_each_group(tiny_ckpt, tmp_path):
    from armor_megatron.trainer.components import make_sglang_engines, release_engines_at_start

    path, hf_cfg, tok = tiny_ckpt
    servers = [_double(path, health_generation=False) for _ in range(3)]  # colocated engines start quiet
    policy_urls, reference_urls = [s.url for s in servers[:2]], [servers[2].url]
    cfg = load_config(
        os.path.join(ROOT, "configs/tiny_cpu.yaml"),
        [
            "rollout.engine=sglang",
            "rollout.sglang.urls=" + json.dumps(policy_urls),
            "anchor.reference_urls=" + json.dumps(reference_urls),
            "rollout.sglang.weight_sync=tensor",
            "rollout.sglang.router.enabled=true",
            "rollout.sglang.router.policy=round_robin",
            "rollout.sglang.request_timeout_s=60",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            f"logging.dir={tmp_path / 'runs'}",
        ],
    )
    release_engines_at_start(cfg)  # colocated (the default): as trainer/run.py, before the first push
    make = make_sglang_engines(cfg, hf_cfg)
    weights = tiny_weights(hf_cfg, seed=3)
    policy, reference = make(weights, weights, policy_version="p1", reference_version="r1")
    try:
        assert policy.router_process.worker_urls == policy_urls and policy.router.url == policy.router_process.url
        assert reference.router_process.worker_urls == reference_urls
        assert os.path.exists(tmp_path / "runs" / cfg.name / "sglang-router-policy.log")
        groups = policy.generate([encode(tok, p) for p in PROMPTS[:4]], 2, SamplingParams(max_new_tokens=3))
        assert {s.weight_version for g in groups for s in g} == {"p1"}
        assert min(_generate_counts(servers[:2])) > 0 and _generate_counts(servers[2:]) == [0]
        groups = reference.generate([encode(tok, PROMPTS[0])], 2, SamplingParams(max_new_tokens=3))
        assert {s.weight_version for g in groups for s in g} == {"r1"}
    finally:
        for engine in (policy, reference):
            engine.shutdown()
        for s in servers:
            s.stop()
    assert not policy.router_process.running and not reference.router_process.running
    assert all(s.failure is None for s in servers)


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_port_taken_between_choosing_and_binding_is_retried_on_fresh_ports(tiny_ckpt, tmp_path, monkeypatch):
    import socket

    from armor_megatron.rollout.sglang import router as router_module

    path, _, _ = tiny_ckpt
    server = _double(path)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])  # the first port chosen is taken by the time the router binds it
    real_free_port = router_module.free_port
    monkeypatch.setattr(router_module, "free_port", lambda host: next(picks, None) or real_free_port(host))
    router = SGLangRouter([server.url], startup_timeout=60, log_path=str(tmp_path / "router.log"))
    try:
        router.start()
        assert router.port != taken.getsockname()[1] and router.workers() == {server.url: True}
        assert "Address already in use" in (tmp_path / "router.log").read_text()
    finally:
        router.stop()
        taken.close()
        server.stop()


@needs_router
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("settings", ["colocated", "before issue 31"])
def test_colocated_engines_behind_the_router_stay_quiet_while_released(tiny_ckpt, tmp_path, settings):
    """A colocated step through the router: release every tag, wait several router health-check
    intervals, resume the weights, push, resume the rest, generate. The double dies on a
    generating request while released, as SGLang does; colocated settings (router checks off,
    ``/health`` not generating) keep it alive, the earlier settings (router checking ``/health``
    every second, ``/health`` generating: SGLang's default) kill it."""
    path, hf_config, tok = tiny_ckpt
    before = settings != "colocated"
    cfg = LauncherConfig(
        model_path=path,
        colocated=True,
        use_router=True,
        router_health_check_interval_s=1,
        router_health_failure_threshold=1,
        router_health_check=True if before else None,
        env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"} if before else {},
        server_module=TEST_SERVER,
        log_dir=str(tmp_path / "logs"),
        startup_timeout=200,
    )
    launcher = SGLangLauncher(cfg)
    sync = WeightSyncConfig(mode="disk", disk_dir=str(tmp_path / "sync"), hf_config=hf_config)
    engine = SGLangEngine.launch(launcher, retry=FAST_RETRY, request_timeout=30, weight_sync=sync)
    prompts = [encode(tok, p) for p in PROMPTS[:2]]
    try:
        assert "--disable-health-check" in launcher.router.command(1, 2) or before
        assert [len(g) for g in engine.generate(prompts, 2, SamplingParams(max_new_tokens=3))] == [2, 2]
        engine.release_memory()
        time.sleep(4)  # four of the router's health-check intervals
        server = launcher._procs[0]
        if before:
            assert server.wait(timeout=30) == 1  # a health check generated on released memory
            assert "ran a forward while" in open(tmp_path / "logs" / "engine-0.log").read()
            return
        engine.resume_memory(tags=("weights",))
        engine.update_weights(tiny_weights(hf_config, seed=5), "step-1")
        engine.resume_memory(tags=("kv_cache", "cuda_graph"))
        groups = engine.generate(prompts, 2, SamplingParams(max_new_tokens=3))
        assert [len(g) for g in groups] == [2, 2] and groups[0][0].weight_version == "step-1"
        assert server.poll() is None
    finally:
        engine.shutdown()
