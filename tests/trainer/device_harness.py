"""A CPU stand-in for accelerator placement, to catch host/device mixing without a GPU.

`OnAccelerator` is a host tensor that behaves, for placement, like a CUDA tensor: an operation
mixing it with a host tensor of one or more dimensions raises the error CUDA raises, while
0-dim host tensors (Python-scalar-like) mix freely as they do on CUDA. ``.cpu()`` and
``.to("cpu")`` bring it back to the host; results of operations on it stay "on the
accelerator". ``float()``/``.item()`` work, as they do on CUDA (an implicit sync).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

MIXED_DEVICES = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


def _to_host_call(func, args, kwargs) -> bool:
    if func in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item):
        return True
    if func is torch.Tensor.to:
        targets = [a for a in list(args[1:]) + list(kwargs.values()) if isinstance(a, (str, torch.device))]
        return any(torch.device(t).type == "cpu" for t in targets)
    return False


class OnAccelerator(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        tagged = any(isinstance(t, OnAccelerator) for t in leaves)
        host = any(isinstance(t, torch.Tensor) and not isinstance(t, OnAccelerator) and t.dim() > 0 for t in leaves)
        with torch._C.DisableTorchFunctionSubclass():
            if _to_host_call(func, args, kwargs):
                out = func(*args, **kwargs)
                return tree_map(lambda t: t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else t, out)
            if tagged and host:
                raise RuntimeError(MIXED_DEVICES)
            out = func(*args, **kwargs)
        if not tagged:
            return out
        return tree_map(lambda t: t.as_subclass(OnAccelerator) if isinstance(t, torch.Tensor) else t, out)


def on_accelerator(t: torch.Tensor) -> OnAccelerator:
    return t.detach().clone().as_subclass(OnAccelerator)


def is_host(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, OnAccelerator)


def emulated_backend(backend: str) -> str:
    """A process-group backend string for CPU tests: each device type keeps its backend, with gloo
    standing in for NCCL, and NCCL alone serving CUDA only (as it does): "nccl" -> "cuda:gloo",
    "cpu:gloo,cuda:nccl" -> "cpu:gloo,cuda:gloo". An all-reduce of a host tensor then fails on
    a group that real NCCL would fail it on."""
    if ":" not in backend:
        return "cuda:gloo" if backend == "nccl" else backend
    return ",".join(part.replace("nccl", "gloo") for part in backend.split(","))
