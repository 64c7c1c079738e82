"""The SGLang client and engine over real HTTP on loopback (test double by default, see conftest)."""

import logging
import os
import threading
import time

import pytest

from armor_megatron.rollout.engine import (
    EngineUnavailableError,
    RolloutError,
    SamplingParams,
    StaleWeightsError,
    check_versions,
)
from armor_megatron.rollout.sglang.client import RetryPolicy, SGLangClient, SGLangHTTPError, error_message, parse_output
from armor_megatron.rollout.sglang.engine import SGLangEngine
from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig
from armor_megatron.rollout.testing.tiny_models import encode, tiny_weights

from .conftest import FAST_RETRY, REAL_URL

# the double computes with the local engine's own code; a real server's kernels differ a little
LOCAL_MATCH = 5e-2 if REAL_URL else 1e-5

pytestmark = pytest.mark.timeout(120)


def make_engine(server, **kw):
    kw.setdefault("retry", FAST_RETRY)
    kw.setdefault("request_timeout", 60.0)
    return SGLangEngine([server.url], **kw)


def test_n_samples_per_prompt_with_logprobs(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine = make_engine(server)
    prompts = [encode(tok, "1+2="), encode(tok, "hello world"), encode(tok, "7")]
    groups = engine.generate(prompts, n=3, sampling=SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [len(g) for g in groups] == [3, 3, 3]
    for i, group in enumerate(groups):
        for s in group:
            assert s.prompt_index == i
            assert len(s.token_ids) == 5 and len(s.logprobs) == 5
            assert all(lp <= 0 for lp in s.logprobs)
            assert s.finish_reason == "length"
            assert s.weight_version == engine.weight_version


def test_raw_batch_with_n_is_flat_prompt_by_prompt(server, tiny_ckpt):
    # SGLang answers a batch with n > 1 as one flat list: prompt 0's n samples, then prompt 1's.
    _, _, tok = tiny_ckpt
    client = SGLangClient(server.url, retry=FAST_RETRY)
    p0, p1 = encode(tok, "ab"), encode(tok, "cd")
    greedy = {"max_new_tokens": 3, "temperature": 0, "n": 2, "ignore_eos": True}
    flat = client.post("/generate", {"input_ids": [p0, p1], "sampling_params": greedy})
    single0 = client.post("/generate", {"input_ids": p0, "sampling_params": {**greedy, "n": 1}})
    single1 = client.post("/generate", {"input_ids": p1, "sampling_params": {**greedy, "n": 1}})
    assert isinstance(flat, list) and len(flat) == 4
    assert [o["output_ids"] for o in flat] == [single0["output_ids"]] * 2 + [single1["output_ids"]] * 2


def test_logprobs_are_at_the_sampling_temperature(server, tiny_ckpt):
    # SGLang's default (no SGLANG_RETURN_ORIGINAL_LOGPROB): log_softmax(logits / T), what the trainer recomputes
    from armor_megatron.rollout.local import LocalEngine
    from tests.rollout.test_local import teacher_forced_logprobs

    path, _, tok = tiny_ckpt
    model = LocalEngine.from_pretrained(path).model
    prompts = [encode(tok, "1+2="), encode(tok, "hello")]
    sampling = SamplingParams(max_new_tokens=8, temperature=0.7, ignore_eos=True)
    gap_to_t1 = 0.0
    for prompt, group in zip(prompts, make_engine(server).generate(prompts, 2, sampling)):
        for s in group:
            at_t = teacher_forced_logprobs(model, prompt, s.token_ids, temperature=0.7)
            assert list(s.logprobs) == pytest.approx(at_t.tolist(), abs=LOCAL_MATCH)
            t1 = teacher_forced_logprobs(model, prompt, s.token_ids)
            gap_to_t1 = max(gap_to_t1, (t1 - at_t).abs().max().item())
    assert gap_to_t1 > max(0.1, 2 * LOCAL_MATCH)  # temperature-1 values would not pass


def test_logprobs_are_parsed_from_output_token_logprobs(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    client = SGLangClient(server.url, retry=FAST_RETRY)
    raw = client.generate(encode(tok, "12"), {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 1})
    s = parse_output(raw[0], prompt_index=0, return_logprob=True)
    rows = raw[0]["meta_info"]["output_token_logprobs"]
    assert list(s.token_ids) == [r[1] for r in rows] == raw[0]["output_ids"]
    assert list(s.logprobs) == [r[0] for r in rows]
    assert s.weight_version == raw[0]["meta_info"]["weight_version"]


def test_logprob_rows_must_name_the_output_tokens():
    out = {
        "output_ids": [5, 6],
        "text": "ab",
        "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.1, 5, None], [-0.2, 7, None]]},
    }
    with pytest.raises(
        RolloutError, match=r"prompt 3: output_token_logprobs row \[-0.2, 7, null\] does not name output token 6"
    ):
        parse_output(out, prompt_index=3, return_logprob=True)


def test_null_logprobs_read_as_minus_infinity():
    # SGLang's JSON encoder writes a non-finite logprob as null
    out = {
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 6},
            "output_token_logprobs": [[None, 5, None], [-0.5, 6, None]],
        },
    }
    assert parse_output(out, prompt_index=0, return_logprob=True).logprobs == (float("-inf"), -0.5)


def test_a_response_generated_across_a_weight_update_is_stale():
    # SGLang names the last span's version in weight_version and lists every span in weight_versions
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    out = {"output_ids": [1, 2, 3, 4, 5], "meta_info": {"weight_version": "4", "weight_versions": spans}}
    sample = parse_output(out, prompt_index=0, return_logprob=False)
    assert sample.weight_version == "3->4"
    with pytest.raises(StaleWeightsError, match="'3->4', expected '4'"):
        check_versions([[sample]], "4")
    one_span = {"output_ids": [1], "meta_info": {"weight_version": "4", "weight_versions": spans[1:]}}
    assert parse_output(one_span, prompt_index=0, return_logprob=False).weight_version == "4"


def test_stop_and_length_finish_reasons(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine = make_engine(server)
    prompt = encode(tok, "9-4=")
    free = engine.generate([prompt], 1, SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))[0][0]
    assert free.finish_reason == "length" and len(free.token_ids) == 4
    stop_tok = free.token_ids[1]
    s = engine.generate([prompt], 1, SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=(stop_tok,)))[0][0]
    assert s.finish_reason == "stop"
    assert s.token_ids[-1] == stop_tok  # the matched stop token stays in output_ids


