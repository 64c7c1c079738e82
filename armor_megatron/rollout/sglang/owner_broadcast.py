"""``distributed`` weight sync from the trainer's sending ranks, each broadcasting straight to the engines.

SGLang 0.5.23 keeps its weights update groups in a dict by name
(``ModelRunner``'s weight updater ``_model_update_group``), joins each with
``/init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
group_name, backend} and receives from rank 0 of the group a request names
(``/update_weights_from_distributed`` {names, dtypes, shapes, group_name, load_format,
flush_cache, weight_version}). So every sending trainer rank gets a group of its own: the
sender is its rank 0 and hosts its rendezvous, engine e's TP ranks are ranks ``1 + e·tp ...``.
Which ranks send (``OwnerGroups.per_stage``, ``rollout.sglang.update_groups``): by default one per
pipeline stage, its lowest owner rank, which also broadcasts the experts of the stage's other
expert-parallel owners (the Megatron export hands them over bucket by bucket), so every engine TP
rank holds pp communicators (as slime does); per owner, every rank that owns tensors (a stage's
TP rank 0, expert owners) sends its own, pp × ep communicators per engine TP rank, nothing handed
over. A sender broadcasts straight from where its tensors are (device memory with NCCL: no copy
through the host); only small descriptions (names, dtypes, shapes) reach the driver.

The driver (trainer rank 0) posts every request, because an engine serves weight requests one
at a time, in arrival order (SGLang's ``FanOutCommunicator`` queues them) and blocks in each
broadcast: requests reach every engine in one order (owner by owner, bucket by bucket; one
poster thread per engine, each waiting for its engine's answer before the next), so all engines
meet each owner's broadcast together and no two owners wait on each other. Each request
carries one dtype's tensors as SGLang's ``flattened_bucket`` (one broadcast of the bytes,
back to back, as its ``FlattenedTensorBucket.empty`` lays them out); the last one carries
``flush_cache`` and the ``weight_version``.

Steps (:class:`~armor_megatron.rollout.engine.ShardDelivery`, coordinated): each owner
announces its group (a new one: the address the engines reach it at and the port its
rendezvous store already listens on, so no other process can take it in between); the driver
posts the engines' joins, owner by owner, while every owner joins; then round by round the
owners describe their buckets, the driver posts the requests while the owners broadcast. A
group outlives the sync (it is reused by the next one, in the owner's process). An engine that
refuses a join or a request leaves the owners waiting for engines that will not come: the
driver tells each of them (an abort key in its rendezvous store, which it watches while it
waits), so they fail at once instead of after the group's timeout; a group whose broadcast was
given up is dropped and made anew by the next sync.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

from armor_megatron.rollout.engine import ShardDelivery, ShardSink, WeightUpdateError
from armor_megatron.rollout.sglang import tensor_payload
from armor_megatron.rollout.sglang.client import SGLangClient
from armor_megatron.rollout.sglang.process_group import WeightUpdateGroup, address_towards, listen

ABORT_KEY = "armor/aborted"  # outside every group's key prefix
# this process's groups: (prefix, owner rank) -> (group, its address, a store client watching for ABORT_KEY)
_GROUPS: dict[tuple[str, int], tuple[WeightUpdateGroup, str | None, Any]] = {}


@dataclasses.dataclass(frozen=True)
class OwnerGroups:
    """What every owner needs to make or find its group (pickled to every rank: no tensors)."""

    prefix: str  # group names are "<prefix>-rank<r>-<token>", unique to one sync object
    engine_address: str  # the address the engines reach the trainer's driver at: owners answer on that route
    world_size: int  # 1 + Σ engines' TP ranks
    backend: str
    timeout: float
    base_port: int = 0  # 0: each owner's rendezvous on a port the OS picks; else base_port + 1 + rank
    per_stage: bool = True  # one group per pipeline stage (its sender's); False: one per owner rank


class OwnerBroadcastDelivery(ShardDelivery):
    """Made on the driver for one sync; ``post(client, path, body)`` sends a request to an engine."""

    coordinated = True

    @property
    def per_stage(self) -> bool:  # type: ignore[override]
        """One group per pipeline stage (``OwnerGroups.per_stage``), on every rank it is pickled to."""
        return self.groups.per_stage

    def __init__(
        self,
        clients: Sequence[SGLangClient],
        groups: OwnerGroups,
        tp_size: int,
        bucket_bytes: int,
        version: str,
        post: Callable[[SGLangClient, str, dict[str, Any]], Any],
    ) -> None:
        self.groups, self.bucket_bytes = groups, bucket_bytes
        # driver only (never pickled):
        self._clients, self._tp, self._version, self._post = list(clients), tp_size, version, post
        self._running: list[concurrent.futures.Future[None]] = []
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stop = threading.Event()
        self.joined: list[str] = []  # group names the engines joined during this sync
        self.requests: list[tuple[str, list[str]]] = []  # (group, names) in the order posted
        self.version_sent = False

    def __getstate__(self) -> dict[str, Any]:
        return {"groups": self.groups, "bucket_bytes": self.bucket_bytes}

    def open(self, rank: int) -> ShardSink:
        """The sink of owner ``rank``."""
        return _OwnerSink(self.groups, rank)

    # ---------------------------------------------------------------- driver
    def _start(self, per_engine: Callable[[SGLangClient, int], None]) -> None:
        """Run ``per_engine(client, i)`` for every engine on threads of their own."""
        self.settle()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(len(self._clients), thread_name_prefix="owner-sync")
        self._stop.clear()
        self._running = [self._pool.submit(per_engine, c, i) for i, c in enumerate(self._clients)]

    def conduct_join(self, announcements: dict[int, Any]) -> None:
        """Ask the engines to join every new owner's group, given the owners' announcements."""
        self._owners = [a for _, a in sorted(announcements.items())]
        new = [a for a in self._owners if a["new"]]
        g = self.groups

        def join_all(client: SGLangClient, i: int) -> None:
            for a in new:
                if self._stop.is_set():
                    return
                body = {
                    "master_address": a["address"],
                    "master_port": a["port"],
                    "rank_offset": 1 + i * self._tp,
                    "world_size": g.world_size,
                    "group_name": a["group"],
                    "backend": g.backend,
                }
                try:
                    self._post(client, "/init_weights_update_group", body)
                except BaseException as e:
                    self._stop.set()
                    _abort(new, f"{client.url}: {e}", g.timeout)
                    raise

        self._start(join_all)
        self.joined += [a["group"] for a in new]

    def conduct_bucket(self, descriptions: dict[int, Any], last: bool) -> None:
        """Ask the engines to receive one round of buckets, as the owners described them."""
        requests = [
            (d["group"], names, dtypes, shapes)
            for _, d in sorted(descriptions.items())
            for names, dtypes, shapes in d["buckets"]
        ]
        self.requests += [(group, names) for group, names, _, _ in requests]
        version = self._version if last else None

        def post_all(client: SGLangClient, i: int) -> None:
            for k, (group, names, dtypes, shapes) in enumerate(requests):
                if self._stop.is_set():
                    return
                final = version is not None and k == len(requests) - 1
                body = {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    "group_name": group,
                    "load_format": tensor_payload.FLATTENED_BUCKET,
                    "flush_cache": final,
                }
                if final:
                    body["weight_version"] = version
                try:
                    self._post(client, "/update_weights_from_distributed", body)
                except BaseException as e:
                    # the owners still to broadcast would wait for engines that will not come
                    self._stop.set()
                    _abort(self._owners, f"{client.url}: {e}", self.groups.timeout)
                    raise
            if version is not None and not requests:  # nothing left to carry the version
                self._post(client, "/update_weight_version", {"new_version": version, "abort_all_requests": False})
                self._post(client, "/flush_cache", {})

        self._start(post_all)
        self.version_sent = self.version_sent or version is not None

    def settle(self) -> None:
        """Wait for every engine's poster.

        The first failure is raised at once (the other posters may be waiting in a broadcast that
        will not come: they are left behind).
        """
        running, self._running = self._running, []
        done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                self._stop.set()
                self.shutdown()
                e = f.exception()
                raise e if isinstance(e, WeightUpdateError) else WeightUpdateError(f"{type(e).__name__}: {e}")

    def shutdown(self) -> None:
        """Stop the request threads without waiting."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _abort(announcements: list[dict[str, Any]], reason: str, timeout: float) -> None:
    """Tell every owner waiting in a join or a broadcast that the engines will not come (best effort).

    A key in the owner's rendezvous store, which it checks while it waits.
    """
    for a in announcements:
        try:
            _store_client(a["address"], a["port"], min(timeout, 30)).set(ABORT_KEY, reason)
        except Exception:  # noqa: BLE001 - that owner then fails at its own timeout
            pass


