"""Give a colocated rollout engine the trainer's device memory, and take it back bit for bit.

While SGLang engines share the trainer's GPUs (``placement: colocated``) they need the memory
the trainer holds between updates: bf16 weights and fp32 master weights, gradient buffers,
Adam moments of the actor (and critic), and the reference model's weights. `HostOffload`
copies each distinct storage behind those tensors to host memory and frees it on the device
(``storage.resize_(0)``); `reload` re-allocates it and copies the bytes back. Tensors keep
their identity, shape, strides and views (megatron's DDP params and ``main_grad`` are views
into contiguous buffers; they stay views), so nothing that holds a reference has to change,
and values come back identical. On CUDA the host copies are pinned and the caching
allocator's free blocks are returned to the driver (``empty_cache``), which is what lets
the engine's ``resume_memory_occupation`` find them.

Usage (every rank, no collectives)::

    memory = HostOffload.of(actor, reference, critic)     # any of them may be None
    memory.offload()      # before rollout / evaluation
    memory.reload()       # before log-probs and the update
    with memory.released(): ...
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch


def model_tensors(model) -> Iterator[torch.Tensor]:
    """Every tensor a trained or frozen model keeps between steps: parameters and buffers of its
    chunks, megatron DDP's parameter and gradient buffers (``main_grad`` lives there), and the
    optimizer's state and master parameters (chained optimizers included)."""
    for chunk in getattr(model, "model_chunks", []):
        yield from (t for t in chunk.state_dict(keep_vars=True).values() if torch.is_tensor(t))
        for p in chunk.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is not None:
                yield grad
    for ddp in getattr(model, "ddp_chunks", []):
        for buffer in [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]:
            for name in ("param_data", "grad_data"):
                if getattr(buffer, name, None) is not None:
                    yield getattr(buffer, name)
    yield from _optimizer_tensors(getattr(model, "optimizer", None))


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", inner)
        for group in getattr(torch_optimizer, "param_groups", []):
            yield from (p for p in group["params"] if torch.is_tensor(p))
        for state in getattr(torch_optimizer, "state", {}).values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


class HostOffload:
    """The distinct storages behind some tensors, movable to host memory and back (module
    docstring). ``tensors``: an iterable, or a callable returning one, read at each `offload`
    (an optimizer creates its state at the first step)."""

    def __init__(self, tensors: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]):
        self._tensors = tensors if callable(tensors) else (lambda kept=list(tensors): kept)
        self._storages: list[torch.UntypedStorage] = []
        self._host: list[torch.Tensor] | None = None

    @classmethod
    def of(cls, *models) -> HostOffload:
        return cls(lambda: (t for model in models if model is not None for t in model_tensors(model)))

    def _collect(self) -> list[torch.UntypedStorage]:
        storages: dict[int, torch.UntypedStorage] = {}
        for t in self._tensors():
            if torch.is_tensor(t) and not t.is_meta:
                storage = t.untyped_storage()
                if storage.nbytes() > 0:
                    storages.setdefault(storage.data_ptr(), storage)
        return list(storages.values())

    @property
    def nbytes(self) -> int:
        """Bytes one offload moves (now, or while offloaded)."""
        if self._host is not None:
            return sum(len(h) for h in self._host)
        return sum(s.nbytes() for s in self._collect())

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def offload(self) -> None:
        if self.offloaded:
            return
        self._storages = self._collect()
        host = []
        for storage in self._storages:
            device_bytes = _as_bytes(storage)
            copy = torch.empty(device_bytes.numel(), dtype=torch.uint8, pin_memory=device_bytes.is_cuda)
            copy.copy_(device_bytes)
            host.append(copy)
        if self._storages and self._storages[0].device.type == "cuda":
            torch.cuda.synchronize()
        for storage in self._storages:
            storage.resize_(0)
        self._host = host
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if not self.offloaded:
            return
        for storage, copy in zip(self._storages, self._host):
            storage.resize_(copy.numel())
            _as_bytes(storage).copy_(copy, non_blocking=copy.is_pinned())
        if self._storages and self._storages[0].device.type == "cuda":
            torch.cuda.synchronize()
        self._host = None

    @contextlib.contextmanager
    def released(self, enabled: bool = True):
        """Offloaded inside the block (when `enabled`), reloaded after it, also on an error."""
        if not enabled:
            yield
            return
        self.offload()
        try:
            yield
        finally:
            self.reload()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
