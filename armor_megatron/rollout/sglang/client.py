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
from collections.abc import Callable, Sequence
from typing import Any

from armor_megatron.rollout.engine import (
    FINISH_REASONS,
    EngineReplyError,
    EngineUnavailableError,
    RolloutError,
    Sample,
    check_sample,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` tries in all; waits initial_backoff, ×multiplier each time, ≤ max_backoff."""

    max_attempts: int = 6
    initial_backoff: float = 0.5
    multiplier: float = 2.0
    max_backoff: float = 8.0

    def __post_init__(self) -> None:
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


EXCERPT_CHARS = 200
"""Characters of an error body a message quotes (a proxy's HTML error page runs to 100 KB)."""


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` on one line (runs of whitespace made one blank), cut to ``limit`` characters with its length."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line or "(empty body)"
    return f"{line[:limit]}... ({len(text)} characters)"


def error_message(body: Any) -> str:
    """One line from any of SGLang's three error body shapes (or the raw text), at most an :func:`excerpt`."""
    if isinstance(body, (bytes, str)):
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
        try:
            body = json.loads(text)
        except ValueError:
            return excerpt(text)
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, str):
            return excerpt(err)
        if isinstance(err, dict) and "message" in err:
            return excerpt(str(err["message"]))
        # OpenAI-style {"object": "error", "message": ...}; FastAPI's detail; a LoRA load's LoRAUpdateOutput
        for key in ("message", "detail", "error_message"):
            if key in body:
                return excerpt(str(body[key]))
    return excerpt(json.dumps(body))


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

    def __repr__(self) -> str:
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
        check: Callable[[Any], None] | None = None,
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
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        return_logprob: bool = True,
        timeout: float | None = None,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> list[dict[str, Any]]:
        """``POST /generate`` for one prompt; returns its raw outputs (dicts), retrying aborted ones.

        ``sampling_params``: one dict (its ``n`` samples), or a list of dicts, one per sample:
        then the prompt is sent as a batch of ``len(list)`` copies, each with its own params.
        ``rid``: the request's id, which :meth:`abort` names (SGLang runs the copies of a batch as
        ``<rid>_<i>``). A request with a ``rid`` is one the caller may abort: its aborted outputs
        come back as they are (the tokens generated so far, finish reason ``abort``), not retried.
        ``lora_path``: the name of a loaded LoRA adapter to sample with (None: the base model).
        """
        ids = [int(t) for t in input_ids]
        body: dict[str, Any] = {
            "input_ids": [ids] * len(sampling_params) if isinstance(sampling_params, list) else ids,
            "sampling_params": sampling_params,
            "return_logprob": return_logprob,
        }
        if return_logprob:
            body["logprob_start_len"] = -1
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        check = self._check_reply_shape if rid is not None else self._check_generate_reply
        result = self.request("POST", "/generate", body, timeout=timeout, check=check)
        return result if isinstance(result, list) else [result]

    def generate_continuation(
        self,
        prompt_ids: Sequence[int],
        partial_ids: Sequence[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        timeout: float | None = None,
        rid: str | None = None,
    ) -> list[dict[str, Any]]:
        """Continue one aborted response: ``input_ids`` = prompt + its ``partial_ids``, as SGLang resumes.

        ``sampling_params`` are the original request's (``n`` 1); its ``max_new_tokens`` is lowered
        by ``len(partial_ids)`` so the whole response keeps the original limit. The outputs hold the
        new tokens only (the caller joins them to ``partial_ids``).
        """
        if sampling_params.get("n", 1) != 1:
            raise ValueError(f"a continuation continues one response, got n={sampling_params['n']}")
        left = int(sampling_params.get("max_new_tokens", 128)) - len(partial_ids)
        if left < 1:
            raise ValueError(f"{len(partial_ids)} partial tokens leave nothing of max_new_tokens to continue")
        params = {**sampling_params, "max_new_tokens": left}
        ids = [*prompt_ids, *partial_ids]
        return self.generate(ids, params, return_logprob=return_logprob, timeout=timeout, rid=rid)

    def abort(self, rid: str = "", abort_all: bool = False, timeout: float | None = None) -> None:
        """``POST /abort_request``: abort every request whose rid starts with ``rid`` (or all).

        SGLang answers at once; each aborted request's ``/generate`` then answers with its tokens
        so far. An empty ``rid`` without ``abort_all`` would abort nothing and is refused here.
        """
        if not rid and not abort_all:
            raise ValueError("abort needs a rid or abort_all")
        self.post("/abort_request", {"rid": rid, "abort_all": abort_all}, timeout=timeout)

    def _check_reply_shape(self, result: Any) -> None:
        """Retry an empty or truncated ``/generate`` body; refuse a body that is not outputs."""
        self._check_generate_reply(result, retry_aborted=False)

    def _check_generate_reply(self, result: Any, retry_aborted: bool = True) -> None:
        """Retry an empty or truncated ``/generate`` body and aborted outputs; refuse any other shape.

        ``result``: the decoded body (None when empty, the text when it is not JSON).
        """
        if result is None:
            raise _Retryable("empty reply body")
        if isinstance(result, str):  # cut off mid-stream (a proxy, a dying server): worth another try
            raise _Retryable(f"reply is not JSON (truncated?): {excerpt(result, 80)}")
        outputs = result if isinstance(result, list) else [result]
        if not outputs or not all(isinstance(out, dict) for out in outputs):
            raise EngineReplyError(
                f"SGLang server {self.url}/generate answered {excerpt(json.dumps(result), 80)}: "
                "expected an output object or a list of them"
            )
        for out in outputs if retry_aborted else ():
            reason = out.get("meta_info")
            reason = reason.get("finish_reason") if isinstance(reason, dict) else None
            if isinstance(reason, dict) and reason.get("type") == "abort":
                raise _Retryable(f"generation aborted: {reason.get('message', '')}")

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


def parse_output(
    out: dict[str, Any],
    prompt_index: int,
    return_logprob: bool,
    *,
    sample: int = 0,
    source: str = "SGLang",
    vocab_size: int | None = None,
) -> Sample:
    """One SGLang ``/generate`` output -> :class:`~armor_megatron.rollout.engine.Sample`.

    Reads ``output_ids``, ``text`` and ``meta_info`` {``finish_reason.type``, ``weight_version``,
    ``output_token_logprobs`` = [[logprob, token_id, text], ...]}; the logprob rows must name
    the same tokens as ``output_ids``. A ``null`` logprob is SGLang's JSON for a non-finite one
    (its encoder writes -inf and NaN as null) and reads as -inf. A response generated across a
    weight update carries ``weight_versions`` spans [{version, start, end}, ...] and, as
    ``weight_version``, only the last span's: its version here names every span (``"a->b"``),
    so :func:`~armor_megatron.rollout.engine.check_versions` refuses it as off-policy.

    A malformed output raises :class:`~armor_megatron.rollout.engine.EngineReplyError` in one line
    naming ``source`` (the server), the request (``meta_info.id``, SGLang's rid), the prompt and
    the ``sample`` (its index among the prompt's samples); so does a token id outside
    ``[0, vocab_size)`` or a log-prob above 0, when ``vocab_size`` is given
    (:func:`~armor_megatron.rollout.engine.check_sample`).
    """
    meta = out.get("meta_info")
    meta = meta if isinstance(meta, dict) else {}
    rid = f" request {meta['id']}" if isinstance(meta.get("id"), str) else ""
    where = f"{source}:{rid} sample {sample} of prompt {prompt_index}"
    ids = out.get("output_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise EngineReplyError(f"{where}: output_ids is {excerpt(json.dumps(ids), 60)}, not a list of token ids")
    token_ids = tuple(ids)
    reason = meta.get("finish_reason") or {}
    reason = (reason.get("type") if isinstance(reason, dict) else str(reason)) or "length"
    if reason not in FINISH_REASONS:
        raise EngineReplyError(f"{where}: finish_reason {excerpt(str(reason), 40)} is none of {FINISH_REASONS}")
    logprobs = None
    if return_logprob:
        rows = meta.get("output_token_logprobs")
        if not isinstance(rows, list):
            raise EngineReplyError(f"{where}: no meta_info.output_token_logprobs list")
        if len(rows) != len(token_ids):
            raise EngineReplyError(f"{where}: {len(rows)} output_token_logprobs for {len(token_ids)} output_ids")
        logprobs = tuple(_logprob(row, token, where) for row, token in zip(rows, token_ids))
    text = out.get("text", "")
    parsed = Sample(
        prompt_index=prompt_index,
        token_ids=token_ids,
        text=text if isinstance(text, str) else "",
        logprobs=logprobs,
        finish_reason=reason,
        weight_version=_weight_version(meta),
    )
    if vocab_size is not None:
        check_sample(parsed, vocab_size, where)
    return parsed


def _logprob(row: Any, token: int, where: str) -> float:
    """The log-prob of one ``[logprob, token_id, text]`` row of ``token`` (null: -inf)."""
    if not isinstance(row, list) or len(row) < 2 or row[1] != token:
        raise EngineReplyError(
            f"{where}: output_token_logprobs row {excerpt(json.dumps(row), 60)} does not name output token {token}"
        )
    value = row[0]
    if value is None:
        return float("-inf")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EngineReplyError(f"{where}: log-prob {excerpt(json.dumps(value), 40)} is not a number")
    return float(value)


def _weight_version(meta: dict[str, Any]) -> str:
    spans = [str(s["version"]) for s in meta.get("weight_versions") or () if isinstance(s, dict) and "version" in s]
    if len(set(spans)) > 1:
        return "->".join(spans)
    return str(meta.get("weight_version", "default"))
