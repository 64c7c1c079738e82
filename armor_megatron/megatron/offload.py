"""Give a colocated rollout engine the trainer's device memory, and take it back bit for bit.

While SGLang engines share the trainer's GPUs (``placement: colocated``) they need the memory
the trainer holds between updates: bf16 weights and fp32 master weights, gradient buffers,
Adam moments of the actor (and critic), and the reference model's weights. `HostOffload`
copies each distinct storage behind those tensors to host memory and frees it on the device
(``storage.resize_(0)``); `reload` re-allocates it and copies the bytes back. Tensors keep
their identity, shape, strides and views (megatron's DDP params and ``main_grad`` are views
into contiguous buffers; they stay views), so nothing that holds a reference has to change,
and values come back identical.

What does not travel:

* scratch storages (``scratch``: megatron DDP's gradient buffers, zeroed at the start of every
  update) are freed and come back zeroed, without a host copy;
* storages that are not on the device the models compute on (a reference kept in host
  memory, ``reference.offload``) stay where they are.

On CUDA the host copies are plain host tensors of exactly the storage's size, page-locked with
``cudaHostRegister`` (``torch.empty(..., pin_memory=True)`` would go through PyTorch's caching
host allocator, which rounds every block up to a power of two: up to twice the trainer's state
in host memory), kept from one offload to the next while the storages keep their sizes, and
the caching allocator's free blocks are returned to the driver (``empty_cache``), which is what
lets the engine's ``resume_memory_occupation`` find them.

Usage (every rank, no collectives)::

    memory = HostOffload.of(actor, reference, critic)     # any of them may be None
    memory.offload()      # before rollout / evaluation
    memory.reload()       # before log-probs and the update
    with memory.released(): ...
    with memory.host_views(actor): export(actor)          # offloaded: the actor reads its host copy

``ledger`` (optional, `armor_megatron.launch.device_ledger.DeviceLedger`) is told each move.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def model_tensors(model: Any) -> Iterator[torch.Tensor]:
    """Every tensor a trained or frozen model keeps between steps.

    Parameters and buffers of its chunks, megatron DDP's parameter and gradient buffers
    (``main_grad`` lives there), and the optimizer's state and master parameters (chained optimizers
    included).
    """
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


def model_scratch_tensors(model: Any) -> Iterator[torch.Tensor]:
    """Megatron DDP's gradient buffers (``main_grad`` views into them).

    Zeroed at the start of every update (`TrainedModel._forward_backward`), so their contents need
    not survive.
    """
    for ddp in getattr(model, "ddp_chunks", []):
        for buffer in [*getattr(ddp, "buffers", []), *getattr(ddp, "expert_parallel_buffers", [])]:
            if getattr(buffer, "grad_data", None) is not None:
                yield buffer.grad_data


def compute_device(*models: Any) -> torch.device | None:
    """The device the first model with parameters computes on."""
    for model in models:
        for chunk in getattr(model, "model_chunks", []) if model is not None else []:
            for p in chunk.parameters():
                device: torch.device = p.device
                return device
    return None


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    if optimizer is None:
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        torch_optimizer = getattr(inner, "optimizer", inner)
        for group in getattr(torch_optimizer, "param_groups", []):
            yield from (p for p in group["params"] if torch.is_tensor(p))
        for state in getattr(torch_optimizer, "state", {}).values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)


class HostOffload:
    """The distinct storages behind some tensors, movable to host memory and back (module docstring).

    ``tensors`` and ``scratch``: iterables, or callables returning one, read at each `offload` (an
    optimizer creates its state at the first step). ``device``: only storages on it move (None:
    all).
    """

    def __init__(
        self,
        tensors: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
        scratch: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]] = (),
        device: torch.device | None = None,
    ) -> None:
        self._tensors = _reader(tensors)
        self._scratch = _reader(scratch)
        self.device = device
        self._storages: list[torch.UntypedStorage] = []
        self._freed: list[tuple[torch.UntypedStorage, int]] = []  # scratch storages and their sizes
        self._host: list[torch.Tensor] = []  # host copies, kept for the next offload
        self._offloaded = False
        self._by_pointer: dict[int, torch.Tensor] = {}  # storage (its C handle) -> host copy, while offloaded
        self.ledger = None

    @classmethod
    def of(cls, *models: Any) -> HostOffload:
        """An offload of the given models' tensors (None entries skipped), on their compute device."""
        return cls(
            lambda: (t for model in models if model is not None for t in model_tensors(model)),
            scratch=lambda: (t for model in models if model is not None for t in model_scratch_tensors(model)),
            device=compute_device(*models),
        )

    def _collect(self) -> tuple[list[torch.UntypedStorage], list[torch.UntypedStorage]]:
        """(storages copied, scratch storages freed): distinct, non-empty, on ``device``."""

        def distinct(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
            found: dict[int, torch.UntypedStorage] = {}
            for t in tensors:
                if torch.is_tensor(t) and not t.is_meta and (self.device is None or t.device == self.device):
                    storage = t.untyped_storage()
                    if storage.nbytes() > 0:
                        found.setdefault(storage.data_ptr(), storage)
            return found

        scratch = distinct(self._scratch())
        kept = {k: s for k, s in distinct(self._tensors()).items() if k not in scratch}
        return list(kept.values()), list(scratch.values())

    @property
    def nbytes(self) -> int:
        """Bytes one offload copies to the host (now, or while offloaded)."""
        if self._offloaded:
            return sum(len(h) for h in self._host)
        return sum(s.nbytes() for s in self._collect()[0])

    @property
    def offloaded(self) -> bool:
        """Whether the tensors are in host memory now."""
        return self._offloaded

    def offload(self) -> None:
        """Copy the tensors' storages to host memory and free them on the device (no-op when offloaded)."""
        if self._offloaded:
            return
        self._storages, scratch = self._collect()
        sizes = [s.nbytes() for s in self._storages]
        on_cuda = any(s.device.type == "cuda" for s in self._storages)
        if [len(h) for h in self._host] != sizes:  # first offload, or the optimizer's state appeared
            self._release_host()
            self._host = [_host_buffer(n, pinned=on_cuda) for n in sizes]
        for storage, copy in zip(self._storages, self._host):
            copy.copy_(_as_bytes(storage), non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.synchronize()
        for storage in self._storages:
            storage.resize_(0)
        self._freed = [(s, s.nbytes()) for s in scratch]
        for storage, _ in self._freed:
            storage.resize_(0)
        self._by_pointer = {}
        self._offloaded = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.ledger is not None:
            self.ledger.trainer_to_host(emptied_cache=True)

    def reload(self) -> None:
        """Bring the storages back to the device from their host copies (no-op when not offloaded)."""
        if not self._offloaded:
            return
        for storage, copy in zip(self._storages, self._host):
            storage.resize_(copy.numel())
            _as_bytes(storage).copy_(copy, non_blocking=copy.is_pinned())
        for storage, size in self._freed:
            storage.resize_(size)
            _as_bytes(storage).zero_()
        if self._storages and self._storages[0].device.type == "cuda":
            torch.cuda.synchronize()
        self._freed, self._by_pointer = [], {}
        self._offloaded = False
        if self.ledger is not None:
            self.ledger.trainer_to_device()

    @contextlib.contextmanager
    def released(self, enabled: bool = True) -> Iterator[None]:
        """Offloaded inside the block (when `enabled`), reloaded after it, also on an error."""
        if not enabled:
            yield
            return
        self.offload()
        try:
            yield
        finally:
            self.reload()

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s values in its host copy while offloaded (same dtype, shape, strides).

        ``t`` itself when not offloaded or when its storage did not move.
        """
        if not self._offloaded:
            return t
        if not self._by_pointer:  # a freed storage has no data pointer: key by the storage itself
            self._by_pointer = {s._cdata: h for s, h in zip(self._storages, self._host)}
        copy = self._by_pointer.get(t.untyped_storage()._cdata)
        if copy is None:
            return t
        view = torch.empty(0, dtype=t.dtype)
        return view.set_(copy.untyped_storage(), t.storage_offset(), t.shape, t.stride())

    @contextlib.contextmanager
    def host_views(self, *models: Any) -> Iterator[None]:
        """Inside the block, the parameters and buffers of ``models``' chunks read their host copies.

        ``.data`` is swapped and restored after, so a weight export streams from host memory
        without bringing the trainer back. A no-op when not offloaded.
        """
        if not self._offloaded:
            yield
            return
        swapped = []
        try:
            for model in models:
                for chunk in getattr(model, "model_chunks", []) if model is not None else []:
                    for t in chunk.state_dict(keep_vars=True).values():
                        if torch.is_tensor(t):
                            view = self.host_view(t)
                            if view is not t:
                                swapped.append((t, t.data))
                                t.data = view
            yield
        finally:
            for t, data in reversed(swapped):
                t.data = data

    def _release_host(self) -> None:
        for copy in self._host:
            _unpin(copy)
        self._host = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._release_host()


def _reader(
    tensors: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]],
) -> Callable[[], Iterable[torch.Tensor]]:
    if callable(tensors):
        return tensors
    kept = list(tensors)
    return lambda: kept


def _host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host byte buffer of exactly ``nbytes``.

    Page-locked in place when ``pinned`` (the caching host allocator behind ``pin_memory=True``
    would round it up to a power of two).
    """
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and nbytes:
        status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)  # type: ignore[no-untyped-call]
        if int(status) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(status)}")
        setattr(buffer, "_armor_registered", True)  # noqa: B010 (a mark on a tensor: no declared field)
    return buffer


def _unpin(buffer: torch.Tensor) -> None:
    if getattr(buffer, "_armor_registered", False):
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())  # type: ignore[no-untyped-call]
        setattr(buffer, "_armor_registered", False)  # noqa: B010


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
