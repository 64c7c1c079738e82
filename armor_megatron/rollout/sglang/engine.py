"""SGLang as a :class:`~armor_megatron.rollout.engine.RolloutEngine`: one or more servers over HTTP.

Generation sends one ``/generate`` request per prompt (with ``n`` samples, so a group stays on
one engine and shares its prefix cache), at most ``max_concurrency`` in flight, to the
router if there is one, else round-robin over the engines. Admin calls (weight updates,
memory release, pause) go to every engine directly.

Log-probs: SGLang reports ``log_softmax(logits / temperature)`` of the sampled tokens unless
the server runs with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``, then the model's own log-probs at
temperature 1 (what the local engine returns and a trainer recomputes). The launcher sets
it by default; set it yourself on servers you attach to.

Colocated mode (engines share the trainer's GPUs): call :meth:`release_memory` before the
training phase and :meth:`resume_memory` after it, then push weights. Disaggregated mode
(engines on their own GPUs or nodes): never release; push weights with ``distributed`` or
``disk`` sync.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Sequence

from armor_megatron.rollout.engine import (
    RolloutEngine,
    SamplingParams,
    ShardedWeights,
    WeightSource,
    check_prompts,
    check_versions,
)
from armor_megatron.rollout.sglang.client import RetryPolicy, SGLangClient, parse_output
from armor_megatron.rollout.sglang.weight_sync import WeightSyncConfig, make_weight_sync

MEMORY_TAGS = ("weights", "kv_cache")
# /pause_generation modes (SGLang 0.5.23 PauseGenerationReqInput): "abort" (its default) aborts
# the requests in flight; "retract" puts them back in the queue (KV cache freed) and
# "in_place" keeps them where they are; both finish them after /continue_generation.
PAUSE_MODES = ("abort", "retract", "in_place")


def sglang_sampling_params(sampling: SamplingParams, n: int, seed: int | None) -> dict | list[dict]:
    """``sampling_params`` of one prompt's request: a dict with ``n``, or one dict per sample.

    SGLang 0.5.23 wants ``top_k`` = -1 to disable the filter (0 is a 400; ours disables it with
    any value <= 0) and an integer ``max_new_tokens`` (a float is a 400). With a ``seed`` the n
    samples get seeds ``seed + j``: SGLang gives every copy of an ``n > 1`` request the same
    ``sampling_seed``, so they would all come out identical; a batch of the prompt n times with
    one params dict per sample (one request, one engine) keeps them apart.
    """
    params = sampling.to_sglang(n)
    params["max_new_tokens"] = int(params["max_new_tokens"])
    params["top_k"] = int(params["top_k"]) if params["top_k"] > 0 else -1
    if seed is None:
        params.pop("sampling_seed", None)
        return params
    return [{**params, "n": 1, "sampling_seed": int(seed) + j} for j in range(n)]


class SGLangEngine(RolloutEngine):
    """Engines at ``worker_urls`` (optionally fronted by ``router_url``).

    ``weight_sync``: how :meth:`update_weights` pushes tensors (default: ``tensor`` mode).
    ``weight_version``: the version the engines hold now; read from the engines if not given
    (they must all report the same). ``launcher``: stopped by :meth:`shutdown` if given.
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
        launcher=None,
    ):
        if not worker_urls:
            raise ValueError("SGLangEngine needs at least one worker URL")
        make = lambda url: SGLangClient(url, api_key=api_key, request_timeout=request_timeout, retry=retry)  # noqa: E731
        self.workers = [make(u) for u in worker_urls]
        self.router = make(router_url) if router_url else None
        self.sync = make_weight_sync(self.workers, weight_sync or WeightSyncConfig())
        self.launcher = launcher
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
        self.sync.clear_stale_sessions()  # a trainer that died mid-push may have left one open

    @classmethod
    def launch(cls, launcher, **kwargs) -> SGLangEngine:
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

    def generate(
        self,
        prompts_token_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        timeout: float | None = None,
        return_logprob: bool = True,
    ) -> list:
        check_prompts(prompts_token_ids, n)
        deadline = None if timeout is None else time.monotonic() + timeout
        futures = [
            self._pool.submit(
                self._generation_client().generate,
                list(p),
                sglang_sampling_params(sampling, n, self._request_seed(sampling, n)),
                return_logprob,
                timeout,
            )
            for p in prompts_token_ids
        ]
        try:
            groups = []
            for i, f in enumerate(futures):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                outputs = f.result(timeout=left)
                if len(outputs) != n:
                    raise RuntimeError(f"prompt {i}: engine returned {len(outputs)} samples, asked for {n}")
                groups.append([parse_output(o, i, return_logprob) for o in outputs])
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"generation of {len(futures)} prompts passed its {timeout}s timeout") from None
        finally:
            for f in futures:
                f.cancel()
        check_versions(groups, self.weight_version)
        return groups

    def reseed(self, seed: int) -> None:
        """Requests without a seed of their own get seeds ``seed + k·n ...`` from now on (k counts requests).

        As :meth:`LocalEngine.reseed <armor_megatron.rollout.local.LocalEngine.reseed>`: the
        trainer reseeds every step, so a resumed run sends the seeds the uninterrupted run sent.
        (Equal seeds give equal samples only on the same server build and batch; SGLang's
        sampling is seeded per request, not bitwise reproducible across batch compositions.)
        """
        with self._lock:
            self._seed = int(seed)
            self._calls = itertools.count()

    def _request_seed(self, sampling: SamplingParams, n: int) -> int | None:
        if sampling.seed is not None:
            return sampling.seed
        if self._seed is None:
            return None
        with self._lock:
            return self._seed + n * next(self._calls)

    def update_weights(self, weights: WeightSource, version: str, timeout: float | None = None) -> None:
        """Push HF-named tensors with the configured sync mode, or load an HF checkpoint directory.

        Weights spread over the trainer's ranks (:class:`ShardedWeights`, a Megatron export) are
        delivered by each owner rank itself where the mode allows (``tensor``, ``disk``)."""
        with self._lock:
            if isinstance(weights, (str, os.PathLike)):
                self.sync.load_from_disk(os.fspath(weights), str(version))
            elif isinstance(weights, ShardedWeights):
                self.sync.push_sharded(weights, str(version))
            else:
                self.sync.push(weights, str(version))
            self.weight_version = str(version)

    def health(self, timeout: float | None = None) -> bool:
        return all(c.health(generate=True, timeout=timeout or 30.0) for c in self.workers)

    def _post_all(self, path: str, body: dict, timeout: float | None) -> None:
        for c in self.workers:
            c.post(path, body, timeout=timeout)

    def release_memory(self, timeout: float | None = None, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Colocated mode: free weights and KV cache before the trainer runs."""
        self._post_all("/release_memory_occupation", {"tags": list(tags)}, timeout)

    def resume_memory(self, timeout: float | None = None, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._post_all("/resume_memory_occupation", {"tags": list(tags)}, timeout)

    @contextlib.contextmanager
    def released(self, tags: Sequence[str] = MEMORY_TAGS, timeout: float | None = None):
        """Colocated training phase: ``with engine.released(): train()`` frees, then takes back, GPU memory."""
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
        self._post_all("/continue_generation", {}, timeout)

    def shutdown(self, timeout: float | None = None) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.sync.close()
        if self.launcher is not None:
            self.launcher.stop(timeout=timeout or 30.0)
