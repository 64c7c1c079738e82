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
   staleness rule ``drop`` discards (counted);
5. under rule ``finish``, a group started ``max_versions − 1`` calls (steps) ago is *due*: its
   tokens would be too old for the next step, so it is generated to its end and a place of the
   target is kept for it (groups not due are accepted only while places are left; new ones are
   still started and decode until the target is met).

Every response's tokens keep the policy version that generated them
(:class:`~armor_megatron.rollout.partial.Finished` spans). Single-turn responses only.

Anchors: a group's anchor (a complete, verified π_ref response) is looked up by the caller
before the group is requested and travels with it (:attr:`GroupRequest.anchor`, with the
reference ``reference`` that sampled it); the request then asks for the G−1 on-policy responses
only. The generator never samples π_ref. A group carried across a reference reset keeps its
anchor only under the same reference: :meth:`PartialGenerator.stale_anchors` names the groups
whose anchor another reference produced, and :meth:`PartialGenerator.reanchor` gives each a fresh
anchor, or none and one more on-policy member (the discarded anchors count in
``anchors_discarded``).

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

from armor_megatron.rollout.anchor.sampler import AnchorResult
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
    """A new group: ``key`` names it, ``prompt_ids`` its prompt, ``max_new_tokens`` the limit of each of its on-policy responses.

    ``anchor``: the group's anchor lookup (found or not), made before the request, and
    ``reference`` the π_ref version it was made under; None for groups without anchors. The
    caller sizes ``max_new_tokens``: G−1 responses beside a kept anchor, G otherwise.
    """

    key: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: tuple[int, ...]
    anchor: AnchorResult | None = None
    reference: str | None = None

    def anchored_elsewhere(self, reference: str) -> bool:
        """Whether it holds a found anchor of another reference than ``reference``."""
        return self.anchor is not None and self.anchor.found and self.reference != reference


