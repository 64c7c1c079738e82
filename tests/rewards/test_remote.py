"""The remote judge (reward.remote) against real HTTP servers started here: faults, retries, limits, the key."""

import importlib.util
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from armor_megatron.rewards import score_batch
from armor_megatron.rewards.registry import registered_verifiers
from armor_megatron.rewards.remote import RemoteJudge, RemoteJudgeError, RemoteJudgeSettings, configure_remote_judge

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Judge:
    """A judge on a loopback port answering each request with the next scripted reply.

    A reply is ``(status, body)``, ``"slow"`` (no answer for 2 s) or ``"exact"`` (1 when the response
    equals the ground truth); the last reply repeats. ``requests`` records (headers, body) of each.
    """

    def __init__(self, *replies, delay_s: float = 0.0):
        self.replies, self.delay_s = list(replies), delay_s
        self.requests: list[tuple[dict, dict]] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.requests.append((dict(self.headers), body))
                    reply = judge.replies[min(len(judge.requests), len(judge.replies)) - 1]
                    judge.in_flight += 1
                    judge.most_in_flight = max(judge.most_in_flight, judge.in_flight)
                time.sleep(judge.delay_s)
                with judge.lock:  # done before the reply is sent: the client may send its next one at once
                    judge.in_flight -= 1
                if reply == "slow":
                    time.sleep(2.0)
                    return
                if reply == "exact":
                    scores = [float(i["response"] == i["ground_truth"]) for i in body["items"]]
                    reply = (200, {"scores": scores, "details": [{"seen": 1.0} for _ in scores]})
                status, payload, *headers = reply
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                for name, value in (headers[0] if headers else {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802 - what a client following a redirect of its POST sends
                with judge.lock:
                    judge.requests.append((dict(self.headers), None))
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge():
    started = []

    def start(*replies, **kw):
        started.append(Judge(*replies, **kw))
        return started[-1]

    yield start
    for j in started:
        j.close()


def _score(url, responses=("a", "b"), truths=("a", "x"), **settings):
    settings = {"backoff_s": 0.0, "retries": 2, "timeout_s": 5.0, **settings}
    n = len(responses)
    return RemoteJudge(RemoteJudgeSettings(url, **settings))(
        list(responses), list(truths), ["p"] * n, ["src"] * n, [{"i": i} for i in range(n)]
    )


def test_scores_details_and_the_protocols_items(judge, monkeypatch):
    j = judge("exact")
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    results = _score(j.url, api_key_env="JUDGE_KEY")
    assert [(r.score, r.breakdown) for r in results] == [(1.0, {"seen": 1.0}), (0.0, {"seen": 1.0})]
    headers, body = j.requests[0]
    assert headers["Authorization"] == "Bearer s3cret" and headers["Content-Type"] == "application/json"
    assert body == {
        "items": [
            {"prompt": "p", "response": "a", "ground_truth": "a", "data_source": "src", "extra_info": {"i": 0}},
            {"prompt": "p", "response": "b", "ground_truth": "x", "data_source": "src", "extra_info": {"i": 1}},
        ]
    }


def test_no_key_header_without_api_key_env_and_a_missing_variable_is_one_line(judge, monkeypatch):
    j = judge("exact")
    _score(j.url)
    assert "Authorization" not in j.requests[0][0]
    monkeypatch.delenv("NO_SUCH_JUDGE_KEY", raising=False)
    with pytest.raises(RemoteJudgeError, match=r"environment variable NO_SUCH_JUDGE_KEY .* is not set"):
        RemoteJudge(RemoteJudgeSettings(j.url, api_key_env="NO_SUCH_JUDGE_KEY"))


def test_server_errors_are_retried_then_succeed(judge):
    j = judge((500, b"busy"), (503, b"restarting"), "exact")
    assert [r.score for r in _score(j.url)] == [1.0, 0.0]
    assert len(j.requests) == 3


@pytest.mark.parametrize(
    "reply, message",
    [
        ((500, b"Internal Server Error\ntraceback..."), "HTTP 500: Internal Server Error"),
        ((200, b"<html>oops</html>"), "reply is not JSON: b'<html>oops</html>'"),
        ((200, {"score": [1, 0]}), 'reply has no "scores" list: b\'{"score": [1, 0]}\''),
        ((200, {"scores": [1.0]}), "reply holds 1 scores for 2 items"),
        ((200, {"scores": [1.0, "yes"]}), "score 1 is 'yes', not a finite number"),
        ((200, {"scores": [1.0, 0.0], "details": [{}]}), 'reply\'s "details" is not a list of 2 mappings'),
    ],
    ids=["500", "not_json", "no_scores", "wrong_count", "not_a_number", "details"],
)
def test_a_failing_judge_fails_in_one_line_after_its_retries_never_scoring_0(judge, reply, message):
    j = judge(reply)
    with pytest.raises(RemoteJudgeError) as err:
        _score(j.url, retries=2)
    line = str(err.value)
    assert line == f"remote judge {j.url} failed 3 attempts (reward.remote.retries=2): {message}", line
    assert len(j.requests) == 3


def test_a_slow_judge_times_out_and_a_down_one_is_refused(judge):
    j = judge("slow")
    with pytest.raises(RemoteJudgeError, match=r"failed 2 attempts .*: no reply within reward.remote.timeout_s=0.2s"):
        _score(j.url, retries=1, timeout_s=0.2)
    down = judge("exact")
    down.close()
    with pytest.raises(RemoteJudgeError, match=r"failed 1 attempt \(reward.remote.retries=0\): .*Connection ?Refused"):
        _score(down.url, retries=0)


def test_a_refused_request_fails_at_once(judge):
    j = judge((401, b"bad key"))
    with pytest.raises(RemoteJudgeError, match=r"refused the request: HTTP 401: bad key$"):
        _score(j.url, retries=3)
    assert len(j.requests) == 1


def test_a_redirecting_judge_is_refused_and_the_key_goes_nowhere_else(judge, monkeypatch):
    elsewhere = judge("exact")
    j = judge((302, b"moved", {"Location": elsewhere.url}))
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    with pytest.raises(RemoteJudgeError, match=r"refused the request: HTTP 302: moved$"):
        _score(j.url, api_key_env="JUDGE_KEY", retries=3)
    assert len(j.requests) == 1 and elsewhere.requests == []


def test_batches_are_split_and_the_concurrency_limit_holds_over_all_calls(judge):
    j = judge("exact", delay_s=0.05)
    remote = RemoteJudge(RemoteJudgeSettings(j.url, concurrency=2, batch_size=2, backoff_s=0.0))
    responses = [str(i) for i in range(10)]
    truths = [str(i) if i % 3 == 0 else "-" for i in range(10)]
    out: list = []
    calls = [
        threading.Thread(target=lambda: out.append(remote(responses, truths, [None] * 10, [None] * 10, [None] * 10)))
        for _ in range(3)
    ]
    for t in calls:
        t.start()
    for t in calls:
        t.join(30)
    assert len(j.requests) == 15 and all(len(body["items"]) == 2 for _, body in j.requests)
    assert j.most_in_flight <= 2
    assert all([r.score for r in results] == [float(i % 3 == 0) for i in range(10)] for results in out)


def test_the_remote_verifier_scores_through_score_batch_with_the_row_fields(judge):
    j = judge("exact")
    configure_remote_judge(RemoteJudgeSettings(j.url, backoff_s=0.0))
    try:
        fields = [{"prompt": "q", "data_source": "d", "extra_info": None, "row": {"q": 1}}] * 2
        results = score_batch(["a", "b"], ["a", "a"], "remote", fields=fields)
        assert [r.score for r in results] == [1.0, 0.0]
        assert j.requests[0][1]["items"][1] == {
            "prompt": "q",
            "response": "b",
            "ground_truth": "a",
            "data_source": "d",
            "extra_info": None,
        }
    finally:
        configure_remote_judge(None)
    assert "remote" not in registered_verifiers()
    with pytest.raises(ValueError, match="verifier 'remote' is the judge at reward.remote.url, which is not set"):
        score_batch(["a"], ["a"], "remote")


def _example_server():
    spec = importlib.util.spec_from_file_location("judge_server", os.path.join(ROOT, "examples", "judge_server.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_judge_server_serves_a_verifier_through_reward_remote():
    server = _example_server().make_server("tests.rewards.row_verifiers:compute_score", api_key="k")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        os.environ["EXAMPLE_JUDGE_KEY"] = "k"
        results = RemoteJudge(RemoteJudgeSettings(url, api_key_env="EXAMPLE_JUDGE_KEY", backoff_s=0.0))(
            ["#### 12", "#### 13"], ["12", "12"], ["q", "q"], ["openai/gsm8k"] * 2, [{"split": "train"}, None]
        )
        assert [r.score for r in results] == [1.5, 0.0]  # verl's compute_score, with extra_info, off the trainer
        with pytest.raises(
            RemoteJudgeError,
            match=r"refused the request: HTTP 422: verifier '.*:compute_score' raised NotImplementedError: reward function",
        ):
            RemoteJudge(RemoteJudgeSettings(url, api_key_env="EXAMPLE_JUDGE_KEY"))(
                ["x"], ["1"], ["q"], ["other"], [None]
            )
        os.environ["EXAMPLE_JUDGE_KEY"] = "wrong"
        with pytest.raises(RemoteJudgeError, match="HTTP 401: .*missing or wrong API key"):
            RemoteJudge(RemoteJudgeSettings(url, api_key_env="EXAMPLE_JUDGE_KEY"))(["x"], ["1"], ["q"], [None], [None])
    finally:
        os.environ.pop("EXAMPLE_JUDGE_KEY", None)
        server.shutdown()
        server.server_close()
