"""The few collectives the trainer runs between Megatron's own.

Everything here moves host data, and the step's collective contract: which calls every rank makes,
in the same order.

Rank 0 (the driver) owns the engines and the data; these helpers hand its step batch and
metrics to every rank and agree on flags. They work on any default process group that carries
host tensors: gloo on CPU, ``cpu:gloo,cuda:nccl`` on GPUs (`megatron.dist.process_group_backend`).

``@collective`` marks a function or method that every rank must call, in the same order on every
rank (it runs collectives of the default group itself or inside): the helpers below and the
trainer's phases (`trainer.loop`'s phase table). A rank that skips one, or calls them in another
order, waits forever in the next collective (until ``train.collective_timeout_minutes``).
``recording()`` lists this rank's marked calls and ``torch.distributed`` operations while it runs,
which is how the contract is checked (every rank's list must be the same); outside it the marks
cost one global lookup per call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast, overload

import torch
import torch.distributed as dist

from armor_megatron.data.batch import RolloutBatch

# the torch.distributed functions `recording` lists; the point-to-point ones separately (their
# sequence differs by rank: one side sends what the other receives). ``isend`` and ``irecv`` stay
# unwrapped (``P2POp`` accepts only them): listed inside ``batch_isend_irecv``, not on their own.
COLLECTIVE_OPS = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "monitored_barrier",
    "new_group",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "_all_gather_base",
    "_reduce_scatter_base",
)
POINT_TO_POINT_OPS = ("send", "recv", "batch_isend_irecv")

_log: list[tuple[Any, ...]] | None = None  # this rank's events while `recording` runs
_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


@overload
def collective(fn: _F, *, name: str | None = None) -> _F: ...
@overload
def collective(fn: None = None, *, name: str | None = None) -> Callable[[_F], _F]: ...
def collective(fn: _F | None = None, *, name: str | None = None) -> _F | Callable[[_F], _F]:
    """Mark ``fn`` as part of the collective contract: every rank calls it, in the same order.

    ``@collective`` on a definition, or ``collective(fn, name="checkpoint")`` on a callable made
    elsewhere. Inside `recording` each call is listed as ``("call", name)`` (``name`` defaults to
    the qualified name) before it runs; the wrapper's ``collective`` attribute holds the name.
    """

    def mark(f: _F) -> _F:
        label = name or f.__qualname__

        @functools.wraps(f)
        def marked(*args: Any, **kwargs: Any) -> Any:
            if _log is not None:
                _log.append(("call", label))
            return f(*args, **kwargs)

        setattr(marked, "collective", label)  # noqa: B010 (a function attribute: no declared field to assign)
        return cast(_F, marked)

    return mark if fn is None else mark(fn)


def _group_key(group: Any) -> str | tuple[Any, ...]:
    """``"world"`` for the default group, else (the group's name, its global ranks).

    The same key on every member, since groups are made by every rank in the same order.
    """
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    return (group.group_name, tuple(dist.get_process_group_ranks(group)))


def _describe(op: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    bound = signature.bind_partial(*args, **kwargs).arguments
    if op == "batch_isend_irecv":
        ops = bound.get("p2p_op_list") or []
        return ("p2p", op, tuple((p.op.__name__, p.peer, _group_key(p.group)) for p in ops))
    if op == "new_group":
        ranks = bound.get("ranks")
        return ("op", op, "world", None if ranks is None else tuple(ranks))
    group = _group_key(bound.get("group"))
    if op in POINT_TO_POINT_OPS:
        return ("p2p", op, group, bound.get("dst", bound.get("src")))
    return ("op", op, group)


@contextmanager
def recording() -> Iterator[list[tuple[Any, ...]]]:
    """Yield the list of this rank's collective events while the block runs, in call order.

    ``("call", name)`` for a `collective`-marked call, ``("op", function, group)`` for a
    torch.distributed collective (``group``: see `_group_key`; ``new_group`` adds its ranks) and
    ``("p2p", function, group, peer)`` for a point-to-point one (``batch_isend_irecv``: its ops). An
    operation made inside another (``broadcast_object_list``'s broadcasts) is not listed again.

    The torch.distributed functions are wrapped while it runs, so code that bound one to another
    name at import (``f = torch.distributed.all_gather_into_tensor``) is not seen. One at a time.
    """
    global _log
    if _log is not None:
        raise RuntimeError("collectives are already being recorded in this process")
    events: list[tuple[Any, ...]] = []
    depth = [0]
    originals = {op: getattr(dist, op) for op in COLLECTIVE_OPS + POINT_TO_POINT_OPS}

    def wrap(op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                events.append(_describe(op, signature, args, kwargs))
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return recorded

    _log = events
    try:
        for op, original in originals.items():
            setattr(dist, op, wrap(op, original))
        yield events
    finally:
        for op, original in originals.items():
            setattr(dist, op, original)
        _log = None


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


@collective
def broadcast_object(obj: _T) -> _T:
    """Rank 0's ``obj`` (any picklable value) on every rank."""
    payload: list[Any] = [obj]
    if _distributed():
        dist.broadcast_object_list(payload, src=0)
    received: _T = payload[0]
    return received


@collective
def broadcast_tensors(
    tensors: RolloutBatch | Mapping[str, torch.Tensor] | str | None, keys: Sequence[str]
) -> dict[str, torch.Tensor] | str | None:
    """Rank 0's ``{key: host tensor}`` (only ``keys``) on every rank.

    None when rank 0 has none; a string (a marker such as the driver's ``STOPPED``, `trainer.driver_rollout`) as it is.
    """
    sent: dict[str, torch.Tensor] | str | None = (
        tensors if tensors is None or isinstance(tensors, str) else {k: tensors[k] for k in keys}
    )
    return broadcast_object(sent)


@collective
def barrier() -> None:
    """A barrier over the default group (no-op in a single process)."""
    if _distributed():
        dist.barrier()


@collective
def max_over_ranks(value: float) -> float:
    """The largest ``value`` of all ranks, on every rank."""
    if not _distributed():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


@collective
def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any (a host tensor: the group's gloo side)."""
    if not _distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