@dataclasses.dataclass
class _Group:
    request: GroupRequest
    done: dict[int, Finished]
    must_finish: bool = False
    started: int = 0  # the generate call that started it


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
        self._counts_reported = dict(buffer.counts)  # the buffer's counters at the last metrics
        self._calls = 0  # generate calls made (one per step): a group's age is counted in them
        self._handed_out: dict[str, _Group] = {}  # the last call's accepted groups, as they were in progress

    @property
    def groups_in_progress(self) -> int:
        """Groups started and not yet handed out (they count towards the next step's groups in flight)."""
        return len(self._groups)

    def stale_anchors(self, reference: str) -> list[GroupRequest]:
        """The groups in progress holding a found anchor of another reference than ``reference``, oldest first."""
        return [g.request for g in self._groups.values() if g.request.anchored_elsewhere(reference)]

    def reanchor(self, key: str, anchor: AnchorResult, reference: str, max_new_tokens: tuple[int, ...]) -> None:
        """Replace group ``key``'s stale anchor by ``anchor`` (a lookup under ``reference``), counted as discarded.

        ``max_new_tokens``: its on-policy responses from now on, the ones it has followed by any
        new ones (one more when the fresh lookup found no anchor to keep); the next
        :meth:`generate` requests the new ones.
        """
        group = self._groups[key]
        old = group.request.max_new_tokens
        if max_new_tokens[: len(old)] != old:
            raise ValueError(f"group {key!r} keeps its {len(old)} responses {old}; got {max_new_tokens}")
        group.request = dataclasses.replace(
            group.request, anchor=anchor, reference=reference, max_new_tokens=max_new_tokens
        )
        self.buffer.counts["anchors_discarded"] += 1

    def close(self) -> None:
        """Abort the requests a failed generation left in flight, then stop the request threads."""
        for _, _, _, rid, client in list(self._in_flight.values()):
            with contextlib.suppress(Exception):  # a server that is gone has nothing left to abort
                client.abort(rid)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def give_back(self, groups: Sequence[tuple[GroupRequest, list[Finished]]]) -> None:
        """Undo the last :meth:`generate` call's hand-out: its step did not train and will run again.

        The groups (complete) are offered first next time, with the age they had; the call is not
        counted, so the step run again sees every group in progress at the age it saw.
        """
        back = {request.key: self._handed_out[request.key] for request, _ in groups}
        self._groups = {**back, **self._groups}
        self._handed_out = {}
        self._calls -= 1

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
        counts_before = self._counts_reported  # :meth:`reanchor` counts before the step's call
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

        # Rule finish: a group trains at most max_versions − 1 steps after it started (its first tokens are
        # then that many versions old): one of that age is due, runs to its end and has a place of the target.
        self._calls += 1
        self._handed_out = {}
        age = self.buffer.max_versions - 1 if self.buffer.on_stale == "finish" else math.inf
        due = {k for k, g in self._groups.items() if self._calls - g.started >= age}
        for key in due:
            self._groups[key].must_finish = True

        def open_places() -> int:
            """Places of the target left for groups that are not due."""
            return target - len(accepted) - sum(k in self._groups for k in due)

        def take_complete(key: str) -> None:
            nonlocal filtered
            group = self._groups[key]
            members = [group.done[k] for k in range(len(group.request.max_new_tokens))]
            if len(accepted) >= target or stopping or (key not in due and open_places() <= 0):
                return  # complete after the target: offered first next step
            try:
                keep = accept is None or accept(group.request, members)
            except Exception:
                if self.stop is not None and self.stop():
                    return  # the stop interrupted its judging: it stays in progress, complete
                raise
            self._handed_out[key] = self._groups.pop(key)
            if keep:
                accepted.append((group.request, members))
            else:
                filtered += 1
                if key in due:  # its kept place opens: offer it to the groups complete meanwhile
                    offer_complete()

        def offer_complete() -> None:
            for key in [k for k, g in self._groups.items() if len(g.done) == len(g.request.max_new_tokens)]:
                if key in self._groups:  # not taken meanwhile (a filtered due group offers its place again)
                    take_complete(key)

        # 1. groups completed late last step, then continuations
        offer_complete()
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
                group = self._groups[request.key] = _Group(request, {}, started=self._calls)
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
            "partial/anchors_discarded": float(after["anchors_discarded"] - counts_before["anchors_discarded"]),
            "partial/wasted_tokens": float(after["dropped_tokens"] - counts_before["dropped_tokens"]),
            "partial/buffered": float(len(self.buffer)),
            "partial/filtered_groups": float(filtered),
            "partial/generated_tokens": float(generated),
            "time/generation": time.monotonic() - start,
            "time/generation_p50": percentile(finish_times, 0.5),
            "time/generation_p99": percentile(finish_times, 0.99),
            **{k.replace("rollout/", "partial/"): v for k, v in versions_spanned([m.spans for m in responses]).items()},
        }
        self._counts_reported = dict(after)
        return accepted, metrics

    def state_dict(self) -> dict[str, Any]:
        """The buffer, the calls made and the groups in progress (finished responses, anchor, age), as plain data."""
        return {
            "buffer": self.buffer.state_dict(),
            "calls": self._calls,
            "groups": [
                {
                    "key": g.request.key,
                    "prompt_ids": list(g.request.prompt_ids),
                    "max_new_tokens": list(g.request.max_new_tokens),
                    "done": {str(k): f.to_state() for k, f in g.done.items()},
                    "must_finish": g.must_finish,
                    "started": g.started,
                    "anchor": None if g.request.anchor is None else g.request.anchor.to_state(),
                    "reference": g.request.reference,
                }
                for g in self._groups.values()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the generator must be idle)."""
        self.buffer.load_state_dict(state["buffer"])
        self._counts_reported = dict(self.buffer.counts)
        self._calls = int(state["calls"])
        self._groups = {}
        for g in state["groups"]:
            request = GroupRequest(
                str(g["key"]),
                tuple(g["prompt_ids"]),
                tuple(g["max_new_tokens"]),
                None if g["anchor"] is None else AnchorResult.from_state(g["anchor"]),
                g["reference"],
            )
            done = {int(k): Finished.from_state(f) for k, f in g["done"].items()}
            self._groups[request.key] = _Group(request, done, bool(g["must_finish"]), int(g["started"]))
