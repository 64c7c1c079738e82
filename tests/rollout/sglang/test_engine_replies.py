"""Malformed ``/generate`` replies, from a scripted HTTP server on 127.0.0.1: what is transient is
retried, what is wrong is refused in one line naming the server and the request, nothing crashes
deeper in the trainer with an error that names nothing."""

import http.server
import json
import logging
import threading

import pytest

from armor_megatron.errors import UserInputError
from armor_megatron.rollout.engine import EngineReplyError, EngineUnavailableError, SamplingParams
from armor_megatron.rollout.sglang.client import RetryPolicy, excerpt
from armor_megatron.rollout.sglang.engine import SGLangEngine

pytestmark = pytest.mark.timeout(60)
VOCAB = 64
RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, multiplier=1.0, max_backoff=0.01)


def output(ids=(5, 6), logprobs=(-0.5, -1.0), rid="req-7"):
    rows = [[lp, t, None] for lp, t in zip(logprobs, ids)]
    meta = {"id": rid, "finish_reason": {"type": "length"}, "weight_version": "v1", "output_token_logprobs": rows}
    return {"text": "ab", "output_ids": list(ids), "meta_info": meta}


class ScriptedServer:
    """Answers each ``/generate`` with the next scripted ``(status, body bytes)``, then with a good
    output; every other path with ``{}``. ``generate_calls`` counts the ``/generate`` requests."""

    def __init__(self):
        self.script: list[tuple[int, bytes]] = []
        self.generate_calls = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, body = 200, b"{}"
                if self.path == "/generate":
                    outer.generate_calls += 1
                    status, body = outer.script.pop(0) if outer.script else (200, json.dumps(output()).encode())
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = ScriptedServer()
    yield s
    s.close()


def generate(server, n=1):
    engine = SGLangEngine([server.url], weight_version="v1", retry=RETRY, request_timeout=20.0, vocab_size=VOCAB)
    try:
        return engine.generate([[1, 2, 3]], n=n, sampling=SamplingParams(max_new_tokens=2))
    finally:
        engine._pool.shutdown()


@pytest.mark.parametrize(
    "body",
    [json.dumps(output()).encode()[:40], b"", b"<html>502 Bad Gateway</html>"],
    ids=["truncated-json", "empty-body", "not-json"],
)
def test_a_truncated_or_empty_reply_is_retried(server, body):
    server.script = [(200, body)]
    groups = generate(server)
    assert groups[0][0].token_ids == (5, 6) and server.generate_calls == 2


def test_a_reply_that_stays_truncated_ends_in_one_line_naming_the_server(server):
    server.script = [(200, b'{"text": "ab", "output_ids": [5')] * RETRY.max_attempts
    with pytest.raises(EngineUnavailableError) as err:
        generate(server)
    line = str(err.value)
    assert server.url in line and "not JSON (truncated?)" in line and "\n" not in line
    assert server.generate_calls == RETRY.max_attempts


@pytest.mark.parametrize(
    "reply, expected",
    [
        (output(ids=(5, VOCAB)), f"token id {VOCAB} at position 1 is outside the vocabulary [0, {VOCAB})"),
        (output(ids=(-3, 6)), f"token id -3 at position 0 is outside the vocabulary [0, {VOCAB})"),
        (output(logprobs=(50.0, -1.0)), "50 at position 0 is not a log-probability (must be <= 0, tolerance 0.001)"),
        (output(logprobs=(-0.5,)), "1 output_token_logprobs for 2 output_ids"),
        (output(ids=(5, "6")), 'output_ids is [5, "6"], not a list of token ids'),
        (
            {**output(), "meta_info": {"id": "req-7", "output_token_logprobs": "x"}},
            "no meta_info.output_token_logprobs",
        ),
        ([output(), 3], "answered [{"),
        (17, "answered 17: expected an output object or a list of them"),
    ],
    ids=[
        "id-beyond-vocab",
        "negative-id",
        "logprob-plus-50",
        "short-logprobs",
        "id-not-int",
        "rows-not-list",
        "list-with-number",
        "number",
    ],
)
def test_an_unusable_reply_is_refused_in_one_line_naming_server_and_request(server, reply, expected):
    server.script = [(200, json.dumps(reply).encode())]
    with pytest.raises(EngineReplyError) as err:
        generate(server)
    line = str(err.value)
    assert expected in line and server.url in line and "\n" not in line, line
    if isinstance(reply, dict):
        assert "request req-7 sample 0 of prompt 0" in line
    assert isinstance(err.value, UserInputError)  # one line and exit 2 from the command-line tools
    assert server.generate_calls == 1  # not transient: not asked again


def test_a_small_rounding_above_zero_is_accepted(server):
    server.script = [(200, json.dumps(output(logprobs=(5e-4, -1.0))).encode())]
    assert generate(server)[0][0].logprobs == (5e-4, -1.0)


def test_a_5xx_html_page_is_quoted_as_a_short_single_line_in_each_retry_warning(server, caplog):
    page = "<html>\n<body>" + "Bad Gateway " * 8_000 + "</body>\n</html>"  # ~100 KB, a proxy's error page
    server.script = [(502, page.encode())] * 2
    with caplog.at_level(logging.WARNING, logger="armor_megatron.rollout.sglang.client"):
        assert generate(server)[0][0].token_ids == (5, 6)
    warnings = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert len(warnings) == 2
    for line in warnings:
        assert "\n" not in line and len(line) < 500 and f"({len(page)} characters)" in line, line[:600]


def test_excerpt_keeps_short_text_and_cuts_long_text_with_its_length():
    assert excerpt("  a\n  b ") == "a b"
    assert excerpt("") == "(empty body)"
    assert excerpt("x" * 300, limit=10) == "xxxxxxxxxx... (300 characters)"
