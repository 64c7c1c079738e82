"""The double refuses what SGLang 0.5.23 refuses (each rule names the SGLang source it copies)."""

import threading

import pytest

from armor_megatron.rollout.engine import EngineUnavailableError, SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import RetryPolicy, SGLangClient, SGLangHTTPError
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import encode

pytestmark = pytest.mark.timeout(60)
ONCE = RetryPolicy(max_attempts=1)


@pytest.fixture
def server(tiny_ckpt):
    path, _, _ = tiny_ckpt
    with SGLangTestServer(LocalEngine.from_pretrained(path), model_path=path) as s:
        yield s


def status(client, method, path, body=None):
    try:
        client.request(method, path, body, retry=False)
    except SGLangHTTPError as e:
        return e.status
    return 200


def test_sampling_params_are_validated_like_sglang(server, tiny_ckpt):
    _, cfg, tok = tiny_ckpt
    client, p = SGLangClient(server.url, retry=ONCE), encode(tok, "12")
    gen = lambda params: status(client, "POST", "/generate", {"input_ids": p, "sampling_params": params})  # noqa: E731
    assert gen({"top_k": 0, "max_new_tokens": 1}) == 400  # SamplingParams.verify: -1 or >= 1
    assert gen({"max_new_tokens": 2.0}) == 400  # an int field
    assert gen({"max_new_tokens": 0}) == 200  # 0 is allowed
    context = cfg["max_position_embeddings"]
    assert gen({"max_new_tokens": context - len(p)}) == 200
    assert gen({"max_new_tokens": context - len(p) + 1}) == 400  # prompt + max_new_tokens over the context


