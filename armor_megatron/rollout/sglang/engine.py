"""SGLang as a :class:`~armor_megatron.rollout.engine.RolloutEngine`: one or more servers over HTTP.

Generation sends one ``/generate`` request per prompt with ``n`` samples (SGLang prefills the
prompt once and the n samples share it; a group stays on one engine), at most
``max_concurrency`` in flight, to the router if there is one, else round-robin over the
engines. No ``sampling_seed`` is sent: SGLang 0.5.23 ignores it unless the server runs with
``--enable-deterministic-inference``, so a non-deterministic engine's samples are not
reproducible (the local engine's are). Admin calls (weight updates, memory release, pause) go
to every engine directly.

Deterministic mode (``deterministic=True``, ``rollout.sglang.deterministic``; the servers must
run with ``--enable-deterministic-inference``, which the launcher and the SLURM plan then pass):
sample j of a request gets ``sampling_seed = base + j`` (``base`` from :meth:`SGLangEngine.reseed`
or the request's own seed), so a run and its resumption sample the same responses. A
deterministic server gives every copy of an ``n > 1`` request one seed (identical copies), so a
prompt goes as a batch of n copies with one params dict each: n prefills instead of one, and
SGLang's batch-invariant kernels are slower than its default ones. Behind ``sglang-router``
(:mod:`armor_megatron.rollout.sglang.router`), which takes one params dict per request, that is
n requests per prompt (its cache-aware policy still sends them to the engine holding the
prefix). Keep the two sides consistent: a deterministic server answering a plain ``n`` request
returns n identical samples (each unseeded request gets seed 42), and a non-deterministic one
ignores the seeds.

An engine that dies behind the router is dropped by the router's health checks and generation
goes on through the others; :meth:`SGLangEngine.health` names it; when none is left, generation
fails with one line naming the router and the dead engines. (Weight updates still go to every
engine, so the next one fails naming the dead one.)

Log-probs: SGLang 0.5.23 reports ``log_softmax(logits / temperature)`` of the sampled tokens
(temperature 1 when greedy), as the local engine does and as the trainer recomputes them at
``rollout.temperature``; that is the one convention from engine to loss (TIS weights, the
``rollout/logprob_abs_diff`` gap). Never run the servers with ``SGLANG_RETURN_ORIGINAL_LOGPROB``
set: they would report temperature-1 values instead (the launcher refuses it).

Colocated mode (engines share the trainer's GPUs; servers run with ``--enable-memory-saver``), a
step's memory order (``trainer/device_memory.py``), so that no GPU holds the trainer and an engine's
static region at once: rollout → :meth:`release_memory` (:data:`MEMORY_TAGS`: weights, KV cache,
CUDA graphs) → trainer to the device → log-probs and update → trainer to the host and
``empty_cache`` → ``resume_memory(tags=("weights",))`` → push the weights (streamed from the
trainer's host copy: the push peaks at the engine's weights plus one bucket) →
``resume_memory(tags=("kv_cache", "cuda_graph"))``. While any tag is released the engine is
quiet: :meth:`generate` and the ``/health_generate`` probes refuse (SGLang would run their forward
on unmapped memory and die), launched colocated servers answer ``/health`` without generating and
a router in front of them runs without health checks. Released weights come back as memory, not
contents, until the next push (without ``--enable-weights-cpu-backup``); so an engine whose weights
do not change (the reference) releases only ``("kv_cache", "cuda_graph")``. Disaggregated mode
(engines on their own GPUs or nodes): never release; push weights with ``distributed`` or
``disk`` sync.

LoRA adapters (``lora.sync: adapter``, :mod:`armor_megatron.rollout.sglang.lora_adapters`):
:meth:`load_adapter` loads the policy's adapter on every server, names it in every policy
request (``lora_path``) and unloads the one before; ``generate(..., base=True)`` sends no
``lora_path``, so it samples the base weights (π_ref's anchors), next to policy requests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from armor_megatron.rollout.engine import (
    MEMORY_TAGS,
    EngineReplyError,
    EngineUnavailableError,
    RolloutEngine,
    Sample,
    SamplingParams,
    ShardedWeights,
    WeightSource,
    WeightUpdateError,
    check_memory_tags,
    check_prompts,
    check_versions,
)
from armor_megatron.rollout.sglang import lora_adapters
from armor_megatron.rollout.sglang.client import RetryPolicy, SGLangClient, parse_output
from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig, make_weight_sync

if TYPE_CHECKING:
    from armor_megatron.rollout.sglang.launcher import SGLangLauncher
    from armor_megatron.rollout.sglang.router import SGLangRouter

# /pause_generation modes (SGLang 0.5.23 PauseGenerationReqInput): "abort" (its default) aborts
# the requests in flight; "retract" puts them back in the queue (KV cache freed) and
# "in_place" keeps them where they are; both finish them after /continue_generation.
PAUSE_MODES = ("abort", "retract", "in_place")

logger = logging.getLogger(__name__)


def sglang_sampling_params(
    sampling: SamplingParams, n: int, seed: int | None = None
) -> dict[str, Any] | list[dict[str, Any]]:
    """``sampling_params`` of one prompt's request.

    A dict with ``n`` and no seed, or, with a ``seed`` (deterministic mode), one dict per sample
    with ``sampling_seed = seed + j``.

    SGLang 0.5.23 wants ``top_k`` = -1 to disable the filter (0 is a 400; ours disables it with
    any value <= 0) and an integer ``max_new_tokens`` (a float is a 400). A deterministic server
    gives every copy of an ``n > 1`` request the same ``sampling_seed``, so they would all come
    out identical; a batch of the prompt n times with one params dict per sample keeps them apart.
    ``sampling.seed`` itself is never sent: the caller resolves it into ``seed``.
    """
    params = sampling.to_sglang(n)
    params["max_new_tokens"] = int(params["max_new_tokens"])
    params["top_k"] = int(params["top_k"]) if params["top_k"] > 0 else -1
    params.pop("sampling_seed", None)
    if seed is None:
        return params
    return [{**params, "n": 1, "sampling_seed": int(seed) + j} for j in range(n)]


class SGLangEngine(RolloutEngine):
    """Engines at ``worker_urls`` (optionally fronted by the router at ``router_url``).

    ``weight_sync``: how :meth:`update_weights` pushes tensors (default: ``tensor`` mode).
    ``weight_version``: the version the engines hold now; read from the engines if not given
    (they must all report the same). ``launcher``, ``router_process`` (a started
    :class:`~armor_megatron.rollout.sglang.router.SGLangRouter`, whose URL is the default
    ``router_url``): stopped by :meth:`shutdown` if given. ``deterministic``: per-sample seeds
    for servers run with ``--enable-deterministic-inference`` (module docstring); default: the
    launcher's setting when launched, else False. ``vocab_size``: the served model's; replies
    with a token id outside it (or a log-prob above 0) raise EngineReplyError naming the server.
    """

    def __init__(
        self,
        worker_urls: Sequence[str],
        router_url: str | None = None,
        api_key: str | None = None,
        weight_sync: WeightSyncConfig | None = None,
        retry: RetryPolicy = RetryPolicy(),
        request_timeout: float = 600.0,
        max_concurrency: int = 256,
        weight_version: str | None = None,
        launcher: SGLangLauncher | None = None,
        router_process: SGLangRouter | None = None,
        deterministic: bool | None = None,
        vocab_size: int | None = None,
    ) -> None:
        if not worker_urls:
            raise ValueError("SGLangEngine needs at least one worker URL")

        def make(url: str) -> SGLangClient:
            return SGLangClient(url, api_key=api_key, request_timeout=request_timeout, retry=retry)

        self.workers = [make(u) for u in worker_urls]
        self.router_process = router_process
        if router_url is None and router_process is not None:
            router_url = router_process.url
        self.router = make(router_url) if router_url else None
        self.sync = make_weight_sync(self.workers, weight_sync or WeightSyncConfig())
        self.tp_size = (weight_sync or WeightSyncConfig()).tp_size
        self.adapter: str | None = None  # the LoRA adapter policy requests name (`load_adapter`); None: the base
        self.launcher = launcher
        if deterministic is None:
            deterministic = bool(launcher is not None and launcher.config.deterministic)
        self.deterministic = deterministic
        self.vocab_size = vocab_size  # token ids of replies are checked against it when given
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="sglang-generate")
        self._next = itertools.count()
        self._lock = threading.Lock()
        if weight_version is None:
            versions = {c.url: c.weight_version(timeout=request_timeout) for c in self.workers}
            if len(set(versions.values())) != 1:
                raise RuntimeError(f"engines hold different weight versions: {versions}")
            weight_version = next(iter(versions.values()))
        self.weight_version = str(weight_version)
        self._seed: int | None = None
        self._calls = itertools.count()
        self._released: set[str] = set()  # memory tags released by this client (colocated mode)
        self.sync.clear_stale_sessions()  # a trainer that died mid-push may have left one open

    @classmethod
    def launch(cls, launcher: SGLangLauncher, **kwargs: Any) -> SGLangEngine:
        """Start ``launcher`` (:class:`~armor_megatron.rollout.sglang.launcher.SGLangLauncher`) and attach to it."""
        launcher.start()
        return cls(
            launcher.worker_urls,
            router_url=launcher.router_url,
            api_key=launcher.config.api_key,
            launcher=launcher,
            **kwargs,
        )

    def _generation_client(self) -> SGLangClient:
        if self.router is not None:
            return self.router
        return self.workers[next(self._next) % len(self.workers)]

    def _prompt_requests(
        self, params: dict[str, Any] | list[dict[str, Any]]
    ) -> list[tuple[SGLangClient, dict[str, Any] | list[dict[str, Any]]]]:
        """The ``(client, sampling_params)`` requests of one prompt: one, except per-sample params through the router."""
        client = self._generation_client()
        if client is self.router and isinstance(params, list):
            return [(client, p) for p in params]  # sglang-router 0.3.2 answers 422 to a list of params
        return [(client, params)]

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
        return_logprob: bool = True,
        base: bool = False,
    ) -> list[list[Sample]]:
        """``n`` samples per prompt from the SGLang servers, spread over them.

        With a loaded adapter (:meth:`load_adapter`) requests name it, unless ``base``: then they
        sample the base weights, and their samples carry the server's version unchecked.
        """
        check_prompts(prompts_token_ids, n)
        self._check_holding("generate")
        deadline = None if timeout is None else time.monotonic() + timeout
        requests = [
            self._prompt_requests(sglang_sampling_params(sampling, n, self._request_seed(sampling, n)))
            for _ in prompts_token_ids
        ]
        prompt_clients = [[client for client, _ in rs] for rs in requests]
        lora_path = None if base else self.adapter
        per_prompt = [
            [
                self._pool.submit(client.generate, list(p), params, return_logprob, timeout, None, lora_path)
                for client, params in rs
            ]
            for p, rs in zip(prompts_token_ids, requests)
        ]
        futures = [f for fs in per_prompt for f in fs]
        try:
            groups = []
            for i, (fs, clients) in enumerate(zip(per_prompt, prompt_clients)):
                outputs = []  # (server URL, output)
                for f, client in zip(fs, clients):
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    outputs += [(client.url, out) for out in f.result(timeout=left)]
                if len(outputs) != n:
                    raise EngineReplyError(
                        f"SGLang server {', '.join(dict.fromkeys(u for u, _ in outputs)) or self._urls()}/generate: "
                        f"prompt {i}: {len(outputs)} samples, asked for {n}"
                    )
                groups.append([self._sample(out, i, k, url, return_logprob) for k, (url, out) in enumerate(outputs)])
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"generation of {len(prompts_token_ids)} prompts passed its {timeout}s timeout"
            ) from None
        except EngineUnavailableError as e:
            if self.router is None:
                raise
            raise EngineUnavailableError(
                f"generation through the SGLang router {self.router.url} failed, engines down: "
                f"{self.unhealthy_workers(timeout=5.0) or 'none'} of {len(self.workers)} ({e})"
            ) from None
        finally:
            for f in futures:
                f.cancel()
        check_versions(groups, None if base else self.weight_version)
        return groups

    def _sample(self, out: dict[str, Any], prompt: int, k: int, url: str, return_logprob: bool) -> Sample:
        """Output ``k`` of ``prompt`` from server ``url`` as a Sample, its ids and log-probs checked."""
        source = f"SGLang server {url}/generate"
        return parse_output(out, prompt, return_logprob, sample=k, source=source, vocab_size=self.vocab_size)

    def _urls(self) -> str:
        return self.router.url if self.router is not None else ", ".join(c.url for c in self.workers)

    def reseed(self, seed: int) -> None:
        """Deterministic mode.

        Requests without a seed of their own get seeds ``seed + k·n ...`` from now on (k counts
        requests); otherwise no seed is sent and this only records it.

        As :meth:`LocalEngine.reseed <armor_megatron.rollout.local.LocalEngine.reseed>`: the
        trainer reseeds every step, so a resumed run sends the seeds the uninterrupted run sent,
        and a deterministic server (batch-invariant kernels, seeds hashed with the position)
        samples what it sampled.
        """
        with self._lock:
            self._seed = int(seed)
            self._calls = itertools.count()

    def _request_seed(self, sampling: SamplingParams, n: int) -> int | None:
        """The first of the request's n seeds in deterministic mode, else None.

        Never None in deterministic mode, even for an unseeded request: a deterministic server
        seeds unseeded requests alike, so each request gets seeds of its own.
        """
        if not self.deterministic:
            return None
        if sampling.seed is not None:
            return sampling.seed
        with self._lock:
            return (self._seed or 0) + n * next(self._calls)

    def update_weights(self, weights: WeightSource, version: str, timeout: float | None = None) -> None:
        """Push HF-named tensors with the configured sync mode, or load an HF checkpoint directory.

        Weights spread over the trainer's ranks (:class:`ShardedWeights`, a Megatron export) are
        delivered by each owner rank itself where the mode allows (``tensor``, ``disk``).
        """
        with self._lock:
            if isinstance(weights, (str, os.PathLike)):
                self.sync.load_from_disk(os.fspath(weights), str(version))
            elif isinstance(weights, ShardedWeights):
                self.sync.push_sharded(weights, str(version))
            else:
                self.sync.push(weights, str(version))
            self.weight_version = str(version)

    def load_adapter(
        self, name: str, config: dict[str, Any], tensors: dict[str, Any], version: str, timeout: float | None = None
    ) -> int:
        """Load the policy's LoRA adapter ``name`` on every server, then name it in policy requests; its bytes.

        ``config``: the PEFT ``adapter_config.json``; ``tensors``: A and B of every adapted
        projection under PEFT's names, whole. Once every server holds it, the servers take
        ``version`` (``/update_weight_version``, requests in flight kept) and every other adapter
        of this project's naming (the previous step's, or one a killed run left) is unloaded.
        A name already loaded (a resumed run repeating a step) is unloaded and loaded again.
        Returns the adapter's bytes (every TP rank of every server receives them whole).
        """
        with self._lock:
            loaded: dict[str, dict[str, str]] = {}
            for c in self.workers:
                try:
                    loaded[c.url] = lora_adapters.load_adapter(c, name, config, tensors, self.tp_size, timeout)
                except WeightUpdateError as e:
                    if "already loaded" not in str(e):
                        raise
                    lora_adapters.unload_adapter(c, name, timeout)
                    loaded[c.url] = lora_adapters.load_adapter(c, name, config, tensors, self.tp_size, timeout)
            self._post_all(
                "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}, timeout
            )
            self.adapter, self.weight_version = name, str(version)
            for c in self.workers:  # after every server names the new one: no request names a stale one now
                for stale in loaded[c.url]:
                    if stale != name and stale.startswith(lora_adapters.ADAPTER_PREFIX):
                        lora_adapters.unload_adapter(c, stale, timeout)
            return lora_adapters.adapter_bytes(tensors)

    def unhealthy_workers(self, timeout: float | None = None) -> list[str]:
        """URLs of the engines that do not answer ``/health_generate`` within ``timeout`` (checked concurrently)."""
        self._check_holding("check health (/health_generate generates)")
        with concurrent.futures.ThreadPoolExecutor(len(self.workers), thread_name_prefix="sglang-health") as pool:
            healthy = list(pool.map(lambda c: c.health(generate=True, timeout=timeout or 30.0), self.workers))
        return [c.url for c, ok in zip(self.workers, healthy) if not ok]

    def health(self, timeout: float | None = None) -> bool:
        """True if every engine (and the router, if any) is healthy; logs the engines that are not."""
        dead = self.unhealthy_workers(timeout)
        if dead:
            logger.warning(
                "SGLang engines not healthy: %s of %d%s",
                dead,
                len(self.workers),
                f"; the router {self.router.url} routes around them" if self.router is not None else "",
            )
        router_ok = self.router is None or self.router.health(timeout=timeout or 30.0)
        if not router_ok and self.router is not None:
            logger.warning("SGLang router %s not healthy", self.router.url)
        return not dead and router_ok

    def _post_all(self, path: str, body: dict[str, Any], timeout: float | None) -> None:
        for c in self.workers:
            c.post(path, body, timeout=timeout)

    def release_memory(self, timeout: float | None = None, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Colocated mode: free ``tags`` on the servers before the trainer comes to the device.

        Colocated mode: free ``tags`` (default weights, KV cache and CUDA graphs) before the
        trainer comes to the device; the servers must be idle (module docstring: the order).
        """
        check_memory_tags(tags)
        self._released |= set(tags)  # before the request: one that fails half-way leaves some released
        self._post_all("/release_memory_occupation", {"tags": list(tags)}, timeout)

    def resume_memory(self, timeout: float | None = None, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Colocated mode: take ``tags`` back after the trainer left the device (with its ``empty_cache``).

        Resumed weights are memory only until the next weight push.
        """
        check_memory_tags(tags)
        self._post_all("/resume_memory_occupation", {"tags": list(tags)}, timeout)
        self._released -= set(tags)

    @property
    def released_tags(self) -> frozenset[str]:
        """The memory tags released now (colocated mode); nothing may generate while any is."""
        return frozenset(self._released)

    def _check_holding(self, what: str) -> None:
        """Refuse a generating request while memory is released.

        SGLang would run its forward on unmapped memory and die (it neither refuses nor holds such
        a request back).
        """
        if self._released:
            raise RuntimeError(
                f"cannot {what} while the engines' memory {sorted(self._released)} is released; "
                "resume it first (the colocated order in trainer/device_memory.py)"
            )

    @contextlib.contextmanager
    def released(self, tags: Sequence[str] = MEMORY_TAGS, timeout: float | None = None) -> Iterator[SGLangEngine]:
        """``with engine.released(tags): ...`` frees ``tags``, then takes them back.

        For a phase that leaves the engine's weights alone (``tags=("kv_cache", "cuda_graph")``);
        with the default tags, push weights before generating again (module docstring: the order).
        """
        self.release_memory(timeout=timeout, tags=tags)
        try:
            yield self
        finally:
            self.resume_memory(timeout=timeout, tags=tags)

    def pause(self, timeout: float | None = None, mode: str = "retract") -> None:
        """Stop scheduling; requests in flight wait (``retract``/``in_place``) or are aborted (``abort``).

        SGLang's own default is ``abort`` (an empty body): the client names the mode always.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._post_all("/pause_generation", {"mode": mode}, timeout)

    def resume(self, timeout: float | None = None) -> None:
        """Continue generation on every server."""
        self._post_all("/continue_generation", {}, timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the request threads, the weight sync and the processes this engine started."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sync.close()
        if self.router_process is not None:
            self.router_process.stop(timeout=timeout or 30.0)
        if self.launcher is not None:
            self.launcher.stop(timeout=timeout or 30.0)
