"""Abort by request id and continuation from token ids, against the SGLang TEST DOUBLE with decode time."""

import threading
import time

import pytest

from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.sglang.client import SGLangClient, parse_output
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import encode

from .conftest import FAST_RETRY

pytestmark = [pytest.mark.timeout(120), pytest.mark.double_only]

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "n": 1}


@pytest.fixture
def slow_server(decoding_double):
    """12 tokens take 1.2 s: long enough to abort midway."""
    return decoding_double


def _in_thread(fn, *args, **kw):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn(*args, **kw)), daemon=True)
    thread.start()
    return thread, box


def _wait_decoding(server, rid_prefix, count):
    deadline = time.monotonic() + 30
    while sum(r.startswith(rid_prefix) for r in server.decoding()) < count:
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.005)


def test_abort_returns_tokens_so_far_and_continuation_completes_them(slow_server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    client = SGLangClient(slow_server.url, retry=FAST_RETRY, request_timeout=60)
    prompt = encode(tok, "1+2=")
    [whole] = client.generate(prompt, GREEDY)  # uninterrupted, for reference
    full = parse_output(whole, 0, True)
    assert len(full.token_ids) == 12 and full.finish_reason == "length"

    thread, box = _in_thread(client.generate, prompt, GREEDY, rid="req-a")
    _wait_decoding(slow_server, "req-a", 1)
    client.abort("req-a")
    thread.join(30)
    [out] = box["out"]
    assert out["meta_info"]["id"] == "req-a"
    assert out["meta_info"]["finish_reason"]["type"] == "abort"  # returned as it is, not retried
    part = parse_output(out, 0, True)
    k = len(part.token_ids)
    assert k < 12 and part.finish_reason == "abort"
    assert part.token_ids == full.token_ids[:k] and part.logprobs == pytest.approx(full.logprobs[:k], abs=1e-5)
    assert out["meta_info"]["completion_tokens"] == k
    assert slow_server.requests["/generate"] == 2

    [rest] = client.generate_continuation(prompt, part.token_ids, GREEDY, rid="req-a-cont")
    cont = parse_output(rest, 0, True)
    assert cont.finish_reason == "length" and rest["meta_info"]["prompt_tokens"] == len(prompt) + k
    assert part.token_ids + cont.token_ids == full.token_ids
    assert part.logprobs + cont.logprobs == pytest.approx(full.logprobs, abs=1e-4)


def test_abort_matches_rids_by_prefix_and_leaves_the_others(slow_server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    client = SGLangClient(slow_server.url, retry=FAST_RETRY, request_timeout=60)
    short = {**GREEDY, "max_new_tokens": 6}
    batch, batch_box = _in_thread(client.generate, encode(tok, "7"), [GREEDY, GREEDY], rid="grp1")
    kept, kept_box = _in_thread(client.generate, encode(tok, "7"), short, rid="grp2")
    _wait_decoding(slow_server, "grp1_", 2)  # a batch sent with one rid runs as <rid>_<i>
    _wait_decoding(slow_server, "grp2", 1)
    client.abort("grp1")
    client.abort("no-such-request")  # ignored, as SGLang ignores an unknown rid
    batch.join(30)
    kept.join(30)
    assert [o["meta_info"]["id"] for o in batch_box["out"]] == ["grp1_0", "grp1_1"]
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in batch_box["out"])
    [other] = kept_box["out"]
    assert other["meta_info"]["finish_reason"]["type"] == "length" and len(other["output_ids"]) == 6


def test_abort_needs_a_rid_and_a_continuation_must_leave_room(slow_server):
    client = SGLangClient(slow_server.url, retry=FAST_RETRY)
    with pytest.raises(ValueError, match="rid or abort_all"):
        client.abort("")
    with pytest.raises(ValueError, match="nothing of max_new_tokens"):
        client.generate_continuation([1], [2] * 12, GREEDY)


@pytest.fixture
def one_slot(tiny_ckpt):
    """A double that runs one sequence at a time (``--max-running-requests 1``), 50 ms per token."""
    path, _, _ = tiny_ckpt
    engine = LocalEngine.from_pretrained(path, weight_version="step-0")
    with SGLangTestServer(engine, model_path=path, seconds_per_token=0.05, max_running_requests=1) as server:
        yield server


def _wait_queued(server, rid):
    deadline = time.monotonic() + 30
    while rid not in server.waiting():
        assert time.monotonic() < deadline, f"{rid} never reached the waiting queue"
        time.sleep(0.005)


def test_requests_beyond_max_running_requests_wait_for_a_slot(one_slot, tiny_ckpt):
    _, _, tok = tiny_ckpt
    client = SGLangClient(one_slot.url, retry=FAST_RETRY, request_timeout=60)
    eight = {**GREEDY, "max_new_tokens": 8}  # 0.4 s of decoding each
    begin = time.monotonic()
    first, first_box = _in_thread(client.generate, encode(tok, "1+2="), eight, rid="first")
    _wait_decoding(one_slot, "first", 1)
    second, second_box = _in_thread(client.generate, encode(tok, "1+2="), eight, rid="second")
    _wait_queued(one_slot, "second")
    assert one_slot.decoding() == ["first"]
    first.join(30)
    second.join(30)
    assert time.monotonic() - begin >= 0.8  # the second decoded after the first, not beside it
    [a], [b] = first_box["out"], second_box["out"]
    assert a["output_ids"] == b["output_ids"] and len(b["output_ids"]) == 8
    assert b["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_in_the_waiting_queue_returns_no_tokens(one_slot, tiny_ckpt):
    _, _, tok = tiny_ckpt
    client = SGLangClient(one_slot.url, retry=FAST_RETRY, request_timeout=60)
    running, running_box = _in_thread(client.generate, encode(tok, "7"), GREEDY, rid="running")
    _wait_decoding(one_slot, "running", 1)
    queued, queued_box = _in_thread(client.generate, encode(tok, "7"), GREEDY, rid="queued")
    _wait_queued(one_slot, "queued")
    client.abort("queued")
    queued.join(30)
    assert running.is_alive()  # answered while the running request still decodes
    [out] = queued_box["out"]
    assert out["meta_info"]["id"] == "queued"
    assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["output_token_logprobs"] == []
    running.join(30)
    [out] = running_box["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 12
    assert one_slot.waiting() == [] and one_slot.decoding() == []
