"""Push trainer weights (HF-named tensors) into SGLang engines, tagged with a ``weight_version``.

Modes (``WeightSyncConfig.mode``):

``tensor``
    Buckets of at most ``bucket_bytes`` (one dtype each) flattened and serialized as SGLang's
    ``flattened_bucket`` payload (:mod:`.tensor_payload`), sent with
    ``/update_weights_from_tensor`` inside a ``/begin_weight_update`` ... ``/end_weight_update``
    session (SGLang 0.5.23 refuses tensor updates outside one). Tensors travel as handles
    (CUDA IPC: buckets are moved to the GPU first), so engines must share the driver's node. Each TP rank
    gets its own entry, all pointing at the trainer's copy (peers that place one copy per
    GPU instead gather per-rank copies first).
``distributed``
    ``/init_weights_update_group`` once (trainer = rank 0, engine e's TP ranks follow), then per
    bucket ``/update_weights_from_distributed`` {names, dtypes, shapes} while the trainer
    broadcasts each tensor in that order; also inside a weight-update session. For engines
    on other GPUs or nodes (disaggregated).
``disk``
    Write an HF checkpoint (safetensors + config.json, atomically) to ``disk_dir`` on a file
    system the engines see, then ``/update_weights_from_disk``.

Every mode is a :class:`WeightSync` subclass registered in ``WEIGHT_SYNC_MODES``
(``@register_weight_sync_mode("name")``); ``WeightSyncConfig`` refuses an unregistered name in one
line listing the registered ones, asks the mode's :meth:`WeightSync.check_config` for what it
needs, and :func:`make_weight_sync` builds the registered class. The registry lives with the run
config (``config.schema``), which names the built-in modes by where they live
(``"armor_megatron.rollout.sglang.weight_sync:TensorWeightSync"``), imported on first use; a mode
registered by code imported before the config loads needs no such name.

Only the last request of an update carries ``weight_version``, so an engine reports the new
version only once all weights are in; afterwards every engine's reported version is read
back and must equal the one pushed (:class:`WeightUpdateError` otherwise).

Sharded weights (:class:`~armor_megatron.rollout.engine.ShardedWeights`, a Megatron export
spread over the trainer's ranks) are pushed by :meth:`WeightSync.push_sharded`, which lets
every owner rank deliver its own share (:class:`~armor_megatron.rollout.engine.ShardDelivery`):

``tensor``
    the driver opens the session on every engine; each owner posts its own buckets (handles
    of tensors on its own device: engines must share the owners' node); the driver holds
    back its last bucket and posts it with ``weight_version`` once every rank is done. A
    trainer spread over nodes (`trainer_on_one_node`) is gathered on the driver instead, one
    bucket at a time, as for ``distributed``.
``disk``
    each owner writes its buckets as its own safetensors files (tmp + rename) into a staging
    directory beside ``disk_dir``; once every rank is done the driver writes
    ``model.safetensors.index.json`` and ``config.json``, renames the directory into place and
    calls ``/update_weights_from_disk``. The file system must be shared by owners and engines.
``distributed``
    every owner rank is rank 0 of a weights update group of its own with the engines and
    broadcasts its own buckets from where they are (device memory with NCCL); the driver posts
    the requests (names, dtypes, shapes, the owner's group) in one order to every engine
    (:mod:`.owner_broadcast`). Nothing goes through the driver but the small descriptions.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from armor_megatron.config.schema import WEIGHT_SYNC_MODES
from armor_megatron.rollout.engine import ShardDelivery, ShardedWeights, ShardSink, WeightUpdateError
from armor_megatron.rollout.hf_checkpoint import SAFETENSORS_INDEX, _replace_dir, write_hf_checkpoint
from armor_megatron.rollout.sglang import tensor_payload
from armor_megatron.rollout.sglang.client import SGLangClient, SGLangHTTPError

logger = logging.getLogger(__name__)
_R = TypeVar("_R")

register_weight_sync_mode = WEIGHT_SYNC_MODES.register


@dataclasses.dataclass
class WeightSyncConfig:
    """How weights reach the engines: mode, bucket size, TP size, and each mode's settings."""

    mode: str = "tensor"
    bucket_bytes: int = 512 << 20
    tp_size: int = 1  # TP ranks per engine: one payload entry / group rank each
    flatten: bool = True  # tensor mode: flattened_bucket payloads (else plain (name, tensor) lists)
    disk_dir: str | None = None  # disk mode: where checkpoints are written
    hf_config: Mapping[str, Any] | None = None  # disk mode: the config.json written beside the weights
    master_address: str = "127.0.0.1"  # distributed mode: the trainer's address seen from the engines
    # distributed mode: the driver's rendezvous port, owner rank r's is master_port + 1 + r; 0: ports the OS picks
    master_port: int = 0
    backend: str = "nccl"  # distributed mode: nccl on GPUs, gloo on CPU
    # distributed mode, a trainer's export: "stage", one group per pipeline stage (experts handed to the
    # stage's sender); "owner", one per rank that owns tensors (see owner_broadcast)
    update_groups: str = "stage"
    # tensor mode: where buckets go before their handles are sent. Default: CUDA when available
    # (SGLang opens CUDA IPC handles); CPU handles open only in the sender's own process tree.
    device: str | None = None
    group_name: str = "armor_weight_sync"
    timeout: float = 600.0

    def __post_init__(self) -> None:
        mode = cast("type[WeightSync]", WEIGHT_SYNC_MODES.definition(self.mode))  # a registered WeightSync class
        mode.check_config(self)