def test_client_sends_what_sglang_accepts(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine = SGLangEngine([server.url], retry=ONCE)
    sampling = SamplingParams(max_new_tokens=2.0, top_k=0, temperature=1.0)  # "disabled" top_k, a float length
    assert engine.generate([encode(tok, "1")], 2, sampling)[0][1].num_tokens == 2


def outputs(client, tok, **params):
    params = {"max_new_tokens": 8, "ignore_eos": True, **params}
    return [tuple(o["output_ids"]) for o in client.generate(encode(tok, "7"), params)]


def test_sampling_seed_counts_only_under_deterministic_inference(server, tiny_ckpt):
    # sampling_batch_info.py:157-171: no seed tensor unless --enable-deterministic-inference
    _, _, tok = tiny_ckpt
    client = SGLangClient(server.url, retry=ONCE)
    assert len(set(outputs(client, tok, n=3, sampling_seed=1))) == 3  # ignored: the copies draw independently
    assert outputs(client, tok, sampling_seed=1) != outputs(client, tok, sampling_seed=1)


def test_deterministic_server_seeds_every_copy_alike(tiny_ckpt):
    # deterministic: (seed, position, token) hashed; copies of one request share the seed, unseeded ones get 42
    path, _, tok = tiny_ckpt
    with SGLangTestServer(LocalEngine.from_pretrained(path), model_path=path, deterministic=True) as server:
        client = SGLangClient(server.url, retry=ONCE)
        same = outputs(client, tok, n=3, sampling_seed=1)
        assert len(set(same)) == 1 and outputs(client, tok, sampling_seed=1) == same[:1]
        unseeded = outputs(client, tok, n=2)
        assert len(set(unseeded)) == 1 and unseeded == outputs(client, tok, n=2, sampling_seed=42)
        assert outputs(client, tok, sampling_seed=2) != same[:1]
        status_code = status(  # io_struct.py:541-545: one n for all params dicts of a batch
            client,
            "POST",
            "/generate",
            {"input_ids": [[3, 4], [5, 6]], "sampling_params": [{"n": 1}, {"n": 2}]},
        )
        assert status_code == 400


def test_logprobs_follow_the_servers_environment(tiny_ckpt, monkeypatch):
    # sampler.py:82/237/323: SGLANG_RETURN_ORIGINAL_LOGPROB set -> temperature-1 values; else at T (line 315)
    from tests.rollout.test_local import teacher_forced_logprobs

    path, _, tok = tiny_ckpt
    prompt = encode(tok, "12+")
    for env, at in ((None, 0.7), ("1", 1.0), ("true", 1.0), ("0", 0.7)):
        if env is None:
            monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
        else:
            monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", env)
        local = LocalEngine.from_pretrained(path)
        with SGLangTestServer(local, model_path=path) as server:
            engine = SGLangEngine([server.url], retry=ONCE)
            group = engine.generate([prompt], 2, SamplingParams(max_new_tokens=8, temperature=0.7, ignore_eos=True))
        for s in group[0]:
            expected = teacher_forced_logprobs(local.model, prompt, s.token_ids, temperature=at)
            assert list(s.logprobs) == pytest.approx(expected.tolist(), abs=1e-5), env


def test_pause_keeps_requests_in_flight_and_generate_runs_during_a_session(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine, client = SGLangEngine([server.url], retry=ONCE), SGLangClient(server.url, retry=ONCE)
    engine.pause()
    assert server.pause_mode == "retract"  # SGLang's default ("abort") would abort requests in flight
    engine.resume()
    client.post("/begin_weight_update", {})
    done = threading.Event()
    threading.Thread(target=lambda: (client.generate(encode(tok, "1"), {"max_new_tokens": 1}), done.set())).start()
    assert done.wait(20)  # an open weight-update session does not hold /generate back
    client.post("/end_weight_update", {})


def test_memory_release_per_tag_answers_null_and_needs_an_idle_or_paused_server(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    client = SGLangClient(server.url, retry=ONCE)
    assert client.post("/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) is None
    assert client.post("/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) is None
    assert status(client, "POST", "/release_memory_occupation", {"tags": ["nope"]}) == 400
    server._running = 1  # a request in flight
    try:
        assert status(client, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]}) == 400
        client.post("/pause_generation", {"mode": "in_place"})
        assert client.post("/release_memory_occupation", {"tags": ["kv_cache"]}) is None
    finally:
        server._running = 0
        client.post("/continue_generation", {})


def test_routes_methods_groups_and_auth(tiny_ckpt):
    path, _, _ = tiny_ckpt
    with SGLangTestServer(LocalEngine.from_pretrained(path), api_key="k", model_path=path) as s:
        client = SGLangClient(s.url, api_key="k", retry=ONCE)
        assert status(client, "GET", "/get_weight_version") == 404
        assert status(client, "GET", "/get_server_info") == status(client, "GET", "/v1/models") == 200
        assert client.post("/update_weight_version", {"new_version": "v7"})["success"]
        assert client.weight_version() == "v7"
        assert status(client, "GET", "/generate") == 405
        assert status(client, "POST", "/destroy_weights_update_group", {"group_name": "none"}) == 400
        anonymous = SGLangClient(s.url, retry=ONCE)
        assert status(anonymous, "GET", "/health_generate") == 200
        assert status(anonymous, "GET", "/metrics") == 404  # exempt from the key (no metrics route in the double)
        assert status(anonymous, "GET", "/get_server_info") == 401
        lower = s.handle("GET", "/get_server_info", {"Authorization": "bearer k"}, None)
        assert lower["weight_version"] == "v7"
        assert s.handle("GET", "/get_server_info", {"x-api-key": "k"}, None)["weight_version"] == "v7"


@pytest.mark.parametrize("path", ["/generate", "/health_generate", "/health"])
def test_a_generating_request_while_memory_is_released_kills_the_engine(tiny_ckpt, path):
    """SGLang 0.5.23 neither refuses nor holds a generation while memory is released: its forward
    runs on unmapped memory and the engine dies. ``/health`` generates too unless
    SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is off."""
    model_path, _, tok = tiny_ckpt
    server = SGLangTestServer(LocalEngine.from_pretrained(model_path), health_generation=True).start()
    try:
        client = SGLangClient(server.url, retry=ONCE, request_timeout=10)
        assert client.post("/release_memory_occupation", {"tags": ["kv_cache"]}) is None
        with pytest.raises(EngineUnavailableError):
            if path == "/generate":
                client.generate(encode(tok, "1"), {"max_new_tokens": 1})
            else:
                client.get(path, retry=False)
        assert server.failure is not None and "released" in server.failure
        assert not client.health(timeout=2)  # dead
    finally:
        server.stop()


def test_health_without_generation_is_safe_while_released(tiny_ckpt):
    model_path, _, _ = tiny_ckpt
    server = SGLangTestServer(LocalEngine.from_pretrained(model_path), health_generation=False).start()
    try:
        client = SGLangClient(server.url, retry=ONCE)
        client.post("/release_memory_occupation", {})
        assert client.health(timeout=5)  # /health answers at once, no forward
        assert server.failure is None
        client.post("/resume_memory_occupation", {})
    finally:
        server.stop()


def test_resuming_memory_that_was_not_released_kills_the_engine(tiny_ckpt):
    model_path, _, _ = tiny_ckpt
    server = SGLangTestServer(LocalEngine.from_pretrained(model_path)).start()
    try:
        client = SGLangClient(server.url, retry=ONCE, request_timeout=10)
        client.post("/release_memory_occupation", {"tags": ["kv_cache"]})
        with pytest.raises(EngineUnavailableError):
            client.post("/resume_memory_occupation", {"tags": ["kv_cache", "weights"]}, retry=False)
        assert server.failure == "resume_memory_occupation of ['weights'], which were not released"
    finally:
        server.stop()