def _store_client(address: str, port: int, timeout: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(address, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))


class _OwnerSink(ShardSink):
    """One owner's end: its group (made once, kept in this process) and its broadcasts."""

    def __init__(self, groups: OwnerGroups, rank: int):
        self.groups, self.rank = groups, rank
        self.group: WeightUpdateGroup | None = None
        self.address: str | None = None
        self._watch: Any = None
        if (groups.prefix, rank) in _GROUPS:
            self.group, self.address, self._watch = _GROUPS[(groups.prefix, rank)]
        if self.group is not None and self._aborted():  # a failed sync left it: the engines may be stuck in it
            _GROUPS.pop((groups.prefix, rank), None)
            self.group = self._watch = None
        self.tensors = self.bytes = 0

    def announce(self) -> dict[str, Any]:
        g = self.groups
        new = self.group is None
        if self.group is None:
            self._name = f"{g.prefix}-rank{self.rank}-{secrets.token_hex(3)}"
            self._store = listen(g.world_size, g.base_port + 1 + self.rank if g.base_port else 0, g.timeout)
            self.address = address_towards(g.engine_address)
            # a connection of its own: the group's rendezvous blocks the store's in its waits
            self._watch = _store_client("127.0.0.1", self._store.port, g.timeout)
        else:
            self._name = self.group.group_name
        return {"group": self._name, "address": self.address, "port": self._watch.port, "new": new}

    def _joined(self) -> WeightUpdateGroup:
        if self.group is None:
            raise WeightUpdateError("weights update group: used before join()")
        return self.group

    def _aborted(self) -> str | None:
        if self._watch.check([ABORT_KEY]):
            return str(self._watch.get(ABORT_KEY).decode())
        return None

    def join(self) -> None:
        if self.group is not None:
            return
        g = self.groups
        made: dict[str, Any] = {}

        def make() -> None:
            try:
                made["group"] = WeightUpdateGroup(
                    "", 0, 0, g.world_size, self._name, g.backend, g.timeout, store=self._store
                )
            except BaseException as e:  # noqa: BLE001 - raised below
                made["error"] = e

        worker = threading.Thread(target=make, name="owner-weight-group-join", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(0.5)
            reason = self._aborted() if worker.is_alive() else None
            if reason:
                raise WeightUpdateError(f"weights update group {self._name!r}: the engines did not join: {reason}")
        if "error" in made:
            raise WeightUpdateError(f"weights update group {self._name!r}: {made['error']}")
        self.group = made["group"]
        _GROUPS[(g.prefix, self.rank)] = (made["group"], self.address, self._watch)

    def describe(self, *buckets: list[tuple[str, Any]]) -> dict[str, Any]:
        parts = [p for b in buckets for p in tensor_payload.buckets(b, bucket_bytes=1 << 62)]  # a request per dtype
        return {
            "group": self._joined().group_name,
            "buckets": [
                (
                    [n for n, _ in part],
                    [str(t.dtype).replace("torch.", "") for _, t in part],
                    [list(t.shape) for _, t in part],
                )
                for part in parts
            ],
        }

    def put(self, bucket: list[tuple[str, Any]]) -> None:
        import torch

        device = "cuda" if self.groups.backend == "nccl" else "cpu"
        for part in tensor_payload.buckets(bucket, bucket_bytes=1 << 62):
            # FlattenedTensorBucket's layout: each tensor's bytes, back to back, in order
            flat = torch.cat([t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for _, t in part])
            try:
                self._joined().broadcast(flat, src=0, cancelled=self._aborted)
            except BaseException:
                _GROUPS.pop(
                    (self.groups.prefix, self.rank), None
                )  # a peer may be stuck in it: the next sync makes a new one
                raise
            self.tensors += len(part)
            self.bytes += flat.numel()
            del flat

    def close(self) -> dict[str, Any]:
        return {"group": self.group.group_name if self.group else None, "tensors": self.tensors, "bytes": self.bytes}
