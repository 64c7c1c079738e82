"""Over-provisioned group generation that stops at its target, aborts the rest and keeps their tokens.

One :meth:`PartialGenerator.generate` call is one step's rollout against SGLang servers through
their :class:`~armor_megatron.rollout.sglang.client.SGLangClient` (requests spread over them in
turn; an abort goes to the server that holds the request; a continuation, being token ids,
may run on any of them):

1. the responses left unfinished by earlier steps are continued first, from their token ids
   (:class:`~armor_megatron.rollout.partial.PartialBuffer`); groups completed after the last
   step's target was met are offered first, as they are;
2. new groups are requested until ``ceil(target · over_provision)`` groups are in flight;
   every response is its own request (rid ``<group>/<k>/<n>.``), so each is aborted alone;
3. a group counts when all G responses have finished; ``accept(request, responses)`` is dynamic sampling's
   filter (False: the group carries no signal; its place is refilled from new groups at once,
   without waiting for a round);
4. once ``target`` groups are accepted, every response still decoding is aborted, except
   those the staleness rule ``finish`` says must end in this step; the aborted ones answer with
   their tokens so far, which go into the buffer; nothing generated is thrown away, save what the
   staleness rule ``drop`` discards (counted).

Every response's tokens keep the policy version that generated them
(:class:`~armor_megatron.rollout.partial.Finished` spans). Single-turn, on-policy groups only:
anchors and multi-turn responses are not generated here.

Deterministic mode (``seed``; servers run with ``--enable-deterministic-inference``): every
request carries ``sampling_seed`` = :func:`request_seed` of (seed, group key, response index,
continuation count), so a response, and each continuation of it from the same tokens, samples
the same tokens in every run that reaches it. Which responses a step aborts, and where, is
decided by time (the order requests finish in), not by seeds.

Stopping (``stop()``, polled while requests run; the trainer's preemption signal): every request
in flight is aborted, including those the rule ``finish`` keeps; their tokens go to the buffer,
the groups complete or handed out stay in progress, and :class:`GenerationStopped` is raised:
the state (:meth:`PartialGenerator.state_dict`) then holds every token generated.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from armor_megatron.rollout.partial import Finished, PartialBuffer, PartialResponse, versions_spanned
from armor_megatron.rollout.sglang.client import SGLangClient, parse_output

STOP_POLL_S = 0.1  # how often a generation with a ``stop`` asks it


class GenerationStopped(RuntimeError):
    """``stop()`` said stop: the requests in flight were aborted and their tokens kept (the generator's state)."""


def request_seed(seed: int, group: str, index: int, continuation: int) -> int:
    """``sampling_seed`` of one request: a 62-bit hash of its four arguments.

    ``seed``: the run's; ``group``: the group's key; ``index``: the response's in its group;
    ``continuation``: how many times the response was continued before (0: its first request).
    """
    key = f"{seed}/{group}/{index}/{continuation}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 2


@dataclasses.dataclass(frozen=True)
class GroupRequest:
    """A new group: ``key`` names it, ``prompt_ids`` its prompt, ``max_new_tokens`` the limit of each of its G responses."""

    key: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: tuple[int, ...]


@dataclasses.dataclass
class _Group:
    request: GroupRequest
    done: dict[int, Finished]
    must_finish: bool = False


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, linearly interpolated (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class PartialGenerator:
    """Partial rollouts of groups over SGLang servers (``client``: one, or a list); state: :meth:`state_dict`.

    ``sampling``: SGLang ``sampling_params`` of every response (``n`` 1; ``max_new_tokens`` comes
    from each group's request); ``over_provision`` >= 1: groups in flight per group needed;
    ``seed``: deterministic mode, a ``sampling_seed`` per request (module docs; None: none sent);
    ``stop``: polled every :data:`STOP_POLL_S` while requests run (module docs). :meth:`close`
    stops its request threads.
    """

    def __init__(
        self,
        client: SGLangClient | Sequence[SGLangClient],
        sampling: dict[str, Any],
        buffer: PartialBuffer,
        over_provision: float = 1.5,
        timeout: float | None = None,
        workers: int = 256,
        seed: int | None = None,
        stop: Callable[[], bool] | None = None,
    ):
        if over_provision < 1:
            raise ValueError(f"over_provision must be >= 1, got {over_provision}")
        self.clients = [client] if isinstance(client, SGLangClient) else list(client)
        if not self.clients:
            raise ValueError("PartialGenerator needs at least one SGLang client")
        self.sampling, self.buffer = dict(sampling), buffer
        self.over_provision, self.timeout = over_provision, timeout
        self.seed, self.stop = seed, stop
        self._groups: dict[str, _Group] = {}  # groups started and not yet handed out, by key
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="partial-rollout")
        self._serial = 0
        self._in_flight: dict[
            concurrent.futures.Future[Any], tuple[str, int, PartialResponse | None, str, SGLangClient]
        ] = {}

    def close(self) -> None:
        """Abort the requests a failed generation left in flight, then stop the request threads."""
        for _, _, _, rid, client in list(self._in_flight.values()):
            with contextlib.suppress(Exception):  # a server that is gone has nothing left to abort
                client.abort(rid)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def give_back(self, groups: Sequence[tuple[GroupRequest, list[Finished]]]) -> None:
        """Take back groups :meth:`generate` handed out (not trained): complete, they are offered first next time."""
        back = {request.key: _Group(request, dict(enumerate(members))) for request, members in groups}
        self._groups = {**back, **self._groups}

    def generate(
        self,
        supply: Iterator[GroupRequest],
        target: int,
        version: str,
        accept: Callable[[GroupRequest, list[Finished]], bool] | None = None,
    ) -> tuple[list[tuple[GroupRequest, list[Finished]]], dict[str, float]]:
        """``target`` accepted groups (each with its G responses in order) and this step's metrics.

        ``supply`` yields new groups on demand; ``version``: the policy the engine holds now.
        """
        start = time.monotonic()
        counts_before = dict(self.buffer.counts)
        accepted: list[tuple[GroupRequest, list[Finished]]] = []
        filtered = generated = 0
        finish_times: list[float] = []
        running: dict[concurrent.futures.Future[Any], tuple[str, int, PartialResponse | None, str, SGLangClient]] = {}
        self._in_flight = running  # what an error leaves in flight, aborted by close
        stopping = False  # stop() said stop: everything in flight aborted, nothing handed out

        def submit(group: _Group, k: int, partial: PartialResponse | None) -> None:
            self._serial += 1
            rid = f"{group.request.key}/{k}/{self._serial}."  # the dot: SGLang aborts by rid prefix
            if partial is None:
                ids, left = list(group.request.prompt_ids), group.request.max_new_tokens[k]
            else:
                ids, left = partial.continuation_ids(), partial.tokens_left
            params = {**self.sampling, "n": 1, "max_new_tokens": left}
            if self.seed is not None:
                continuation = 0 if partial is None else partial.continuations + 1
                params["sampling_seed"] = request_seed(self.seed, group.request.key, k, continuation)
            client = self.clients[self._serial % len(self.clients)]
            future = self._pool.submit(client.generate, ids, params, True, self.timeout, rid)
            running[future] = (group.request.key, k, partial, rid, client)

        def take_complete(key: str) -> None:
            nonlocal filtered
            group = self._groups[key]
            members = [group.done[k] for k in range(len(group.request.max_new_tokens))]
            if len(accepted) >= target or stopping:
                return  # complete after the target: offered first next step
            try:
                keep = accept is None or accept(group.request, members)
            except Exception:
                if self.stop is not None and self.stop():
                    return  # the stop interrupted its judging: it stays in progress, complete
                raise
            del self._groups[key]
            if keep:
                accepted.append((group.request, members))
            else:
                filtered += 1

        # 1. groups completed late last step, then continuations
        for key in [k for k, g in self._groups.items() if len(g.done) == len(g.request.max_new_tokens)]:
            take_complete(key)
        for cont in self.buffer.take(version, reference=None):
            key, k = cont.partial.group, int(cont.partial.key.rsplit("/", 1)[1])
            self._groups[key].must_finish |= cont.must_finish
            submit(self._groups[key], k, cont.partial)
        for key in list(self._groups):  # a group whose unfinished responses were all dropped starts them over
            group = self._groups[key]
            busy = {entry[1] for entry in running.values() if entry[0] == key}
            for k in range(len(group.request.max_new_tokens)):
                if k not in group.done and k not in busy:
                    submit(group, k, None)

        def top_up() -> None:
            want = math.ceil(target * self.over_provision)
            while len(accepted) < target and len(self._groups) + len(accepted) < want:
                request = next(supply, None)
                if request is None:
                    return
                if request.key in self._groups:
                    raise ValueError(f"group {request.key!r} is already being generated")
                group = self._groups[request.key] = _Group(request, {})
                for k in range(len(request.max_new_tokens)):
                    submit(group, k, None)

        def abort(keep: set[str]) -> None:
            for key, _, _, rid, client in list(running.values()):
                if key not in keep:
                    client.abort(rid)

        top_up()
        aborting = False
        poll = None if self.stop is None else STOP_POLL_S
        while running:
            done, _ = concurrent.futures.wait(list(running), poll, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in [f for f in running if f in done]:  # in the order requested
                key, k, partial, _, _ = running.pop(future)
                [out] = future.result()
                more = parse_output(out, 0, True)
                generated += more.num_tokens
                group = self._groups[key]
                if partial is None and more.finish_reason == "abort":
                    result: PartialResponse | Finished = (
                        PartialResponse.from_sample(
                            more, f"{key}/{k}", key, group.request.prompt_ids, group.request.max_new_tokens[k]
                        )
                        if more.num_tokens < group.request.max_new_tokens[k]
                        else Finished.of(dataclasses.replace(more, finish_reason="length"))
                    )
                elif partial is None:
                    result = Finished.of(more)
                else:
                    result = partial.extended(more)
                if isinstance(result, PartialResponse):
                    self.buffer.add(result)
                    continue
                group.done[k] = result
                finish_times.append(time.monotonic() - start)
                if len(group.done) == len(group.request.max_new_tokens):
                    take_complete(key)
            if not stopping and self.stop is not None and self.stop():
                stopping = aborting = True
                abort(keep=set())  # the rule finish's responses too: their tokens are kept all the same
            elif len(accepted) >= target and not aborting:
                aborting = True
                abort(keep={key for key, g in self._groups.items() if g.must_finish})
            elif not aborting:
                top_up()
        if stopping:
            self.give_back(accepted)
            raise GenerationStopped(
                f"generation stopped: {len(self.buffer)} responses buffered, {len(self._groups)} groups in progress"
            )

        after = self.buffer.counts
        responses = [m for _, members in accepted for m in members]
        metrics = {
            "partial/continued": float(after["continued"] - counts_before["continued"]),
            "partial/tokens_carried": float(after["tokens_carried"] - counts_before["tokens_carried"]),
            "partial/surplus_aborted": float(after["surplus_aborted"] - counts_before["surplus_aborted"]),
            "partial/dropped_stale": float(after["dropped_stale"] - counts_before["dropped_stale"]),
            "partial/wasted_tokens": float(after["dropped_tokens"] - counts_before["dropped_tokens"]),
            "partial/buffered": float(len(self.buffer)),
            "partial/filtered_groups": float(filtered),
            "partial/generated_tokens": float(generated),
            "time/generation": time.monotonic() - start,
            "time/generation_p50": percentile(finish_times, 0.5),
            "time/generation_p99": percentile(finish_times, 0.99),
            **{k.replace("rollout/", "partial/"): v for k, v in versions_spanned([m.spans for m in responses]).items()},
        }
        return accepted, metrics

    def state_dict(self) -> dict[str, Any]:
        """The buffer and the groups in progress (their finished responses), as plain data."""
        return {
            "buffer": self.buffer.state_dict(),
            "groups": [
                {
                    "key": g.request.key,
                    "prompt_ids": list(g.request.prompt_ids),
                    "max_new_tokens": list(g.request.max_new_tokens),
                    "done": {str(k): f.to_state() for k, f in g.done.items()},
                    "must_finish": g.must_finish,
                }
                for g in self._groups.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator must be idle)."""
        self.buffer.load_state_dict(state["buffer"])
        self._groups = {}
        for g in state["groups"]:
            request = GroupRequest(str(g["key"]), tuple(g["prompt_ids"]), tuple(g["max_new_tokens"]))
            done = {int(k): Finished.from_state(f) for k, f in g["done"].items()}
            self._groups[request.key] = _Group(request, done, bool(g["must_finish"]))