@pytest.mark.double_only
def test_unknown_sampling_param_is_a_clear_400(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    client = SGLangClient(server.url, retry=FAST_RETRY)
    with pytest.raises(SGLangHTTPError, match="HTTP 400.*bogus_knob") as err:
        client.generate(encode(tok, "1"), {"max_new_tokens": 2, "bogus_knob": 1})
    assert err.value.status == 400
    assert server.requests["/generate"] == 1  # a 4xx is not retried


def test_error_message_reads_all_three_sglang_shapes():
    assert error_message(b'{"error": "Unknown sampling parameter: x"}') == "Unknown sampling parameter: x"
    assert error_message({"error": {"message": "temperature must be >= 0"}}) == "temperature must be >= 0"
    openai = {
        "object": "error",
        "message": "input_ids: field required",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert error_message(openai) == "input_ids: field required"
    assert error_message(b"Internal Server Error") == "Internal Server Error"


@pytest.mark.double_only
def test_5xx_and_aborts_are_retried(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine = make_engine(server)
    server.inject_failures("/generate", 2, status=503)
    groups = engine.generate([encode(tok, "1")], 2, SamplingParams(max_new_tokens=2))
    assert server.requests["/generate"] == 3 and len(groups[0]) == 2
    server.inject_aborts(1)
    groups = engine.generate([encode(tok, "1")], 2, SamplingParams(max_new_tokens=2))
    assert server.requests["/generate"] == 5  # the aborted answer was asked again
    assert all(s.finish_reason != "abort" for s in groups[0])


def _wait_until(condition, what, wait_s=60.0):
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {wait_s} s"
        time.sleep(0.01)


class _RetryLogged(logging.Handler):
    """Sets ``event`` when the client logs a failed request it is about to retry."""

    def __init__(self):
        super().__init__()
        self.event = threading.Event()

    def emit(self, record):
        if "retrying in" in record.getMessage():
            self.event.set()


@pytest.mark.double_only
def test_retries_after_a_server_restart_mid_batch(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    # attempts enough to outlast the restart on any load; the generate timeout bounds the test
    retry = RetryPolicy(max_attempts=1000, initial_backoff=0.05, multiplier=1.5, max_backoff=0.3)
    engine = make_engine(server, retry=retry, max_concurrency=2)
    prompts = [encode(tok, f"{i}+{i}=") for i in range(8)]
    result = {}

    def run():
        result["groups"] = engine.generate(prompts, 2, SamplingParams(max_new_tokens=24, ignore_eos=True), timeout=100)

    worker = threading.Thread(target=run)
    worker.start()
    _wait_until(lambda: server.requests.get("/generate", 0) >= 2, "the batch under way")
    retries = _RetryLogged()
    client_log = logging.getLogger("armor_megatron.rollout.sglang.client")
    client_log.addHandler(retries)
    try:
        server.crash()
        # requests now fail (cut mid-answer or refused) and back off
        assert retries.event.wait(60), "no request failed and was retried after the crash"
    finally:
        client_log.removeHandler(retries)
    server.restart()
    worker.join(timeout=100)
    assert not worker.is_alive(), "the batch did not finish after the restart"
    groups = result["groups"]
    assert [len(g) for g in groups] == [2] * 8
    assert all(len(s.token_ids) == 24 for g in groups for s in g)
    assert server.requests["/generate"] > len(prompts)  # some prompts were sent again


@pytest.mark.double_only
def test_a_dead_server_is_a_clear_error_not_a_hang(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine = make_engine(server)
    server.crash()
    start = time.monotonic()
    with pytest.raises(
        EngineUnavailableError, match=r"SGLang server http://127\.0\.0\.1:\d+ failed /generate: 4 attempt"
    ):
        engine.generate([encode(tok, "1")], 1, SamplingParams(max_new_tokens=2))
    # 4 quick attempts (the message says so), not the 60 s request timeout: generous for any load
    assert time.monotonic() - start < 45


def test_weight_update_from_disk(server, tiny_ckpt, tmp_path):

    _, cfg, tok = tiny_ckpt
    sync = WeightSyncConfig(mode="disk", disk_dir=str(tmp_path / "sync"), hf_config=cfg)
    engine = make_engine(server, weight_sync=sync)
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    before = engine.generate([encode(tok, "3*3")], 1, greedy)[0][0]
    new = tiny_weights(cfg, seed=5, sharpen=8.0)
    engine.update_weights(new, version="step-1")
    after = engine.generate([encode(tok, "3*3")], 1, greedy)[0][0]
    assert after.weight_version == "step-1" and engine.weight_version == "step-1"
    # the server now samples exactly what a local engine holding the pushed weights samples
    _assert_same_as_local(after, cfg, new, tok, "3*3")
    assert list(after.logprobs) != pytest.approx(list(before.logprobs), abs=LOCAL_MATCH)
    assert (tmp_path / "sync" / "config.json").exists()


def test_weight_update_by_tensor(server, tiny_ckpt):
    import torch

    _, cfg, tok = tiny_ckpt
    # Tensors travel as handles: CUDA IPC to a real (colocated) server, shared memory to the double.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    new = [(n, t.to(device)) for n, t in tiny_weights(cfg, seed=13, sharpen=8.0)]
    engine = make_engine(server, weight_sync=WeightSyncConfig(mode="tensor", bucket_bytes=64 << 10))
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    before = engine.generate([encode(tok, "42")], 1, greedy)[0][0]
    engine.update_weights(iter(new), version="step-2")
    after = engine.generate([encode(tok, "42")], 1, greedy)[0][0]
    assert after.weight_version == "step-2"
    _assert_same_as_local(after, cfg, [(n, t.cpu()) for n, t in new], tok, "42")
    assert list(after.logprobs) != pytest.approx(list(before.logprobs), abs=LOCAL_MATCH)


def _assert_same_as_local(sample, cfg, weights, tok, text):
    """``sample`` (greedy, 4 tokens) is what a local engine with ``weights`` generates for ``text``."""
    from armor_megatron.rollout.local import LocalEngine

    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    local = LocalEngine(cfg, weights, tokenizer=tok).generate([encode(tok, text)], 1, greedy)[0][0]
    assert list(sample.token_ids) == list(local.token_ids)
    assert list(sample.logprobs) == pytest.approx(list(local.logprobs), abs=LOCAL_MATCH)


@pytest.mark.double_only
def test_weight_update_by_tensor_matches_local_engine(server, tiny_ckpt):
    from armor_megatron.rollout.local import LocalEngine

    _, cfg, tok = tiny_ckpt
    # Tiny buckets: several /update_weights_from_tensor calls inside one session.
    engine = make_engine(server, weight_sync=WeightSyncConfig(mode="tensor", bucket_bytes=8 << 10))
    new = tiny_weights(cfg, seed=7, sharpen=8.0)
    engine.update_weights(iter(new), version="step-2")
    assert server.requests["/update_weights_from_tensor"] > 2
    assert server.requests["/begin_weight_update"] == 1
    assert server.requests["/end_weight_update"] == 2  # this session's, and the start-up clearing of a stale one
    greedy = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    remote = engine.generate([encode(tok, "42")], 1, greedy)[0][0]
    local = LocalEngine(cfg, new, tokenizer=tok, weight_version="step-2").generate([encode(tok, "42")], 1, greedy)[0][0]
    assert remote.token_ids == local.token_ids and remote.weight_version == "step-2"
    assert list(remote.logprobs) == pytest.approx(list(local.logprobs), abs=1e-5)


@pytest.mark.double_only
def test_tensor_update_outside_a_session_is_refused(server):
    client = SGLangClient(server.url, retry=FAST_RETRY)
    with pytest.raises(SGLangHTTPError, match="HTTP 400.*weight update session"):
        client.post(
            "/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": None}, retry=False
        )


@pytest.mark.double_only
def test_response_from_stale_weights_is_caught(server, tiny_ckpt, tmp_path):

    _, cfg, tok = tiny_ckpt
    engine = make_engine(server, weight_sync=WeightSyncConfig(mode="tensor"))
    engine.update_weights(tiny_weights(cfg, seed=9), version="step-3")
    # The server dies and comes back from its checkpoint: it answers, but with old weights.
    server.crash()
    server.restart()
    with pytest.raises(StaleWeightsError, match="'default', expected 'step-3'"):
        engine.generate([encode(tok, "1")], 1, SamplingParams(max_new_tokens=2))


@pytest.mark.double_only
def test_distributed_weight_update_over_gloo(server, tiny_ckpt):

    _, cfg, tok = tiny_ckpt
    sync = WeightSyncConfig(mode="distributed", backend="gloo", bucket_bytes=16 << 10, timeout=60)
    engine = make_engine(server, weight_sync=sync)
    new = tiny_weights(cfg, seed=11, sharpen=8.0)
    engine.update_weights(new, version="step-4")
    assert server.requests["/update_weights_from_distributed"] > 1
    got = dict(server.engine.model.named_parameters())
    for name, t in new:
        assert (got[name].detach() == t).all(), name
    engine.shutdown()


@pytest.mark.skipif(
    os.environ.get("ARMOR_SGLANG_NO_MEMORY_SAVER") == "1", reason="server runs without --enable-memory-saver"
)
def test_release_and_resume_memory(server, tiny_ckpt):
    _, cfg, tok = tiny_ckpt
    engine, prompt = make_engine(server), [encode(tok, "1")]
    with engine.released(tags=("kv_cache",)):  # what the trainer does to a colocated reference engine
        pass  # SGLang 0.5.23 neither refuses nor holds /generate while released: the trainer must not send any
    assert engine.generate(prompt, 1, SamplingParams(max_new_tokens=2))[0][0].num_tokens == 2  # weights kept
    with engine.released():  # weights too: they come back as memory, not contents ...
        pass
    engine.update_weights(tiny_weights(cfg, seed=12), version="step-5")  # ... until the next push, as in training
    assert engine.health(timeout=30)
    assert engine.generate(prompt, 1, SamplingParams(max_new_tokens=2))[0][0].num_tokens == 2


@pytest.mark.double_only
def test_released_weights_are_gone_until_the_next_update(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine = make_engine(server)
    with engine.released():
        pass
    with pytest.raises(SGLangHTTPError, match="HTTP 400.*released without --enable-weights-cpu-backup"):
        engine.generate([encode(tok, "1")], 1, SamplingParams(max_new_tokens=2))


@pytest.mark.double_only
def test_release_by_default_frees_every_tag_sglang_has(server):
    """Colocated, the policy engine gives back weights, KV cache and CUDA graphs before the trainer
    comes to the device; a default that keeps the graphs leaves them beside the trainer."""
    from armor_megatron.rollout.testing.sglang_test_server import MEMORY_TAGS as SGLANG_TAGS

    engine = make_engine(server)
    engine.release_memory()
    assert server._released == set(SGLANG_TAGS) == {"weights", "kv_cache", "cuda_graph"}
    engine.resume_memory(tags=("weights",))  # the memory order: weights back, the push, then the rest
    assert server._released == {"kv_cache", "cuda_graph"}
    engine.resume_memory(tags=("kv_cache", "cuda_graph"))  # resuming what is not released kills SGLang's scheduler
    assert not server._released and server.failure is None


@pytest.mark.double_only
def test_generate_timeout_is_an_error_not_a_hang(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    engine = make_engine(server)
    engine.pause()  # generation now blocks on the server
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="1 prompts passed its 1.0s timeout"):
            engine.generate([encode(tok, "1")], 1, SamplingParams(max_new_tokens=2), timeout=1.0)
        # the paused server never answers: only the 1 s timeout can end the call (bound generous for load)
        assert time.monotonic() - start < 45
    finally:
        engine.resume()


@pytest.mark.double_only
def test_two_engines_share_generation_and_all_get_the_weights(tiny_ckpt):
    from armor_megatron.rollout.local import LocalEngine
    from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

    path, cfg, tok = tiny_ckpt
    with (
        SGLangTestServer(LocalEngine.from_pretrained(path, weight_version="default"), model_path=path) as a,
        SGLangTestServer(LocalEngine.from_pretrained(path, weight_version="default"), model_path=path) as b,
    ):
        engine = SGLangEngine(
            [a.url, b.url], retry=FAST_RETRY, weight_sync=WeightSyncConfig(mode="tensor", bucket_bytes=32 << 10)
        )
        engine.generate([encode(tok, str(i)) for i in range(6)], 2, SamplingParams(max_new_tokens=2))
        assert a.requests["/generate"] == b.requests["/generate"] == 3  # round-robin
        engine.update_weights(tiny_weights(cfg, seed=21), version="step-5")
        assert a.engine.weight_version == b.engine.weight_version == "step-5"
        groups = engine.generate([encode(tok, str(i)) for i in range(4)], 1, SamplingParams(max_new_tokens=2))
        assert {s.weight_version for g in groups for s in g} == {"step-5"}


@pytest.mark.double_only
def test_generation_goes_through_the_router_when_there_is_one(tiny_ckpt):
    from armor_megatron.rollout.local import LocalEngine
    from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer

    path, _, tok = tiny_ckpt
    # Stand-in: a second double plays the router's part (sglang-router forwards /generate to workers).
    with (
        SGLangTestServer(LocalEngine.from_pretrained(path, weight_version="default")) as worker,
        SGLangTestServer(LocalEngine.from_pretrained(path, weight_version="default")) as router,
    ):
        engine = SGLangEngine([worker.url], router_url=router.url, retry=FAST_RETRY)
        engine.generate([encode(tok, str(i)) for i in range(3)], 1, SamplingParams(max_new_tokens=1))
        assert router.requests["/generate"] == 3 and "/generate" not in worker.requests
        engine.pause()
        assert "/pause_generation" in worker.requests and "/pause_generation" not in router.requests
        engine.resume()
