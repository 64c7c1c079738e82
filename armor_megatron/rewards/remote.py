"""A judge served over HTTP (``reward.remote``): the verifier ``remote``, a batch verifier that posts to a URL.

Protocol (JSON, one ``POST`` to ``url`` per chunk of at most ``batch_size`` responses)::

    request  {"items": [{"prompt": ..., "response": "...", "ground_truth": ..., "data_source": ..., "extra_info": ...}, ...]}
    reply    200 {"scores": [0.0, 1.0, ...], "details": [{"correct": 1.0}, ...]}

``scores`` holds one finite number per item, in order; ``details`` (optional) one mapping per
item whose numeric entries become the response's breakdown. ``prompt`` is the row's prompt (a
string or chat messages); ``data_source`` and ``extra_info`` are the row's columns of these names,
null when absent. With ``api_key_env`` set, the environment variable of that name holds a key
sent as ``Authorization: Bearer <key>``; the key itself is never in the config.

At most ``concurrency`` requests are in flight at once, over every call of this process. A
request that fails (connection refused or reset, no reply within ``timeout_s``, HTTP 5xx, 408 or
429, a reply that is not JSON or holds another number of scores than items) is retried after
``backoff_s · 2^attempt`` seconds, ``retries`` times; then :class:`RemoteJudgeError` fails the step
in one line naming the URL and the last failure. Any other HTTP 4xx (a refused key, a request the
judge does not understand) fails at once: retrying cannot help. A judge never silently scores 0.

The error is a UserInputError (a one-line message, exit 2, no traceback): the judge and its
address are the user's to fix; the HTTP client's traceback would not help.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import numbers
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from armor_megatron.errors import UserInputError
from armor_megatron.rewards.isolated import CallsInterrupted, calls_interrupted
from armor_megatron.rewards.result import RewardResult

NAME = "remote"
"""The verifier name ``reward.remote`` registers (``reward.verifier: remote``, or a row's ``type``)."""


class RemoteJudgeError(UserInputError):
    """The remote judge failed a request after its retries, refused it, or is misconfigured."""


class _Retry(Exception):
    """One failed attempt that a later one may fix."""


@dataclasses.dataclass(frozen=True)
class RemoteJudgeSettings:
    """Where the judge is and how it is called (``reward.remote``; docs/rewards.md)."""

    url: str
    concurrency: int = 4
    timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 1.0
    batch_size: int = 16
    api_key_env: str | None = None


class RemoteJudge:
    """The ``remote`` verifier: scores a batch of responses through the judge at ``settings.url``."""

    probe_at_start = True  # --check and the start-up probe call it on the first rows, as a user verifier

    def __init__(self, settings: RemoteJudgeSettings) -> None:
        self.settings = settings
        self._slots = threading.BoundedSemaphore(settings.concurrency)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if settings.api_key_env:
            key = os.environ.get(settings.api_key_env)
            if not key:
                raise RemoteJudgeError(
                    f"environment variable {settings.api_key_env} (reward.remote.api_key_env) is not set; "
                    "it holds the judge's API key"
                )
            self._headers["Authorization"] = f"Bearer {key}"

    def __call__(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        prompts: Sequence[Any],
        data_sources: Sequence[Any],
        extra_infos: Sequence[Any],
    ) -> list[RewardResult]:
        """One RewardResult per response, in order: chunks of ``batch_size`` posted ``concurrency`` at once."""
        items = [
            {"prompt": p, "response": r, "ground_truth": g, "data_source": d, "extra_info": e}
            for r, g, p, d, e in zip(responses, ground_truths, prompts, data_sources, extra_infos)
        ]
        size = self.settings.batch_size
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        if len(chunks) <= 1:
            return [r for chunk in chunks for r in self.post(chunk)]
        with ThreadPoolExecutor(min(self.settings.concurrency, len(chunks)), thread_name_prefix="judge") as pool:
            return [r for scored in pool.map(self.post, chunks) for r in scored]

    def post(self, items: list[dict[str, Any]]) -> list[RewardResult]:
        """Score ``items`` in one request, retried as the module docstring says."""
        s = self.settings
        try:
            body = json.dumps({"items": items}).encode()
        except (TypeError, ValueError) as err:
            raise RemoteJudgeError(f"remote judge {s.url}: row fields are not JSON ({err})") from None
        last = ""
        for attempt in range(s.retries + 1):
            if attempt:
                self._sleep(s.backoff_s * 2 ** (attempt - 1))
            try:
                with self._slots:
                    return self._attempt(body, len(items))
            except _Retry as err:
                last = str(err)
        tries = f"{s.retries + 1} attempt{'s' if s.retries else ''}"
        raise RemoteJudgeError(f"remote judge {s.url} failed {tries} (reward.remote.retries={s.retries}): {last}")

    def _attempt(self, body: bytes, n: int) -> list[RewardResult]:
        s = self.settings
        if calls_interrupted():
            raise CallsInterrupted("reward calls were stopped (a preemption signal)")
        request = urllib.request.Request(s.url, data=body, headers=self._headers, method="POST")
        try:
            with _NO_REDIRECTS.open(request, timeout=s.timeout_s) as reply:
                raw = reply.read()
        except urllib.error.HTTPError as err:
            detail = _first_line(err.read())
            if err.code >= 500 or err.code in (408, 429):
                raise _Retry(f"HTTP {err.code}{detail}") from None
            raise RemoteJudgeError(f"remote judge {s.url} refused the request: HTTP {err.code}{detail}") from None
        except TimeoutError:
            raise _Retry(f"no reply within reward.remote.timeout_s={s.timeout_s:g}s") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, OSError) as err:
            reason = err.reason if isinstance(err, urllib.error.URLError) else err
            if isinstance(reason, TimeoutError):
                raise _Retry(f"no reply within reward.remote.timeout_s={s.timeout_s:g}s") from None
            raise _Retry(f"{type(reason).__name__}: {reason}") from None
        return _parse(raw, n)

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if calls_interrupted():
                raise CallsInterrupted("reward calls were stopped (a preemption signal)")
            time.sleep(min(left, 0.1))


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """A judge that redirects is refused (HTTP 3xx): the API key is never sent on to another URL."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_NO_REDIRECTS = urllib.request.build_opener(_RefuseRedirects)


def _parse(raw: bytes, n: int) -> list[RewardResult]:
    """The reply's scores (and details) as RewardResults; _Retry when it is not a reply of ``n`` scores."""
    try:
        reply = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _Retry(f"reply is not JSON: {raw[:60]!r}") from None
    scores = reply.get("scores") if isinstance(reply, dict) else None
    if not isinstance(scores, list):
        raise _Retry(f'reply has no "scores" list: {raw[:60]!r}')
    if len(scores) != n:
        raise _Retry(f"reply holds {len(scores)} scores for {n} items")
    details = reply.get("details")
    if details is None:
        details = [{}] * n
    if not isinstance(details, list) or len(details) != n or not all(isinstance(d, Mapping) for d in details):
        raise _Retry(f'reply\'s "details" is not a list of {n} mappings')
    out = []
    for i, (score, detail) in enumerate(zip(scores, details)):
        if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
            raise _Retry(f"score {i} is {score!r}, not a finite number")
        breakdown = {
            str(k): float(v)
            for k, v in detail.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
        }
        out.append(RewardResult(float(score), breakdown))
    return out


def _first_line(raw: bytes) -> str:
    """``": <text>"``: an error body's ``{"error": text}`` (or ``{"error": {"message": text}}``), else its first line."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        error = json.loads(text).get("error")
        text = str(error.get("message") if isinstance(error, dict) else error or text)
    except (ValueError, AttributeError):
        pass
    lines = text.splitlines()
    return f": {lines[0][:200]}" if lines else ""


def configure_remote_judge(settings: RemoteJudgeSettings | None) -> None:
    """Register the ``remote`` verifier for ``settings`` (``reward.remote``), or remove it for None.

    A missing API key environment variable raises RemoteJudgeError; no request is made here.
    """
    from armor_megatron.rewards.registry import register_verifier, registered_verifiers, unregister_verifier

    if settings is None:
        if NAME in registered_verifiers():
            unregister_verifier(NAME)
        return
    register_verifier(NAME, replace=True)(RemoteJudge(settings))
