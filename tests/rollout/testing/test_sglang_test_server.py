"""The test double keeps SGLang's protocol rules (so the client is tested against them)."""

import threading

import pytest

from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import RetryPolicy, SGLangClient, SGLangHTTPError
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import encode

pytestmark = pytest.mark.timeout(60)
ONCE = RetryPolicy(max_attempts=1)


@pytest.fixture
def server(tiny_ckpt):
    path, _, _ = tiny_ckpt
    with SGLangTestServer(LocalEngine.from_pretrained(path), api_key="k", model_path=path) as s:
        yield s


def raw_error(client, path, body):
    with pytest.raises(SGLangHTTPError) as err:
        client.post(path, body, retry=False)
    return err.value


def test_api_key_is_required_except_for_health(server):
    assert SGLangClient(server.url, retry=ONCE).health()
    assert raw_error(SGLangClient(server.url, retry=ONCE), "/generate", {"input_ids": [1]}).status == 401
    assert raw_error(SGLangClient(server.url, api_key="bad", retry=ONCE), "/generate", {"input_ids": [1]}).status == 401


def test_error_shapes(server):
    client = SGLangClient(server.url, api_key="k", retry=ONCE)
    bad_value = raw_error(client, "/generate", {"input_ids": [3], "sampling_params": {"temperature": -1}})
    assert bad_value.status == 400 and "temperature" in bad_value.message
    invalid = raw_error(client, "/generate", {"sampling_params": {}})
    assert invalid.status == 400 and "Either text or input_ids" in invalid.message
    assert raw_error(client, "/nope", {}).status == 404


def test_text_input_and_single_prompt_shape(server, tiny_ckpt):
    client = SGLangClient(server.url, api_key="k", retry=ONCE)
    out = client.post("/generate", {"text": "1+1=", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert isinstance(out, dict) and out["meta_info"]["prompt_tokens"] == 4
    assert out["meta_info"]["weight_version"] == "0"


def test_generate_waits_while_paused(server, tiny_ckpt, monkeypatch):
    _, _, tok = tiny_ckpt
    client = SGLangClient(server.url, api_key="k", retry=ONCE)
    client.post("/pause_generation", {})
    held = threading.Event()  # set once the request has reached the server and found it paused
    serve = server._wait_until_serving

    def wait_until_serving():
        if server._paused:
            held.set()
        serve()

    monkeypatch.setattr(server, "_wait_until_serving", wait_until_serving)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (client.generate(encode(tok, "1"), {"max_new_tokens": 1}), done.set()))
    worker.start()
    assert held.wait(30), "the request never reached the paused server"
    assert not done.is_set() and not client.health(generate=True)  # held until we continue
    client.post("/continue_generation", {})
    worker.join(timeout=30)
    assert done.is_set()


def test_weight_update_session_rules(server):
    client = SGLangClient(server.url, api_key="k", retry=ONCE)
    assert raw_error(client, "/end_weight_update", {}).status == 400
    client.post("/begin_weight_update", {})
    assert "already open" in raw_error(client, "/begin_weight_update", {}).message
    client.post("/end_weight_update", {})
    failed = raw_error(client, "/update_weights_from_disk", {"model_path": "/does/not/exist"})
    assert failed.status == 400 and "model_path" in failed.message