def _on_all(clients: Sequence[SGLangClient], fn: Callable[[SGLangClient], _R]) -> list[_R]:
    """Run ``fn(client)`` on every engine concurrently; the first failure is raised."""
    if len(clients) <= 1:
        return [fn(c) for c in clients]
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        return [f.result() for f in [pool.submit(fn, c) for c in clients]]


def _check_success(client: SGLangClient, path: str, result: Any) -> None:
    if isinstance(result, dict) and result.get("success") is False:
        raise WeightUpdateError(f"{client.url}{path} failed: {result.get('message', result)}")


def _post(client: SGLangClient, path: str, body: dict[str, Any], timeout: float) -> Any:
    """A weight-update request: failures (HTTP 400 + success false in 0.5.x) become WeightUpdateError."""
    try:
        result = client.post(path, body, timeout=timeout, retry=False)
    except SGLangHTTPError as e:
        raise WeightUpdateError(f"{client.url}{path} failed: HTTP {e.status}: {e.message}") from None
    _check_success(client, path, result)
    return result


class WeightSync(abc.ABC):
    """Base: sessions and version checks shared by the modes."""

    @classmethod
    def check_config(cls, config: WeightSyncConfig) -> None:
        """Raise ValueError (one line) when ``config`` lacks what this mode needs."""

    def __init__(self, clients: Sequence[SGLangClient], config: WeightSyncConfig):
        if not clients:
            raise ValueError("weight sync needs at least one engine")
        self.clients = list(clients)
        self.config = config
        # Engines whose weight-update session may be open: at start-up we cannot know (a trainer
        # that died mid-push leaves one open), later those whose begin or end went unanswered.
        self._maybe_open: set[int] = set(range(len(self.clients)))

    @abc.abstractmethod
    def push(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> None:
        """Send HF-named tensors to every engine and tag them ``version``."""

    def push_sharded(self, weights: ShardedWeights, version: str) -> None:
        """Push weights spread over the trainer's ranks (called on the driver; every rank takes part).

        By default they are gathered on the driver, one bucket at a time, and pushed.
        """
        self.push(iter(weights), version)

    def load_from_disk(self, path: str, version: str) -> None:
        """``/update_weights_from_disk`` of an existing HF checkpoint on every engine."""
        body = {
            "model_path": os.path.abspath(path),
            "load_format": "auto",
            "weight_version": version,
            "flush_cache": True,
        }
        self._on_all(lambda c: _post(c, "/update_weights_from_disk", body, self.config.timeout))
        self.verify(version)

    def verify(self, version: str) -> None:
        """Raise WeightUpdateError unless every engine reports ``version``."""
        for c in self.clients:
            reported = c.weight_version(timeout=self.config.timeout)
            if reported != version:
                raise WeightUpdateError(f"{c.url} reports weight_version {reported!r} after pushing {version!r}")

    def _on_all(self, fn: Callable[[SGLangClient], _R]) -> list[_R]:
        return _on_all(self.clients, fn)

    def _session(self) -> _UpdateSession:
        return _UpdateSession(self)

    def clear_stale_sessions(self) -> None:
        """``/end_weight_update`` on every engine whose session may be open.

        SGLang 0.5.23 refuses ``/begin_weight_update`` while a session is open, so one left
        open would refuse every later push. An answer of 4xx means there was none to close.
        """
        for i in sorted(self._maybe_open):
            client = self.clients[i]
            try:
                _post(client, "/end_weight_update", {}, self.config.timeout)
            except WeightUpdateError:
                pass  # no session open (400), or a server without sessions (404)
            self._maybe_open.discard(i)

    def close(self) -> None:
        """Release what the sync holds (nothing by default)."""
        pass


class _UpdateSession:
    """``/begin_weight_update`` on every engine; ``/end_weight_update`` on exit, also after a failure.

    Every failure path closes what was opened: a begin that fails anywhere (an HTTP error, an
    unreachable engine, an interrupt) ends the sessions already open; an engine whose begin or
    end went unanswered is remembered and closed before the next session
    (:meth:`WeightSync.clear_stale_sessions`). Servers older than 0.5.23 have no session
    endpoints (404): then updates go without one.
    """

    def __init__(self, sync: WeightSync):
        self.sync = sync
        self.opened: list[int] = []

    def __enter__(self) -> _UpdateSession:
        timeout = self.sync.config.timeout
        try:
            self.sync.clear_stale_sessions()
            for i, c in enumerate(self.sync.clients):
                try:
                    _post(c, "/begin_weight_update", {}, timeout)
                except WeightUpdateError as e:
                    if "HTTP 404" in str(e):
                        continue
                    raise
                except BaseException:
                    self.sync._maybe_open.add(i)  # unanswered: it may have opened
                    raise
                self.opened.append(i)
        except BaseException:
            self._close()
            raise
        return self

    def _close(self) -> list[Exception]:
        errors = []
        for i in self.opened:
            try:
                _post(self.sync.clients[i], "/end_weight_update", {}, self.sync.config.timeout)
            except Exception as e:  # noqa: BLE001 - close every session, report the first failure
                self.sync._maybe_open.add(i)
                errors.append(e)
        self.opened = []
        return errors

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        errors = self._close()
        if errors and exc_type is None:
            raise errors[0]
        for e in errors:
            logger.warning("closing a weight-update session failed (retried before the next push): %s", e)


def _default_handle_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _mark_last(iterable: Iterable[_R]) -> Iterator[tuple[_R, bool]]:
    """Yield ``(item, is_last)``."""
    it = iter(iterable)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def _post_tensor_bucket(
    clients: Sequence[SGLangClient], cfg: WeightSyncConfig, bucket: list[tuple[str, Any]], version: str | None
) -> None:
    """Send one bucket to every engine with ``/update_weights_from_tensor``.

    One ``/update_weights_from_tensor`` of ``bucket`` to every engine; ``version`` marks the
    update's last request (it also flushes the cache).
    """
    load_format = tensor_payload.FLATTENED_BUCKET if cfg.flatten else None
    device = cfg.device or _default_handle_device()
    packed = tensor_payload.pack([(name, t.to(device)) for name, t in bucket], load_format)

    def send(client: SGLangClient) -> Any:
        body = {
            # Handles are consumed by their receiver: one fresh entry per TP rank.
            "serialized_named_tensors": [tensor_payload.dumps(packed) for _ in range(cfg.tp_size)],
            "load_format": load_format,
            "flush_cache": version is not None,
        }
        if version is not None:
            body["weight_version"] = version
        return _post(client, "/update_weights_from_tensor", body, cfg.timeout)

    _on_all(clients, send)  # the tensors stay alive until every engine has answered


@register_weight_sync_mode("tensor")
class TensorWeightSync(WeightSync):
    """Pushes buckets as CUDA IPC handles (``update_weights_from_tensor``); engines on the trainer's node."""

    def push(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> None:
        """Push ``named_tensors`` bucket by bucket, then set ``version``."""
        cfg = self.config
        sent = 0
        with self._session():
            for bucket, last in _mark_last(tensor_payload.buckets(named_tensors, cfg.bucket_bytes)):
                _post_tensor_bucket(self.clients, cfg, bucket, version if last else None)
                sent += len(bucket)
        if not sent:
            raise WeightUpdateError("no weights to push")
        self.verify(version)

    def push_sharded(self, weights: ShardedWeights, version: str) -> None:
        """Push every owner's tensors (each owner sends its own), then set ``version``."""
        if not trainer_on_one_node():  # owners on other nodes cannot hand the engines CUDA IPC handles
            self.push(iter(weights), version)
            return
        delivery = TensorDelivery([c.url for c in self.clients], self.clients[0].api_key, self.config)
        with self._session():
            weights.deliver(delivery)
            delivery.finish(self.clients, version)
        self.verify(version)


def trainer_on_one_node(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every trainer rank shares the driver's node.

    Read from the launcher's environment: torchrun's ``LOCAL_WORLD_SIZE == WORLD_SIZE``,
    SLURM's node count of one; without a launcher, one process.
    """
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env:
        return env.get("LOCAL_WORLD_SIZE") == env["WORLD_SIZE"] or env["WORLD_SIZE"] == "1"
    if "SLURM_NTASKS" in env:
        return env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES")) == "1"
    return True


class TensorDelivery(ShardDelivery):
    """``tensor`` mode, sharded: each owner rank posts its own buckets to every engine."""

    def __init__(self, urls: Sequence[str], api_key: str | None, config: WeightSyncConfig):
        self.urls, self.api_key, self.config = list(urls), api_key, config
        self.bucket_bytes = config.bucket_bytes
        self.driver_host = socket.gethostname()
        self._driver_sink: _TensorSink | None = None  # never pickled: set on the driver by open()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_driver_sink": None}

    def open(self, rank: int) -> ShardSink:
        """The sink of owner ``rank``; an owner on another node raises."""
        if socket.gethostname() != self.driver_host:
            raise WeightUpdateError(
                f"tensor weight sync: rank {rank} runs on {socket.gethostname()}, but CUDA IPC handles open only on "
                f"the engines' node {self.driver_host}: use weight_sync disk or distributed"
            )
        clients = [SGLangClient(u, api_key=self.api_key, request_timeout=self.config.timeout) for u in self.urls]
        sink = _TensorSink(clients, self.config, hold_last=rank == 0)
        if rank == 0:
            self._driver_sink = sink
        return sink

    def finish(self, clients: Sequence[SGLangClient], version: str) -> None:
        """Driver, after every rank is done: the held-back bucket goes last, with ``version``."""
        sink = self._driver_sink
        if sink is None or sink.pending is None:
            raise WeightUpdateError("no weights to push (the driver's rank delivered none)")
        _post_tensor_bucket(clients, self.config, sink.pending, version)
        sink.pending = None


class _TensorSink(ShardSink):
    def __init__(self, clients: Sequence[SGLangClient], config: WeightSyncConfig, hold_last: bool) -> None:
        self.clients, self.config, self.hold_last = clients, config, hold_last
        self.pending: list[tuple[str, Any]] | None = None
        self.sent = 0

    def put(self, bucket: list[tuple[str, Any]]) -> None:
        for part in tensor_payload.buckets(bucket, self.config.bucket_bytes):
            if self.pending is not None:
                _post_tensor_bucket(self.clients, self.config, self.pending, None)
                self.sent += len(self.pending)
            self.pending = part
            if not self.hold_last:
                _post_tensor_bucket(self.clients, self.config, part, None)
                self.sent += len(part)
                self.pending = None

    def close(self) -> dict[str, Any]:
        return {"tensors": self.sent + len(self.pending or ())}


@register_weight_sync_mode("disk")
class DiskWeightSync(WeightSync):
    """Writes an HF checkpoint on a shared file system and has the engines load it."""

    @classmethod
    def check_config(cls, config: WeightSyncConfig) -> None:
        """Raise ValueError unless ``config`` names a disk directory and an HF config."""
        if not config.disk_dir:
            raise ValueError("weight sync mode 'disk' needs disk_dir")
        if config.hf_config is None:
            raise ValueError("weight sync mode 'disk' needs hf_config (written as config.json)")

    def push(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> None:
        """Write ``named_tensors`` as an HF checkpoint and load it into the engines at ``version``."""
        cfg = self.config
        assert cfg.disk_dir is not None and cfg.hf_config is not None  # check_config
        path = write_hf_checkpoint(cfg.disk_dir, named_tensors, cfg.hf_config)
        self.load_from_disk(path, version)

    def push_sharded(self, weights: ShardedWeights, version: str) -> None:
        """Every owner writes its own shards; the assembled checkpoint is loaded at ``version``."""
        cfg = self.config
        assert cfg.disk_dir is not None and cfg.hf_config is not None  # check_config
        directory = os.path.abspath(cfg.disk_dir)
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp-", dir=os.path.dirname(directory))
        try:
            reports = weights.deliver(DiskDelivery(staging, cfg.bucket_bytes))
            weight_map: dict[str, str] = {}
            total = 0
            for report in filter(None, reports):
                total += report["bytes"]
                for fname, names in report["files"].items():
                    for name in names:
                        if name in weight_map:
                            raise WeightUpdateError(f"weight {name!r} written twice ({weight_map[name]}, {fname})")
                        weight_map[name] = fname
            if not weight_map:
                raise WeightUpdateError("no weights to push")
            with open(os.path.join(staging, SAFETENSORS_INDEX), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
            with open(os.path.join(staging, "config.json"), "w") as f:
                json.dump(dict(cfg.hf_config), f, indent=1, sort_keys=True)
            _replace_dir(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.load_from_disk(directory, version)


class DiskDelivery(ShardDelivery):
    """``disk`` mode, sharded: each owner rank writes its own safetensors files into ``directory``."""

    def __init__(self, directory: str, bucket_bytes: int):
        self.directory, self.bucket_bytes = directory, bucket_bytes

    def open(self, rank: int) -> ShardSink:
        """The sink of owner ``rank``: its shard files in the staging directory."""
        return _DiskSink(self.directory, rank)


class _DiskSink(ShardSink):
    """One file per bucket, ``model-rank<r>-<i>.safetensors``, written as ``.tmp`` and renamed."""

    def __init__(self, directory: str, rank: int):
        self.directory, self.rank = directory, rank
        self.files: dict[str, list[str]] = {}
        self.bytes = 0

    def put(self, bucket: list[tuple[str, Any]]) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for name, t in bucket:
            if name in tensors:
                raise ValueError(f"weight {name!r} given twice")
            tensors[name] = t.detach().to("cpu").contiguous()
            self.bytes += t.numel() * t.element_size()
        fname = f"model-rank{self.rank:05d}-{len(self.files):05d}.safetensors"
        path = os.path.join(self.directory, fname)
        save_file(tensors, path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
        self.files[fname] = list(tensors)

    def close(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes}


UPDATE_GROUP_LAYOUTS = ("stage", "owner")


@register_weight_sync_mode("distributed")
class DistributedWeightSync(WeightSync):
    """Broadcast over groups of 1 + Σ tp_size ranks, the broadcaster being rank 0.

    :meth:`push` (tensors on this process): one group, this process its rank 0.
    :meth:`push_sharded` (a trainer's export): one group per pipeline stage, or per owner rank
    (``update_groups``; :mod:`.owner_broadcast`).
    """

    @classmethod
    def check_config(cls, config: WeightSyncConfig) -> None:
        """Raise ValueError unless ``update_groups`` is ``stage`` or ``owner``."""
        if config.update_groups not in UPDATE_GROUP_LAYOUTS:
            raise ValueError(
                f"weight sync mode 'distributed': update_groups {config.update_groups!r} is not one of "
                f"{', '.join(UPDATE_GROUP_LAYOUTS)}"
            )

    def __init__(self, clients: Sequence[SGLangClient], config: WeightSyncConfig) -> None:
        super().__init__(clients, config)
        self.group = None
        import secrets

        from armor_megatron.rollout.sglang.owner_broadcast import OwnerGroups

        self.owner_groups = OwnerGroups(
            prefix=f"{config.group_name}-{secrets.token_hex(3)}",  # a restarted trainer never meets its old groups
            engine_address=config.master_address,
            world_size=1 + config.tp_size * len(self.clients),
            backend=config.backend,
            timeout=config.timeout,
            base_port=config.master_port,
            per_stage=config.update_groups == "stage",
        )
        self._owner_group_names: list[str] = []  # every owner group the engines joined

    def _init_group(self) -> None:
        from armor_megatron.rollout.sglang.process_group import WeightUpdateGroup, listen

        cfg = self.config
        world = 1 + cfg.tp_size * len(self.clients)
        store = listen(world, cfg.master_port, cfg.timeout)  # bound before any engine is told the port
        bodies = [
            {
                "master_address": cfg.master_address,
                "master_port": store.port,
                "rank_offset": 1 + i * cfg.tp_size,
                "world_size": world,
                "group_name": cfg.group_name,
                "backend": cfg.backend,
            }
            for i in range(len(self.clients))
        ]
        # The engines join while the trainer joins. The trainer's rendezvous blocks until every
        # engine has joined (or its timeout passes), so it runs on a thread of its own while we
        # watch the engines' answers: an engine that fails to join answers with its error at
        # once, and that error is raised then, not after the rendezvous timeout.
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = WeightUpdateGroup(
                    cfg.master_address, store.port, 0, world, cfg.group_name, cfg.backend, cfg.timeout, store=store
                )
            except BaseException as e:  # noqa: BLE001 - reported below
                joined["error"] = e

        rendezvous = threading.Thread(target=join, name="weight-sync-rendezvous", daemon=True)
        rendezvous.start()
        pool = concurrent.futures.ThreadPoolExecutor(len(self.clients))
        try:
            futures = [
                pool.submit(_post, c, "/init_weights_update_group", b, cfg.timeout)
                for c, b in zip(self.clients, bodies)
            ]
            for f in concurrent.futures.as_completed(futures):
                f.result()  # the first engine that failed to join raises its server's message here
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        rendezvous.join(cfg.timeout)
        if "group" not in joined:
            error = joined.get("error", f"no rendezvous within {cfg.timeout}s")
            raise WeightUpdateError(f"weight update group {cfg.group_name!r}: trainer failed to join: {error}")
        self.group = joined["group"]

    def push(self, named_tensors: Iterable[tuple[str, Any]], version: str) -> None:
        """Broadcast ``named_tensors`` to the engines over the weights update group, then set ``version``."""
        cfg = self.config
        if self.group is None:
            self._init_group()
        device = "cuda" if cfg.backend == "nccl" else "cpu"
        with self._session():
            for bucket, last in _mark_last(tensor_payload.buckets(named_tensors, cfg.bucket_bytes)):
                body = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": cfg.group_name,
                    "flush_cache": last,
                }
                if last:
                    body["weight_version"] = version
                with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
                    futures = [
                        pool.submit(_post, c, "/update_weights_from_distributed", body, cfg.timeout)
                        for c in self.clients
                    ]
                    assert self.group is not None  # joined above
                    for _, t in bucket:
                        self.group.broadcast(t.detach().to(device).contiguous(), src=0)
                    for f in futures:
                        f.result()
        self.verify(version)

    def push_sharded(self, weights: ShardedWeights, version: str) -> None:
        """Every sending rank (a stage's, or every owner) broadcasts its buckets over its own group.

        This (driver) rank posts the engines' requests in one order (see :mod:`.owner_broadcast`).
        """
        from armor_megatron.rollout.sglang.owner_broadcast import OwnerBroadcastDelivery

        cfg = self.config
        delivery = OwnerBroadcastDelivery(
            self.clients,
            self.owner_groups,
            cfg.tp_size,
            cfg.bucket_bytes,
            version,
            lambda client, path, body: _post(client, path, body, cfg.timeout),
        )
        try:
            with self._session():
                weights.deliver(delivery)
        finally:
            self._owner_group_names += delivery.joined
            delivery.shutdown()
        if not delivery.version_sent:
            raise WeightUpdateError("no weights to push")
        self.last_delivery = delivery  # what went where, for tests and benchmarks
        self.verify(version)

    def close(self) -> None:
        """Ask the engines to leave every group made, and destroy this side's."""
        names = self._owner_group_names + ([self.config.group_name] if self.group is not None else [])
        for name in names:
            for c in self.clients:
                try:
                    c.post("/destroy_weights_update_group", {"group_name": name}, timeout=30, retry=False)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
        self._owner_group_names = []
        if self.group is not None:
            self.group.destroy()
            self.group = None


def make_weight_sync(clients: Sequence[SGLangClient], config: WeightSyncConfig) -> WeightSync:
    """The registered mode ``config.mode`` over ``clients``."""
    sync: WeightSync = WEIGHT_SYNC_MODES.call(config.mode, clients, config)
    return sync
