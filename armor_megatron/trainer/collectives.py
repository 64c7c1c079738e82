"""The few collectives the trainer runs between Megatron's own: everything here moves host data.

Rank 0 (the driver) owns the engines and the data; these helpers hand its step batch and
metrics to every rank and agree on flags. They work on any default process group that carries
host tensors: gloo on CPU, ``cpu:gloo,cuda:nccl`` on GPUs (`megatron.dist.process_group_backend`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(obj):
    """Rank 0's ``obj`` (any picklable value) on every rank."""
    payload = [obj]
    if _distributed():
        dist.broadcast_object_list(payload, src=0)
    return payload[0]


def broadcast_tensors(tensors: Mapping[str, torch.Tensor] | None, keys: Sequence[str]) -> dict | None:
    """Rank 0's ``{key: host tensor}`` (only ``keys``) on every rank; None when rank 0 has none."""
    return broadcast_object({k: tensors[k] for k in keys} if tensors is not None else None)


def barrier() -> None:
    if _distributed():
        dist.barrier()


def max_over_ranks(value: float) -> float:
    """The largest ``value`` of all ranks, on every rank."""
    if not _distributed():
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any (a host tensor: the group's gloo side)."""
    if not _distributed():
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
