"""TEST DOUBLE — NOT SGLang. A protocol-compatible SGLang 0.5.x HTTP server on loopback.

It answers the endpoints :mod:`armor_megatron.rollout.sglang` uses, with SGLang's field
names and status codes, and generates with a :class:`~armor_megatron.rollout.local.LocalEngine`
(a tiny transformers model on CPU). It exists so the SGLang client, weight sync and engine
are tested over real HTTP on machines where SGLang cannot run; ``tools/gpu_smoke.sh`` runs
the same client tests against a real SGLang server.

Behaviour copied from SGLang 0.5.x (see docs/design.md §7):

* ``/generate`` with ``input_ids`` (one prompt or a list) or ``text``; n > 1 returns a flat
  list, prompt by prompt, each prompt's n samples together (``TokenizerManager._handle_batch_request``,
  sglang/srt/managers/tokenizer_manager.py:2164-2165 in 0.5.23: ``for i in range(batch_size): for _ in
  range(obj.parallel_sample_num)``); the n of every params dict of a list must agree (io_struct.py:541-545);
  ``meta_info`` carries ``finish_reason`` {type: stop|length|abort}, ``prompt_tokens``,
  ``completion_tokens``, ``weight_version`` and, with ``return_logprob``,
  ``output_token_logprobs`` = [[logprob, token_id, None], ...];
* log-probs as SGLang 0.5.23's ``Sampler.forward`` (sglang/srt/layers/sampler.py) reports them:
  ``log_softmax(logits / temperature)`` of the unfiltered logits (line 275 divides the logits by
  the temperature in place, line 315 takes ``log(probs)`` of their softmax, before top-k/top-p);
  temperature-1 ``log_softmax(logits)`` when greedy (temperature 0 becomes 1 with top_k 1:
  sampling_params.py:245-248; sampler.py:221) or when the server's environment sets
  ``SGLANG_RETURN_ORIGINAL_LOGPROB`` (read once at import, sampler.py:82, as "1"/"true";
  cached before the division at line 237, returned at line 323). The double reads the same
  variable from its environment (or takes ``original_logprobs``);
* ``sampling_seed`` only counts under ``--enable-deterministic-inference``
  (``SamplingBatchInfo.from_schedule_batch``, sglang/srt/sampling/sampling_batch_info.py:157-171:
  the seed tensor is built only ``if enable_deterministic``, a request without a seed gets 42).
  Otherwise the seed is ignored and the n copies of a request draw independently. Deterministic
  sampling hashes (seed, position, token) (sampler.py:934-958), so every copy of an ``n > 1``
  request, which shares one seed, comes out identical, and so do unseeded requests. The double:
  seeds ignored unless started ``deterministic``; then each copy is drawn alone from its seed;
* unknown ``sampling_params`` keys -> HTTP 400 ``{"error": "..."}``; bad values -> 400
  ``{"error": {"message": ...}}``; malformed requests -> 400 OpenAI-style
  ``{"object": "error", "message", "type", "param", "code"}``;
* ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` only inside a
  ``/begin_weight_update`` ... ``/end_weight_update`` session, else 400 ``success: false``;
  failed updates are 400; a second begin is refused ("already open"); an open session does
  not hold ``/generate`` back (the scheduler keeps serving between update requests);
* payloads are unpickled with SGLang's allowlist (``SafeUnpickler``, sglang/srt/utils/common.py;
  :class:`~armor_megatron.rollout.sglang.tensor_payload.SGLangUnpickler`);
* sampling params as SGLang's ``SamplingParams.verify`` and request parsing check them:
  ``top_k`` -1 or >= 1, ``max_new_tokens`` an integer >= 0 (0 allowed), wrong JSON types
  -> 400 ``{"error": "<text>"}``; prompt + ``max_new_tokens`` over the context length
  (``max_position_embeddings``) -> 400, as the tokenizer manager's length check does;
  ``sampling_params`` may be a list, one per prompt of a batch;
* ``/abort_request`` {rid, abort_all}: answers 200 with an empty body (http_server.py:1721-1731);
  the scheduler aborts every request whose rid *starts with* ``rid`` (scheduler.py:5688, 5800;
  a batch sent with one rid string runs as ``<rid>_<i>``, io_struct.py:759-765) or all with
  ``abort_all``; an unknown rid is ignored. The aborted request's ``/generate`` answers 200 with
  the tokens generated so far (``output_ids``, their ``output_token_logprobs``) and
  ``finish_reason`` {type: abort, message: "Aborted", status_code: null, err_type: null}
  (``FINISH_ABORT.to_json``, schedule_batch.py:332-345); a request aborted before it ran
  gets ``message`` "Abort in waiting queue" and no tokens (tokenizer_manager.py:3596);
* decoding takes time: with ``seconds_per_token`` > 0 every running sequence decodes one
  token per ``seconds_per_token`` from the moment it runs (the double's own sampling time
  counts toward it), all running sequences at once (continuous batching: a decode step advances
  every running request by one token; the step's time does not grow with the batch here), so a
  longer response answers later and an abort cuts it where decoding is. The double samples the
  whole response first and reveals its prefix with time, which gives the same tokens and
  log-probs as decoding one token at a time. A continuation is an ordinary request whose
  ``input_ids`` are the prompt followed by the partial output;
* ``--max-running-requests`` (``max_running_requests``; default unbounded): at most that many
  sequences run at once (each of a request's n samples is one; SGLang's ``get_num_allocatable_reqs``,
  scheduler.py:4027); the others wait in the waiting queue, first come first served (the default
  ``--schedule-policy fcfs``, arg_groups/fields/schedule.py:102), and run as running ones finish or
  are aborted. An abort of a waiting sequence pops it from the queue (``Scheduler.abort_request``,
  scheduler.py:5685-5700): it answers no tokens and ``finish_reason`` {type: abort, message:
  "Abort in waiting queue"} (tokenizer_manager.py:3596). The KV-cache token budget, which bounds
  the batch too, is not modelled;
* ``/pause_generation`` {mode}: ``abort`` (SGLang's default) aborts the requests in flight,
  ``retract`` and ``in_place`` keep them; new requests wait until ``/continue_generation``;
  ``/health_generate`` answers 503 while paused (SGLang: its probe generation cannot run and
  times out after ~20 s; the double answers at once);
* ``/release_memory_occupation`` / ``/resume_memory_occupation`` {tags} per tag (``weights``,
  ``kv_cache``, ``cuda_graph``; default all), answer ``null``, are refused while requests run
  unless paused (the scheduler's idle check), and do not hold ``/generate`` back. Releasing
  ``weights`` loses them unless the server runs with ``--enable-weights-cpu-backup``: resuming
  brings the memory back, not its contents, until the next weight update (SGLang then
  generates garbage; the double refuses);
* a generating request while any tag is released runs a forward on unmapped memory: the real
  engine dies (an illegal memory access), so the double crashes (:meth:`crash`), records why in
  :attr:`SGLangTestServer.failure` (a process exits with status 1). Generating requests are
  ``/generate``, ``/health_generate`` and ``/health`` itself while ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION``
  is on (SGLang 0.5.23's default: ``health_generate`` in sglang/srt/entrypoints/http_server.py serves
  both paths and only answers ``/health`` at once when the variable is off); resuming a tag that
  is not released kills it too (the scheduler's set of offloaded tags has no such entry);
* ``--api-key`` (sglang/srt/utils/auth.py): every endpoint but ``/health*``, ``/ready*``,
  ``/metrics*`` and OPTIONS wants ``Authorization: Bearer <key>`` ("bearer" in any case) or
  ``x-api-key: <key>``; else 401 ``{"error": "Unauthorized"}``;
* routes: ``/get_weight_version`` does not exist (404; the version is in ``/model_info``),
  ``/update_weight_version``, ``/get_server_info`` and ``/v1/models`` do; a known path with
  the wrong method is 405; destroying an unknown weights update group is 400.
* weights update groups are kept by name, any number of them (SGLang's
  ``_model_update_group`` dict); ``/update_weights_from_distributed`` receives from rank 0 of
  the group it names, one broadcast per tensor or, with ``load_format: "flattened_bucket"``,
  one broadcast of the bytes back to back (SGLang's ``FlattenedTensorBucket.empty``, which
  refuses a tensor whose byte offset is not a multiple of its dtype's size). Weight requests
  (group joins, updates, sessions) are served one at a time in arrival order, as SGLang's
  queueing communicators serve them: a join or a broadcast blocks every weight request behind it.
* LoRA adapters (``--enable-lora``): ``/load_lora_adapter_from_tensors``, ``/unload_lora_adapter``
  and ``/generate`` with ``lora_path``, as :mod:`armor_megatron.rollout.testing.lora_serving` says.

``/update_weights_from_tensor`` payloads carry tensor *handles* (see
:mod:`armor_megatron.rollout.sglang.tensor_payload`): CPU tensors arrive as shared-memory
file descriptors handed over by the sender's ``multiprocessing`` resource sharer, which only
serves its own process and its children; so ``tensor`` sync with CPU tensors works against a
double running in the trainer's process (as in the tests), not against one in an unrelated
process. Real SGLang gets CUDA IPC handles, which have no such limit on one node.

Test hooks (not in SGLang): ``GET /test_double/requests`` (request counts per path),
:attr:`SGLangTestServer.distributed_updates` and ``GET /test_double/distributed_updates``
(``(group_name, names)`` of every distributed update, in order), :attr:`distributed_tensors`
(each tensor as last received that way, before any fusing),
:meth:`SGLangTestServer.inject_failures` (answer the next
requests to a path with an HTTP error), :meth:`inject_aborts` (next generations come back
aborted), :meth:`crash` (drop the listening socket and in-flight connections without an
answer) and :meth:`restart` (come back on the same port with the checkpoint's weights).

Run as a process with ``python -m armor_megatron.rollout.testing.sglang_test_server
--model-path DIR --port P`` (the flags of ``sglang.launch_server`` that matter here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from armor_megatron.rollout.engine import Sample, SamplingParams, WeightUpdateError
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.testing.lora_serving import NOT_ENABLED, LoRARefusal, LoRAServing

logger = logging.getLogger(__name__)

# sampling_params keys SGLang 0.5.x accepts; the double implements the first group and
# rejects the rest unless they hold their no-op default.
SUPPORTED_SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "n",
    "ignore_eos",
    "sampling_seed",
}
NOOP_SAMPLING_DEFAULTS = {
    "no_stop_trim": False,
    "skip_special_tokens": True,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "spaces_between_special_tokens": True,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "stop_regex": None,
    "logit_bias": None,
}
# sglang/srt/utils/auth.py: these path prefixes never need the API key.
AUTH_EXEMPT_PREFIXES = ("/health", "/ready", "/metrics")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
PAUSE_MODES = ("abort", "retract", "in_place")
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"  # sglang/srt/environ.py, EnvBool(True)
DEFAULT_SAMPLING_SEED = 42  # sampling_batch_info.py:163: the seed of a request without one, deterministic mode
# Fields of sampling_params whose JSON type SGLang's request parsing checks, and the type.
INT_SAMPLING_KEYS = ("max_new_tokens", "top_k", "n", "min_new_tokens")


WAITED = -1  # a sequence aborted in the waiting queue: it never ran
JSON_NULL = object()  # a handler's answer of JSON ``null`` (None answers an empty 200)


class _HTTPError(Exception):
    def __init__(self, status: int, body: Any):
        super().__init__(body)
        self.status, self.body = status, body


def _bad_value(message: str) -> _HTTPError:
    return _HTTPError(400, {"error": {"message": message}})


def _invalid_request(message: str, param: str | None = None) -> _HTTPError:
    return _HTTPError(
        400, {"object": "error", "message": message, "type": "BadRequestError", "param": param, "code": 400}
    )


def _join_weight_update_group(
    address: str, port: int, rank: int, world_size: int, group_name: str, backend: str, timeout: float
) -> Any:
    """The engine's end of a weights update group, built as SGLang builds it.

    As SGLang 0.5.23's ``init_custom_process_group`` builds it (sglang/srt/utils/common.py), independently of the
    trainer's :class:`~armor_megatron.rollout.sglang.process_group.WeightUpdateGroup`: a
    ``tcp://`` rendezvous, ``PrefixStore(group_name)`` around its store, torch's
    ``_new_process_group_helper`` (which adds ``"<group_name>/"`` and ``"<device>/"``), the
    group's ranks registered so ``dist.broadcast(..., group=)`` finds them. A trainer whose
    rendezvous keys differ from SGLang's times out here as it would against SGLang.
    """
    import datetime

    from torch.distributed import distributed_c10d as c10d

    delta = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=delta))
    store.set_timeout(delta)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,  # type: ignore[arg-type]  # c10d's private helper types it as its GroupName
        timeout=delta,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _failed_update(message: str) -> _HTTPError:
    return _HTTPError(400, {"success": False, "message": message})


class SGLangTestServer:
    """The test double. ``engine`` serves generation; ``model_path`` (optional) is what a restart reloads."""

    def __init__(
        self,
        engine: LocalEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        model_path: str | None = None,
        weights_cpu_backup: bool = False,
        deterministic: bool = False,
        original_logprobs: bool | None = None,
        health_generation: bool | None = None,
        seconds_per_token: float = 0.0,
        lora: LoRAServing | None = None,
        max_running_requests: int | None = None,
    ):
        """A server double in front of ``engine`` (not started: see :meth:`start`).

        ``deterministic``: as ``--enable-deterministic-inference`` (seeds honoured);
        ``original_logprobs``: temperature-1 log-probs; None reads ``SGLANG_RETURN_ORIGINAL_LOGPROB``;
        ``health_generation``: ``/health`` generates a token; None reads
        ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` (on unless "0"/"false");
        ``seconds_per_token``: decode time of one token of a sequence (0: answers at once);
        ``lora``: the LoRA serving of ``--enable-lora`` (None: LoRA not enabled).
        ``max_running_requests``: sequences decoding at once, the rest queue (None: unbounded).
        """
        if seconds_per_token < 0:
            raise ValueError(f"seconds_per_token must be >= 0, got {seconds_per_token}")
        if max_running_requests is not None and max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.seconds_per_token = seconds_per_token
        self.lora = lora
        self.max_running_requests = max_running_requests
        if original_logprobs is None:
            original_logprobs = os.environ.get(ORIGINAL_LOGPROB_ENV, "false").lower() in ("1", "true")
        if health_generation is None:
            health_generation = os.environ.get(HEALTH_GENERATION_ENV, "true").lower() not in ("0", "false")
        self.health_generation = health_generation
        self.failure: str | None = None  # why the engine died (a generating request while memory was released)
        self.deterministic, self.original_logprobs = deterministic, original_logprobs
        self.engine = engine
        engine.original_logprobs = original_logprobs
        self.weights_cpu_backup = weights_cpu_backup
        self._weights_lost = False  # "weights" released without a CPU backup, not reloaded since
        self.host, self.port = host, port
        self.api_key = api_key
        self.model_path = model_path
        self.initial_version = engine.weight_version
        self._cond = threading.Condition()
        self._session_open = False
        self._paused = False
        self.pause_mode = None  # the mode of the last /pause_generation (test hook)
        self._abort_epoch = 0  # bumped by an "abort" pause: requests that started before are aborted
        self._running = 0  # generations in flight
        self._released: set[str] = set()  # memory tags released
        self._groups: dict[str, Any] = {}
        self._weights_lock = threading.Lock()  # weight requests one at a time (SGLang's communicators queue them)
        self.distributed_updates: list[
            tuple[str, list[str]]
        ] = []  # (group_name, names) of every update_weights_from_distributed received
        self.distributed_tensors: dict[str, Any] = {}  # name -> the tensor last received so, as it came
        self._deferred: dict[str, Any] = {}  # fused-in-memory checkpoint tensors of the update in progress
        self._ckpt_names: set[str] | None = None
        self._failures: dict[str, list[int]] = {}  # path -> [remaining, status]
        self._aborts = 0
        self._rids: dict[str, float | None] = {}  # rid of every sequence not answered yet -> when it was aborted
        self._waiting: list[str] = []  # rids in the waiting queue, first come first
        self._arrived: dict[str, float] = {}  # rid -> when its request arrived
        self._ran: dict[str, float] = {}  # rid -> when it started running (left the waiting queue)
        self._running_rids: dict[str, None] = {}  # rids holding a running slot
        self._lengths: dict[str, int] = {}  # rid -> its sampled length (unknown while sampling)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self.requests: dict[str, int] = {}  # path -> count, for tests

    # ---- lifecycle ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> SGLangTestServer:
        """Listen on ``host:port`` in a background thread; returns self."""
        server = self

        class Handler(_Handler):
            owner = server

        self._httpd = _Server((self.host, self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and join the server thread (once, also when a crash stops it concurrently)."""
        with self._cond:
            httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
            if self._thread is not None:
                self._thread.join(timeout=10)

    def crash(self) -> None:
        """Die like a killed process: stop listening and cut every open connection unanswered."""
        self.stop()
        with self._cond:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._cond.notify_all()

    def restart(self) -> SGLangTestServer:
        """Come back on the same port; with ``model_path`` the weights (and version) are the checkpoint's."""
        self.stop()
        if self.model_path is not None:
            self.engine = LocalEngine.from_pretrained(self.model_path, weight_version=self.initial_version)
            self.engine.original_logprobs = self.original_logprobs
        self._session_open = self._paused = False
        self._deferred = {}
        self._released = set()
        return self.start()

    def __enter__(self) -> SGLangTestServer:
        return self.start() if self._httpd is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- test hooks --------------------------------------------------------------------

    def inject_failures(self, path: str, count: int, status: int = 503) -> None:
        """Answer the next ``count`` requests to ``path`` with HTTP ``status``."""
        with self._cond:
            self._failures[path] = [count, status]

    def decoding(self) -> list[str]:
        """The rids of the sequences decoding now (running, not aborted)."""
        with self._cond:
            self._schedule(time.monotonic())
            return [r for r in self._running_rids if self._rids.get(r, 0.0) is None]

    def waiting(self) -> list[str]:
        """The rids in the waiting queue, first come first (``max_running_requests`` reached)."""
        with self._cond:
            self._schedule(time.monotonic())
            return list(self._waiting)

    def inject_aborts(self, count: int) -> None:
        """The next ``count`` generations come back with finish_reason ``abort``."""
        with self._cond:
            self._aborts = count

    # ---- request handling --------------------------------------------------------------

    def handle(self, method: str, path: str, headers: Message, body: Any) -> Any:
        """Serve one request: count it, check the API key, apply injected failures, dispatch to the route's method."""
        with self._cond:
            self.requests[path] = self.requests.get(path, 0) + 1
        if self.api_key and not self._authorized(method, path, headers):
            raise _HTTPError(401, {"error": "Unauthorized"})
        with self._cond:
            failure = self._failures.get(path)
            if failure and failure[0] > 0:
                failure[0] -= 1
                raise _HTTPError(failure[1], {"error": {"message": f"injected failure on {path}"}})
        route = ROUTES.get((method, path))
        if route is None:
            if any(p == path for _, p in ROUTES):
                raise _HTTPError(405, {"detail": "Method Not Allowed"})
            raise _HTTPError(404, {"detail": "Not Found"})
        return route(self, body)

    def _authorized(self, method: str, path: str, headers: Message) -> bool:
        """SGLang's ``decide_request_auth`` for a server with ``--api-key`` and no admin key."""
        if method == "OPTIONS" or path.startswith(AUTH_EXEMPT_PREFIXES):
            return True
        scheme, _, token = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and token == self.api_key:
            return True
        return bool(headers.get("x-api-key") == self.api_key)

    def _wait_until_serving(self) -> None:
        with self._cond:
            while self._paused and self._httpd is not None:
                self._cond.wait(timeout=0.1)
            if self._httpd is None:
                raise ConnectionAbortedError("server is going down")

    # -- generation

    def generate(self, body: Any) -> Any:
        """``POST /generate``: sample from the local engine, SGLang's request and reply formats."""
        if not isinstance(body, dict):
            raise _invalid_request("request body must be a JSON object")
        prompts, single = self._prompts(body)
        raw = body.get("sampling_params") or {}
        if isinstance(raw, list):  # one params dict per prompt of a batch
            if len(raw) != len(prompts):
                raise _invalid_request(f"{len(raw)} sampling_params for {len(prompts)} prompts", "sampling_params")
            if len({p.get("n", 1) if isinstance(p, dict) else None for p in raw}) > 1:  # io_struct.py:541-545
                raise _bad_value("The parallel_sample_num should be the same for all samples in sample params.")
            per_prompt = raw
        else:
            per_prompt = [raw] * len(prompts)
        checked = [self._sampling(params, prompt) for params, prompt in zip(per_prompt, prompts)]
        engines = self._lora_engines(body.get("lora_path"), len(prompts))
        if self._weights_lost:  # SGLang would generate garbage here; the double refuses
            raise _bad_value("weights were released without --enable-weights-cpu-backup and not reloaded since")
        self._wait_until_serving()
        return_logprob = bool(body.get("return_logprob", False))
        rids = self._rids_of(body.get("rid"), len(prompts), sum(n for n, _ in checked))
        with self._cond:
            self._fail_if_released("/generate")
            self._running += 1
            epoch = self._abort_epoch
            self._arrive(rids, time.monotonic())
        try:
            # a queued request costs SGLang nothing; it runs (and the double samples it) once all its sequences
            # hold a slot; the decode clock starts there, the double's own sampling time counts toward it
            ran = self._wait_while(rids, lambda: any(r in self._waiting for r in rids))
            sampled = [
                (s, len(p), sp)
                for p, (n, sp), engine in zip(prompts, checked, engines)
                for s in (self._sample(p, n, sp, return_logprob, engine) if ran else self._nothing(n, return_logprob))
            ]
            cut = self._decode_in_time(rids, [len(s.token_ids) for s, _, _ in sampled])
            outputs = []
            for rid, keep, (sample, prompt_len, sampling) in zip(rids, cut, sampled):
                out = self._output(sample, prompt_len, sampling, return_logprob, rid=rid, keep=keep)
                outputs.append(out)
        finally:
            with self._cond:
                self._running -= 1
                aborted = epoch != self._abort_epoch
                self._leave(rids)
        if aborted:  # an "abort" pause arrived while this request ran
            for out in outputs:
                out["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue"}
        return outputs[0] if single and len(outputs) == 1 else outputs

    @staticmethod
    def _rids_of(rid: Any, batch: int, sequences: int) -> list[str]:
        """One rid per output sequence, as SGLang's ``_normalize_rid`` names them (uuid hex when absent)."""
        if rid is None:
            return [os.urandom(16).hex() for _ in range(sequences)]
        per = sequences // batch
        if isinstance(rid, str):
            base = [rid] if batch == 1 and per == 1 else [f"{rid}_{i}" for i in range(batch)]
        elif isinstance(rid, list) and len(rid) == batch and all(isinstance(r, str) for r in rid):
            base = rid
        else:
            raise _bad_value("The specified rids length mismatch with the batch_size for batch processing.")
        return base if per == 1 else [f"{b}_{k}" for b in base for k in range(per)]

    # -- the running batch: continuous batching with at most max_running_requests sequences

    def _arrive(self, rids: list[str], now: float) -> None:
        """Sequences arrive: they run if a slot is free, else join the waiting queue (caller holds ``_cond``)."""
        self._schedule(now)
        for rid in rids:
            self._rids[rid], self._arrived[rid] = None, now
            if self._waiting or not self._slot_free():
                self._waiting.append(rid)
            else:
                self._run(rid, now)

    def _slot_free(self) -> bool:
        cap = self.max_running_requests
        return cap is None or len(self._running_rids) < cap

    def _run(self, rid: str, at: float) -> None:
        self._running_rids[rid], self._ran[rid] = None, at

    def _release_time(self, rid: str) -> float:
        """When ``rid`` gives its slot back: at its last token or its abort (never while its length is unknown)."""
        n, aborted = self._lengths.get(rid), self._rids.get(rid)
        end = math.inf if n is None else self._ran[rid] + n * self.seconds_per_token
        return min(end, math.inf if aborted is None else aborted)

    def _schedule(self, now: float) -> None:
        """Replay the batch up to ``now``: slots freed in time order, each taken by the queue's head at that time.

        Caller holds ``_cond``. A sequence that runs at ``t`` decodes from ``t``, not from when
        the double noticed, so the timing does not depend on when threads wake.
        """
        while self._running_rids:
            at, rid = min((self._release_time(r), r) for r in self._running_rids)
            if at > now:
                return
            del self._running_rids[rid]
            if self._waiting:
                head = self._waiting.pop(0)
                self._run(head, max(at, self._arrived[head]))
            self._cond.notify_all()

    def _leave(self, rids: list[str]) -> None:
        """Forget answered sequences (caller holds ``_cond``); their slots, if still held, free now."""
        for rid in rids:
            if rid in self._running_rids:
                self._rids[rid] = min(self._rids.get(rid) or math.inf, time.monotonic())
        self._schedule(time.monotonic())
        gone = set(rids)
        self._waiting = [r for r in self._waiting if r not in gone]
        for rid in rids:
            self._rids.pop(rid, None)
            self._arrived.pop(rid, None)
            self._ran.pop(rid, None)
            self._lengths.pop(rid, None)

    def _wait_while(self, rids: list[str], pending: Callable[[], bool]) -> bool:
        """Replay the batch as time passes while ``pending()``; True when any of ``rids`` got to run."""
        with self._cond:
            while self._httpd is not None:
                now = time.monotonic()
                self._schedule(now)
                if not pending():
                    break
                wake = min((self._release_time(r) for r in self._running_rids), default=math.inf)
                self._cond.wait(timeout=min(max(wake - now, 0.0), 1.0))
            return any(r in self._ran for r in rids)

    def _nothing(self, n: int, return_logprob: bool) -> list[Sample]:
        """The n samples of a request aborted in the waiting queue: never run, nothing generated."""
        return [Sample(0, (), "", () if return_logprob else None, "abort", self.engine.weight_version)] * n

    def _decode_in_time(self, rids: list[str], lengths: list[int]) -> list[int | None]:
        """Wait while the sequences wait for a slot and decode, ``seconds_per_token`` per token.

        Returns, per sequence, None when it decoded to its end, else the number of tokens decoded
        when its abort arrived (:data:`WAITED` for one aborted in the waiting queue).
        """
        spt = self.seconds_per_token
        with self._cond:
            self._lengths.update(zip(rids, lengths))
        self._wait_while(rids, lambda: any(r in self._running_rids or r in self._waiting for r in rids))
        with self._cond:
            cut: list[int | None] = []
            for rid, n in zip(rids, lengths):
                aborted, ran = self._rids.get(rid), self._ran.get(rid)
                if ran is None:  # aborted in the waiting queue (or the server went down first)
                    cut.append(WAITED)
                elif aborted is None or aborted >= ran + n * spt:
                    cut.append(None)
                else:
                    cut.append(int((aborted - ran) / spt) if spt > 0 else 0)
            return cut

    def abort_request(self, body: Any) -> None:
        """``POST /abort_request`` {rid, abort_all}: abort the sequences decoding whose rid starts with ``rid``."""
        if not isinstance(body, dict):
            raise _invalid_request("abort_request needs a JSON body")
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        if not abort_all and not rid:  # tokenizer_manager.py:2243: ignored, not an error
            return None
        with self._cond:
            now = time.monotonic()
            self._schedule(now)
            for r, at in self._rids.items():
                if at is None and (abort_all or r.startswith(rid)):
                    self._rids[r] = now
            self._waiting = [r for r in self._waiting if self._rids[r] is None]  # popped from the queue
            self._schedule(now)
            self._cond.notify_all()
        return None

    def _sampling(self, params: Any, prompt: list[int]) -> tuple[int, SamplingParams | None]:
        """``(n, SamplingParams | None)``; None for ``max_new_tokens`` 0. Refuses what SGLang refuses."""
        if not isinstance(params, dict):
            raise _HTTPError(400, {"error": "sampling_params must be a JSON object"})
        unknown = sorted(set(params) - SUPPORTED_SAMPLING_KEYS - set(NOOP_SAMPLING_DEFAULTS))
        if unknown:
            raise _HTTPError(400, {"error": f"Unknown sampling parameter(s): {', '.join(unknown)}"})
        for key in INT_SAMPLING_KEYS:  # a JSON float where SGLang's field is an int
            if key in params and params[key] is not None and (type(params[key]) is not int):
                raise _HTTPError(400, {"error": f"sampling_params.{key}: expected int, got {params[key]!r}"})
        for key, default in NOOP_SAMPLING_DEFAULTS.items():
            if key in params and params[key] != default:
                raise _bad_value(f"sampling parameter {key}={params[key]!r} is not supported by the test server")
        n, max_new, top_k = params.get("n", 1), params.get("max_new_tokens", 128), params.get("top_k", -1)
        if n < 1:
            raise _bad_value(f"n must be a positive integer, got {n!r}")
        if max_new < 0:
            raise _bad_value(f"max_new_tokens must be at least 0, got {max_new}.")
        if not (top_k == -1 or top_k >= 1):  # SamplingParams.verify
            raise _bad_value(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
        context = self.context_length
        if context is not None and len(prompt) + max_new > context:  # the tokenizer manager's check
            raise _bad_value(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {len(prompt) + max_new} tokens: {len(prompt)} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in the "
                "input messages or the completion to fit within the limit."
            )
        if max_new == 0:
            return n, None
        try:
            sampling = SamplingParams(
                max_new_tokens=max_new,
                temperature=params.get("temperature", 1.0),
                top_p=params.get("top_p", 1.0),
                top_k=top_k,
                stop_token_ids=tuple(params.get("stop_token_ids") or ()),
                stop=tuple([params["stop"]] if isinstance(params.get("stop"), str) else params.get("stop") or ()),
                ignore_eos=bool(params.get("ignore_eos", False)),
                seed=params.get("sampling_seed"),
            )
        except (TypeError, ValueError) as e:
            raise _bad_value(str(e)) from None
        return n, sampling

    @property
    def context_length(self) -> int | None:
        """The model's context length (``max_position_embeddings``), None when unknown."""
        return (self.engine.hf_config or {}).get("max_position_embeddings")

    def _sample(
        self,
        prompt: list[int],
        n: int,
        sampling: SamplingParams | None,
        return_logprob: bool,
        engine: LocalEngine | None = None,
    ) -> list[Sample]:
        """The n samples of one prompt (``engine``: a LoRA adapter's, else the server's).

        Without deterministic inference the seed is ignored and the copies draw independently (one
        batch, the engine's own stream); with it each copy is drawn alone from its seed (42 without
        one), so the copies of one request come out identical.
        """
        engine = engine or self.engine
        if sampling is None:  # max_new_tokens 0: nothing generated
            empty = Sample(0, (), "", () if return_logprob else None, "length", engine.weight_version)
            return [empty] * n
        if not self.deterministic:
            sampling = dataclasses.replace(sampling, seed=None)
            return engine.generate([prompt], n, sampling, return_logprob=return_logprob)[0]
        seeded = dataclasses.replace(sampling, seed=DEFAULT_SAMPLING_SEED if sampling.seed is None else sampling.seed)
        return [engine.generate([prompt], 1, seeded, return_logprob=return_logprob)[0][0] for _ in range(n)]

    def _prompts(self, body: Any) -> tuple[list[list[int]], bool]:
        if "input_ids" in body:
            ids = body["input_ids"]
            single = bool(ids) and all(isinstance(t, int) for t in ids)
            prompts = [ids] if single else ids
            if not isinstance(prompts, list) or not all(
                isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
            ):
                raise _invalid_request(
                    "input_ids must be a non-empty list of token ids or a list of such lists", "input_ids"
                )
            return prompts, single
        if "text" in body:
            if self.engine.tokenizer is None:
                raise _invalid_request("text input needs a tokenizer", "text")
            texts = body["text"]
            single = isinstance(texts, str)
            texts = [texts] if single else texts
            return [self.engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], single
        raise _invalid_request("Either text or input_ids should be provided.")

    def _output(
        self,
        sample: Sample,
        prompt_len: int,
        sampling: SamplingParams | None,
        return_logprob: bool,
        rid: str | None = None,
        keep: int | None = None,
    ) -> dict[str, Any]:
        """SGLang's output dict of ``sample``; ``keep``: aborted after that many tokens (None: not aborted; WAITED: in the queue)."""
        with self._cond:
            aborted = self._aborts > 0
            self._aborts -= aborted
        reason: dict[str, Any]
        if keep == WAITED:  # popped from the waiting queue: the tokenizer manager's generic abort
            sample = dataclasses.replace(
                sample, token_ids=(), logprobs=None if sample.logprobs is None else (), text=""
            )
            reason = {"type": "abort", "message": "Abort in waiting queue"}
        elif keep is not None:
            lps = None if sample.logprobs is None else sample.logprobs[:keep]
            ids = sample.token_ids[:keep]
            sample = dataclasses.replace(sample, token_ids=ids, logprobs=lps, text=self.engine._decode(ids))
            reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        elif aborted:
            reason = {"type": "abort", "message": "injected abort"}
        elif sample.finish_reason == "length":
            reason = {"type": "length", "length": sampling.max_new_tokens if sampling else 0}
        else:
            assert sampling is not None  # a stop comes after generated tokens
            last = sample.token_ids[-1]
            matched = (
                last
                if last in set(sampling.stop_token_ids) | set(self.engine.eos_token_ids)
                else next((s for s in sampling.stop if s), None)
            )
            reason = {"type": "stop", "matched": matched}
        meta = {
            "id": rid if rid is not None else os.urandom(8).hex(),
            "finish_reason": reason,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(sample.token_ids),
            "cached_tokens": 0,
            "weight_version": sample.weight_version,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(sample.logprobs or (), sample.token_ids)]
        return {"text": sample.text, "output_ids": list(sample.token_ids), "meta_info": meta}

    # -- weights

    def begin_weight_update(self, body: Any) -> Any:
        """``POST /begin_weight_update``: open a weight update session (one at a time)."""
        with self._cond:
            if self._session_open:
                raise _failed_update("a weight update session is already open")
            self._session_open = True
        return {"success": True, "message": "weight update session opened"}

    def end_weight_update(self, body: Any) -> Any:
        """``POST /end_weight_update``: close the weight update session."""
        with self._cond:
            if not self._session_open:
                raise _failed_update("no weight update session is open")
            self._session_open = False
            self._cond.notify_all()
        return {"success": True, "message": "weight update session closed"}

    def _require_session(self, what: str) -> None:
        if not self._session_open:
            raise _failed_update(
                f"{what} is only allowed inside a weight update session (call /begin_weight_update first)"
            )

    def _apply(self, named: Any, version: str | None, strict: bool) -> None:
        try:
            if not strict:
                named = self._defer_fused(named)
            self.engine.load_weights(named, strict=strict)
            if version is not None and self._deferred:
                self._load_deferred()
        except WeightUpdateError as e:
            self._deferred = {}
            raise _failed_update(f"Failed to update weights: {e}") from None
        if version is not None:  # the last request of an update: all weights are in
            self.engine.weight_version = str(version)
            self._weights_lost = False

    def _checkpoint_names(self) -> set[str]:
        from armor_megatron.rollout.hf_checkpoint import read_hf_checkpoint

        if self._ckpt_names is None:
            if self.model_path is None:
                raise ValueError("this server was started without a model_path: no checkpoint to read")
            self._ckpt_names = {n for n, _ in read_hf_checkpoint(self.model_path, keys_only=True)}
        return self._ckpt_names

    def _defer_fused(self, named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Hold back checkpoint tensors the in-memory model fuses, until the update's last request.

        transformers 5 fuses MoE experts; SGLang places such tensors into its own fused parameters
        as they come. Every other tensor goes in now.
        """
        if self.model_path is None:
            return named
        state = self.engine.model.state_dict()
        now = []
        for name, t in named:
            if name not in state and name in self._checkpoint_names():
                self._deferred[name] = t.detach().clone()
            else:
                now.append((name, t))
        return now

    def _load_deferred(self) -> None:
        """The deferred tensors with the model's own checkpoint-named ones, through transformers' loader."""
        state = self.engine.model.state_dict()
        full = {n: state[n] for n in self._checkpoint_names() if n in state}
        full.update(self._deferred)
        self._deferred = {}
        self.engine.load_weights(list(full.items()), strict=True)

    def update_weights_from_disk(self, body: Any) -> Any:
        """``POST /update_weights_from_disk``: load an HF checkpoint directory (every weight required)."""
        path = body.get("model_path")
        if not path or not os.path.isdir(path):
            raise _failed_update(f"Failed to update weights: model_path {path!r} is not a directory")
        self._apply(path, body.get("weight_version"), strict=True)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def update_weights_from_tensor(self, body: Any) -> Any:
        """``POST /update_weights_from_tensor``: apply serialized named tensors, within a session."""
        from armor_megatron.rollout.sglang import tensor_payload

        self._require_session("update_weights_from_tensor")
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            raise _invalid_request("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
        try:
            named = tensor_payload.deserialize(entries[0], body.get("load_format"))
        except Exception as e:  # noqa: BLE001 - any decode failure is the caller's bad payload
            raise _failed_update(f"Failed to deserialize tensors: {type(e).__name__}: {e}") from None
        self._apply(named, body.get("weight_version"), strict=False)
        return {"success": True, "message": "Succeeded to update model weights."}

    def init_weights_update_group(self, body: Any) -> Any:
        """``POST /init_weights_update_group``: join a trainer's weights update group."""
        with self._weights_lock:
            return self._init_weights_update_group(body)

    def _init_weights_update_group(self, body: Any) -> Any:
        try:
            group = _join_weight_update_group(
                body["master_address"],
                body["master_port"],
                body["rank_offset"],
                body["world_size"],
                body["group_name"],
                body.get("backend", "nccl"),
                timeout=60,
            )
        except Exception as e:  # noqa: BLE001
            raise _failed_update(f"Failed to init weights update group: {e}") from None
        self._groups[body["group_name"]] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: Any) -> Any:
        """``POST /update_weights_from_distributed``: receive a broadcast bucket over a joined group."""
        import torch
        import torch.distributed as dist

        with self._weights_lock:
            self._require_session("update_weights_from_distributed")
            group = self._groups.get(body.get("group_name"))
            if group is None:
                raise _failed_update(f"no weights update group named {body.get('group_name')!r}")
            specs = list(zip(body["names"], body["dtypes"], body["shapes"]))
            if body.get("load_format") == "flattened_bucket":
                layout, offset = [], 0
                for name, dtype, shape in specs:
                    dtype = getattr(torch, dtype)
                    if offset % dtype.itemsize:
                        raise _failed_update(
                            f"Failed to receive weights: Unaligned received tensor {name}: byte offset {offset}, "
                            f"dtype {dtype}"
                        )
                    size = torch.Size(shape).numel() * dtype.itemsize
                    layout.append((name, dtype, shape, offset, size))
                    offset += size
                flat = torch.empty(offset, dtype=torch.uint8)
                dist.broadcast(flat, src=0, group=group)
                named = [(n, flat[o : o + z].view(d).reshape(sh)) for n, d, sh, o, z in layout]
            elif body.get("load_format") is None:
                named = []
                for name, dtype, shape in specs:
                    t = torch.empty(shape, dtype=getattr(torch, dtype))
                    dist.broadcast(t, src=0, group=group)
                    named.append((name, t))
            else:
                raise _failed_update(f"Failed to receive weights: unknown load_format {body['load_format']!r}")
            self.distributed_updates.append((body["group_name"], [n for n, _ in named]))
            self.distributed_tensors.update((n, t.clone()) for n, t in named)
            self._apply(named, body.get("weight_version"), strict=False)
        return {"success": True, "message": "Succeeded to update parameter online from distributed."}

    def destroy_weights_update_group(self, body: Any) -> Any:
        """``POST /destroy_weights_update_group``: leave a group."""
        import torch.distributed as dist

        with self._weights_lock:
            group = self._groups.pop(body.get("group_name"), None)
            if group is None:
                raise _failed_update("The group to be destroyed does not exist.")
            dist.destroy_process_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    # -- memory, pause, misc

    def _memory_tags(self, body: Any, what: str) -> set[str]:
        tags = (body or {}).get("tags") or list(MEMORY_TAGS)
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise _bad_value(f"unknown memory tag(s) {unknown}; SGLang knows {list(MEMORY_TAGS)}")
        with self._cond:
            if self._running and not self._paused:  # the scheduler only does this when idle
                raise _bad_value(f"{what} needs an idle server: {self._running} request(s) running; pause first")
        return set(tags)

    def release_memory_occupation(self, body: Any) -> Any:
        """``POST /release_memory_occupation``: release memory tags (weights lost unless backed up on the CPU)."""
        tags = self._memory_tags(body, "release_memory_occupation")
        self._released |= tags
        if "weights" in tags and not self.weights_cpu_backup:
            self._weights_lost = True  # resuming restores the memory, not its contents
        return JSON_NULL

    def resume_memory_occupation(self, body: Any) -> Any:
        """``POST /resume_memory_occupation``: take the memory of the tags back.

        A tag that is not released kills the engine: SGLang's scheduler removes each tag from its
        set of offloaded tags (a ``KeyError`` in its event loop, which takes the server down).
        """
        tags = self._memory_tags(body, "resume_memory_occupation")
        with self._cond:
            held = sorted(tags - self._released)
            if held:
                self.failure = f"resume_memory_occupation of {held}, which were not released"
                logger.error("engine failed: %s", self.failure)
                threading.Thread(target=self.crash, daemon=True).start()
                raise ConnectionAbortedError(self.failure)
            self._released -= tags
        return JSON_NULL

    def pause_generation(self, body: Any) -> Any:
        """``POST /pause_generation``: pause in ``abort``, ``retract`` or ``in_place`` mode."""
        if not isinstance(body, dict):
            raise _invalid_request("pause_generation needs a JSON body")
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise _invalid_request(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "mode")
        with self._cond:
            self._paused, self.pause_mode = True, mode
            if mode == "abort":
                self._abort_epoch += 1
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: Any) -> Any:
        """``POST /continue_generation``: resume paused generation."""
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def health_generate(self, body: Any) -> Any:
        """``GET /health_generate``: one generated token (503 while paused)."""
        if self._paused:
            raise _HTTPError(503, {"error": "server is paused"})
        with self._cond:  # its one-token forward (not run: it would move the engine's sampling state)
            self._fail_if_released("a health check")
        return None

    def health(self, body: Any) -> Any:
        """``GET /health``: ``/health_generate`` unless health generation is off, then 200 at once."""
        return self.health_generate(body) if self.health_generation else None

    def _fail_if_released(self, what: str) -> None:
        """A forward while memory is released: the real engine dies, so the double crashes (caller holds ``_cond``)."""
        if not self._released:
            return
        self.failure = f"{what} ran a forward while {sorted(self._released)} were released"
        logger.error("engine failed: %s", self.failure)
        threading.Thread(target=self.crash, daemon=True).start()  # not from a handler thread holding the lock
        raise ConnectionAbortedError(self.failure)

    def update_weight_version(self, body: Any) -> Any:
        """``POST /update_weight_version``: set the weight version without new weights."""
        version = (body or {}).get("new_version")
        if not isinstance(version, str):
            raise _invalid_request("new_version must be a string", "new_version")
        self.engine.weight_version = version
        return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}

    def server_info(self, body: Any) -> Any:
        """``GET /get_server_info``: model path, context length, weight version."""
        return {
            "model_path": self.model_path,
            "context_length": self.context_length,
            "weight_version": self.engine.weight_version,
            "version": "test-double",
        }

    def models(self, body: Any) -> Any:
        """``GET /v1/models``: the served model, as SGLang lists it."""
        name = self.model_path or "default"
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "root": name, "max_model_len": self.context_length}],
        }

    def model_info(self, body: Any) -> Any:
        """``GET /model_info`` (and ``/get_model_info``): model and tokenizer paths."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": self.engine.weight_version,
        }

    # -- LoRA adapters (lora_serving)

    def _lora_engines(self, lora_path: Any, prompts: int) -> list[LocalEngine | None]:
        """Per prompt, the engine of the adapter its ``lora_path`` names (None: the base); refuses as SGLang does."""
        names = lora_path if isinstance(lora_path, list) else [lora_path] * prompts
        if len(names) != prompts or not all(n is None or isinstance(n, str) for n in names):
            raise _invalid_request(f"lora_path must be a string or one per prompt, got {lora_path!r}", "lora_path")
        if any(names) and self.lora is None:
            first = next(n for n in names if n)
            raise _bad_value(
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        try:
            return [None if not n or self.lora is None else self.lora.engine_for(n, self.engine) for n in names]
        except LoRARefusal as e:
            raise _bad_value(str(e)) from None

    def _lora_answer(self, change: Callable[[LoRAServing], None]) -> Any:
        """SGLang's ``LoRAUpdateOutput`` of one load or unload: 200 on success, else 400 and ``success: false``."""
        if self.lora is None:
            raise _HTTPError(400, {"success": False, "error_message": NOT_ENABLED, "loaded_adapters": None})
        try:
            change(self.lora)
        except LoRARefusal as e:
            raise _HTTPError(
                400, {"success": False, "error_message": str(e), "loaded_adapters": self.lora.loaded()}
            ) from None
        return {"success": True, "error_message": "", "loaded_adapters": self.lora.loaded()}

    def load_lora_adapter_from_tensors(self, body: Any) -> Any:
        """``POST /load_lora_adapter_from_tensors``: hold an adapter sent as tensors (TP rank 0's entry)."""
        from armor_megatron.rollout.sglang import tensor_payload

        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise _invalid_request("lora_name must be a string", "lora_name")
        entries = body.get("serialized_named_tensors")
        if not isinstance(entries, list) or not entries:
            raise _invalid_request("serialized_named_tensors must be a non-empty list (one entry per TP rank)")

        def load(lora: LoRAServing) -> None:
            try:
                tensors = dict(tensor_payload.deserialize(entries[0], body.get("load_format")))
            except Exception as e:  # noqa: BLE001 - a payload SGLang could not read fails its load
                raise LoRARefusal(f"{type(e).__name__}: {e}") from None
            lora.load(body["lora_name"], body.get("config_dict"), tensors)

        return self._lora_answer(load)

    def unload_lora_adapter(self, body: Any) -> Any:
        """``POST /unload_lora_adapter``: drop an adapter."""
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            raise _invalid_request("lora_name must be a string", "lora_name")
        return self._lora_answer(lambda lora: lora.unload(body["lora_name"]))


ROUTES: dict[tuple[str, str], Callable[[SGLangTestServer, Any], Any]] = {
    ("GET", "/health"): SGLangTestServer.health,
    ("GET", "/health_generate"): SGLangTestServer.health_generate,
    ("GET", "/model_info"): SGLangTestServer.model_info,
    ("GET", "/get_model_info"): SGLangTestServer.model_info,
    ("GET", "/get_server_info"): SGLangTestServer.server_info,
    ("GET", "/v1/models"): SGLangTestServer.models,
    ("POST", "/update_weight_version"): SGLangTestServer.update_weight_version,
    ("POST", "/generate"): SGLangTestServer.generate,
    ("POST", "/flush_cache"): lambda s, b: "Cache flushed.",
    ("GET", "/flush_cache"): lambda s, b: "Cache flushed.",
    ("POST", "/abort_request"): SGLangTestServer.abort_request,
    ("POST", "/begin_weight_update"): SGLangTestServer.begin_weight_update,
    ("POST", "/end_weight_update"): SGLangTestServer.end_weight_update,
    ("POST", "/update_weights_from_disk"): SGLangTestServer.update_weights_from_disk,
    ("POST", "/update_weights_from_tensor"): SGLangTestServer.update_weights_from_tensor,
    ("POST", "/init_weights_update_group"): SGLangTestServer.init_weights_update_group,
    ("POST", "/update_weights_from_distributed"): SGLangTestServer.update_weights_from_distributed,
    ("POST", "/destroy_weights_update_group"): SGLangTestServer.destroy_weights_update_group,
    ("POST", "/release_memory_occupation"): SGLangTestServer.release_memory_occupation,
    ("POST", "/resume_memory_occupation"): SGLangTestServer.resume_memory_occupation,
    ("POST", "/pause_generation"): SGLangTestServer.pause_generation,
    ("POST", "/continue_generation"): SGLangTestServer.continue_generation,
    ("POST", "/load_lora_adapter_from_tensors"): SGLangTestServer.load_lora_adapter_from_tensors,
    ("POST", "/unload_lora_adapter"): SGLangTestServer.unload_lora_adapter,
    # test hook, not in SGLang: request counts per path, for tests that run the double as a process
    ("GET", "/test_double/requests"): lambda s, b: dict(s.requests),
    ("GET", "/test_double/distributed_updates"): lambda s, b: [[g, n] for g, n in s.distributed_updates],
}


class _Server(ThreadingHTTPServer):
    request_queue_size = 2048  # the listen backlog uvicorn gives SGLang (5 by default here: resets under load)


class _Handler(BaseHTTPRequestHandler):
    owner: SGLangTestServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # keep test output quiet
        logger.debug("%s " + fmt, self.address_string(), *args)

    def setup(self) -> None:
        super().setup()
        with self.owner._cond:
            self.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.owner._cond:
            self.owner._connections.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    def _serve(self, method: str) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                raise _invalid_request("request body is not valid JSON") from None
            status, result = 200, self.owner.handle(method, path, self.headers, body)
        except _HTTPError as e:
            status, result = e.status, e.body
        except ConnectionAbortedError:
            self.close_connection = True
            return
        except Exception as e:  # noqa: BLE001 - a server bug is a 500, as in SGLang
            logger.exception("test server error on %s", path)
            status, result = 500, {"error": {"message": f"{type(e).__name__}: {e}"}}
        if self.owner._httpd is None:  # crashed while we worked: no answer
            self.close_connection = True
            return
        if result is JSON_NULL:
            result = payload = b"null"
        else:
            payload = (
                (result if isinstance(result, str) else json.dumps(result)).encode() if result is not None else b""
            )
        try:
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(result, str) else "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            self.close_connection = True

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_OPTIONS(self) -> None:
        self._serve("OPTIONS")


def main(argv: Sequence[str] | None = None) -> None:
    """Run the test double as a server process (its command line mirrors SGLang's)."""
    parser = argparse.ArgumentParser(
        description="TEST DOUBLE of an SGLang server (not SGLang), backed by a local CPU engine"
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--seconds-per-token", type=float, default=0.0, help="the double's decode time per token")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=0)
    parser.add_argument("--lora-target-modules", nargs="*", default=[])
    parser.add_argument("--max-running-requests", type=int, default=None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        logger.warning("test server ignores SGLang flags %s", unknown)
    engine = LocalEngine.from_pretrained(args.model_path, weight_version=args.weight_version, seed=args.seed)
    server = SGLangTestServer(
        engine,
        args.host,
        args.port,
        args.api_key,
        model_path=args.model_path,
        weights_cpu_backup=args.enable_weights_cpu_backup,
        deterministic=args.enable_deterministic_inference,
        seconds_per_token=args.seconds_per_token,
        lora=LoRAServing(args.max_lora_rank, args.lora_target_modules) if args.enable_lora else None,
        max_running_requests=args.max_running_requests,
    ).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    signal.signal(signal.SIGINT, lambda *a: stop.set())
    print(f"sglang test server listening on {server.url}", flush=True)
    while not stop.is_set() and server.failure is None:
        time.sleep(0.1)
    server.stop()
    if server.failure is not None:
        raise SystemExit(f"sglang test server failed: {server.failure}")


if __name__ == "__main__":
    main()
