"""HTTP client of one SGLang server (0.5.x), standard library only.

Retries with exponential backoff (``initial_backoff · multiplier^k``, capped at
``max_backoff``) on connection errors, timeouts, HTTP 5xx and generations that come back
aborted; 4xx errors are the caller's fault and raise at once. When the retry budget is spent
the client raises :class:`EngineUnavailableError` naming the server, the attempts and the
last error, so a dead server is a clear error and never a hang.

SGLang answers errors in three body shapes, all reduced to one line by :func:`error_message`:
``{"error": "<text>"}``, ``{"error": {"message": ...}}`` and the OpenAI-style
``{"object": "error", "message": ..., "type": ..., "param": ..., "code": ...}``.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from armor_megatron.rollout.engine import EngineUnavailableError, RolloutError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` tries in all; waits initial_backoff, ×multiplier each time, ≤ max_backoff."""

    max_attempts: int = 6
    initial_backoff: float = 0.5
    multiplier: float = 2.0
    max_backoff: float = 8.0

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))


class SGLangHTTPError(RolloutError):
    """The server answered with an HTTP error status."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"{url} -> HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class _Retryable(Exception):
    """A failure worth another attempt (connection, 5xx, abort)."""


def error_message(body: Any) -> str:
    """One line from any of SGLang's three error body shapes (or the raw text)."""
    if isinstance(body, (bytes, str)):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            body = json.loads(text)
        except ValueError:
            return text.strip() or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, str):
            return err
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if body.get("object") == "error" and "message" in body:
            return str(body["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return json.dumps(body)


class SGLangClient:
    """Requests to one server (or one router) at ``url``, e.g. ``http://127.0.0.1:30000``."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        request_timeout: float = 600.0,
        retry: RetryPolicy = RetryPolicy(),
    ):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.retry = retry

    def __repr__(self):
        return f"SGLangClient({self.url!r})"

    # ---- transport ---------------------------------------------------------------------

    def _once(self, method: str, path: str, body: Any, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            msg = error_message(e.read())
            if e.code >= 500:
                raise _Retryable(f"HTTP {e.code}: {msg}") from e
            raise SGLangHTTPError(self.url + path, e.code, msg) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or e
            raise _Retryable(f"{type(reason).__name__}: {reason}") from e
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode("utf-8", "replace")

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float | None = None,
        retry: bool = True,
        check=None,
    ) -> Any:
        """Send one request, retrying per :attr:`retry`; returns the decoded JSON (or text).

        ``timeout`` bounds the whole call including retries (default: ``request_timeout``).
        ``check(result)`` may raise :class:`_Retryable` to retry a successful HTTP answer
        (used for aborted generations).
        """
        budget = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        attempts = self.retry.max_attempts if retry else 1
        start, last = time.monotonic(), None
        for attempt in range(1, attempts + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                result = self._once(method, path, body, remaining)
                if check is not None:
                    check(result)
                return result
            except _Retryable as e:
                last = e
                wait = min(self.retry.backoff(attempt), max(0.0, deadline - time.monotonic()))
                if attempt < attempts and wait > 0:
                    logger.warning(
                        "%s%s failed (attempt %d/%d: %s); retrying in %.1fs", self.url, path, attempt, attempts, e, wait
                    )
                    time.sleep(wait)
        raise EngineUnavailableError(
            f"SGLang server {self.url} failed {path}: {attempt} attempt(s) in {time.monotonic() - start:.1f}s, last error: {last}"
        )

    def get(self, path: str, timeout: float | None = None, retry: bool = True) -> Any:
        """``GET path``; the decoded JSON reply."""
        return self.request("GET", path, None, timeout=timeout, retry=retry)

    def post(self, path: str, body: Any = None, timeout: float | None = None, retry: bool = True) -> Any:
        """``POST path`` with a JSON ``body``; the decoded JSON reply."""
        return self.request("POST", path, {} if body is None else body, timeout=timeout, retry=retry)

    # ---- endpoints ---------------------------------------------------------------------

    def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict | list[dict],
        return_logprob: bool = True,
        timeout: float | None = None,
    ) -> list:
        """``POST /generate`` for one prompt; returns its raw outputs (dicts), retrying aborted ones.

        ``sampling_params``: one dict (its ``n`` samples), or a list of dicts, one per sample:
        then the prompt is sent as a batch of ``len(list)`` copies, each with its own params.
        """
        ids = [int(t) for t in input_ids]
        body: dict[str, Any] = {
            "input_ids": [ids] * len(sampling_params) if isinstance(sampling_params, list) else ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if return_logprob:
            body["logprob_start_len"] = -1
        result = self.request("POST", "/generate", body, timeout=timeout, check=_raise_if_aborted)
        return result if isinstance(result, list) else [result]

    def health(self, generate: bool = False, timeout: float = 10.0) -> bool:
        """True if ``/health`` (or ``/health_generate``) answers 200 within ``timeout``; never raises."""
        try:
            self.request("GET", "/health_generate" if generate else "/health", timeout=timeout, retry=False)
            return True
        except RolloutError:
            return False

    def weight_version(self, timeout: float | None = None) -> str:
        """The server's current ``weight_version`` (``/model_info`` in newer SGLang, else ``/get_weight_version``)."""
        for path in ("/model_info", "/get_weight_version"):
            try:
                info = self.get(path, timeout=timeout)
            except SGLangHTTPError as e:
                if e.status == 404:
                    continue
                raise
            if isinstance(info, dict) and "weight_version" in info:
                return str(info["weight_version"])
        raise RolloutError(f"SGLang server {self.url} reports no weight_version")


def _raise_if_aborted(result: Any) -> None:
    outputs = result if isinstance(result, list) else [result]
    for out in outputs:
        reason = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise _Retryable(f"generation aborted: {reason.get('message', '')}")


def parse_output(out: dict, prompt_index: int, return_logprob: bool):
    """One SGLang ``/generate`` output -> :class:`~armor_megatron.rollout.engine.Sample`.

    Reads ``output_ids``, ``text`` and ``meta_info`` {``finish_reason.type``, ``weight_version``,
    ``output_token_logprobs`` = [[logprob, token_id, text], ...]}; the logprob rows must name
    the same tokens as ``output_ids``. A ``null`` logprob is SGLang's JSON for a non-finite one
    (its encoder writes -inf and NaN as null) and reads as -inf. A response generated across a
    weight update carries ``weight_versions`` spans [{version, start, end}, ...] and, as
    ``weight_version``, only the last span's: its version here names every span (``"a->b"``),
    so :func:`~armor_megatron.rollout.engine.check_versions` refuses it as off-policy.
    """
    from armor_megatron.rollout.engine import Sample

    meta = out.get("meta_info") or {}
    token_ids = tuple(int(t) for t in out.get("output_ids") or ())
    reason = meta.get("finish_reason") or {}
    reason = reason.get("type") if isinstance(reason, dict) else str(reason)
    logprobs = None
    if return_logprob:
        rows = meta.get("output_token_logprobs")
        if rows is None:
            raise RolloutError(f"output of prompt {prompt_index} has no meta_info.output_token_logprobs")
        if [int(r[1]) for r in rows] != list(token_ids):
            raise RolloutError(f"output of prompt {prompt_index}: output_token_logprobs tokens differ from output_ids")
        logprobs = tuple(float("-inf") if r[0] is None else float(r[0]) for r in rows)
    return Sample(
        prompt_index=prompt_index,
        token_ids=token_ids,
        text=out.get("text", ""),
        logprobs=logprobs,
        finish_reason=reason or "length",
        weight_version=_weight_version(meta),
    )


def _weight_version(meta: dict) -> str:
    spans = [str(s["version"]) for s in meta.get("weight_versions") or () if isinstance(s, dict) and "version" in s]
    if len(set(spans)) > 1:
        return "->".join(spans)
    return str(meta.get("weight_version", "default"))
