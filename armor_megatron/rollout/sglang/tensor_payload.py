"""The ``serialized_named_tensors`` payload of SGLang's ``/update_weights_from_tensor``.

What SGLang 0.5.x expects (read from its ``MultiprocessingSerializer`` and
``FlattenedTensorBucket``): each list entry (one per TP rank) is
``base64(ForkingPickler.dumps(obj))`` where ``obj`` is

* ``load_format=None``: the list ``[(name, tensor), ...]``;
* ``load_format="flattened_bucket"``: ``{"flattened_tensor": t, "metadata": [m, ...]}`` with
  ``t`` the 1-D concatenation of the bucket's flattened tensors (one dtype per bucket) and each
  ``m`` carrying ``name, shape, dtype, start_idx, end_idx, numel`` so that
  ``t[start_idx:end_idx].reshape(shape)`` is the tensor.

``ForkingPickler`` with torch's reductions sends *handles*, not bytes: a CUDA tensor becomes
a CUDA IPC handle (the engine must share the node: colocated mode) and a CPU tensor a
shared-memory file descriptor. The sender must keep the tensors alive until the server
has answered.

SGLang 0.5.23 unpickles payloads with a restricted unpickler (``SafeUnpickler`` in
``sglang/srt/utils/common.py``, behind ``MultiprocessingSerializer.deserialize``): an EXACT
allowlist of ``(module, name)`` pairs (Python data types, torch's tensor/storage types,
dtypes and rebuild functions, ``multiprocessing.resource_sharer.DupFd``, SGLang's
``tensor_bucket`` classes); anything else raises inside the scheduler, which takes the server
down. :data:`SGLANG_ALLOWED_GLOBALS` is the part of that list a tensor payload can need, so a
payload our unpickler admits is one SGLang admits. Its ``_update_weights_from_flattened_bucket``
reads each ``m`` by attribute and rebuilds SGLang's own ``FlattenedTensorMetadata`` (fields
``name, shape, dtype, start_idx, end_idx, numel``). So ``m`` is pickled as
``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` with exactly those fields in
its ``__dict__``, even where SGLang is not installed (the trainer): :func:`dumps` writes that
class path for our field-identical dataclass. :func:`restricted_loads` applies the allowlist
for servers without SGLang (the test double), which rebuild the metadata as our dataclass.

CUDA tensors name their GPU by UUID, not by index (what SGLang's own senders do through
``sglang.srt.utils.patch_torch``): torch's CUDA IPC handle carries the sender's device index,
which names another GPU in an engine process that sees a different ``CUDA_VISIBLE_DEVICES``.
SGLang's receiving ranks patch ``rebuild_cuda_tensor`` to map a UUID back to their own index
(an int passes unchanged); :func:`restricted_loads` does the same.

By value (:func:`serialize_by_value`, for payloads small enough to copy, such as a LoRA adapter's
A and B for ``/load_lora_adapter_from_tensors``): plain pickling without ForkingPickler's
reductions writes each tensor's storage as ``torch.storage._load_from_bytes(torch.save bytes)``,
which SGLang's ``SafeUnpickler.find_class`` maps to its ``_safe_load_torch_storage``
(``torch.load(weights_only=True)``); such a payload reaches an engine on any node.
"""

from __future__ import annotations

import base64
import copyreg
import dataclasses
import io
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

FLATTENED_BUCKET = "flattened_bucket"
SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"

_REDUCTIONS = "torch.multiprocessing.reductions"
_DTYPES = (
    "bfloat16 float16 half float32 float float64 double float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
    "int8 int16 short int32 int int64 long uint8 uint16 uint32 uint64 bool complex64 complex128"
).split()
# The part of SGLang 0.5.23's SafeUnpickler.ALLOWED_GLOBALS (exact pairs) that a tensor payload
# can need; every pair here is on SGLang's list.
SGLANG_ALLOWED_GLOBALS = frozenset(
    [("builtins", t) for t in ("bool", "bytearray", "bytes", "dict", "float", "frozenset", "int", "list")]
    + [("builtins", t) for t in ("set", "slice", "str", "tuple")]
    + [("collections", "OrderedDict"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__")]
    + [("multiprocessing.resource_sharer", "DupFd"), ("multiprocessing.reduction", "_rebuild_partial")]
    + [("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype")]
    + [("torch", dtype) for dtype in _DTYPES]
    + [
        ("torch.nn.parameter", "Parameter"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch._utils", "_rebuild_parameter"),
    ]
    + [("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage")]
    + [
        (_REDUCTIONS, f)
        for f in (
            "rebuild_tensor",
            "rebuild_cuda_tensor",
            "rebuild_meta_tensor",
            "rebuild_storage_fd",
            "rebuild_storage_filename",
            "rebuild_storage_empty",
            "rebuild_typed_storage",
            "rebuild_typed_storage_child",
        )
    ]
    + [(SGLANG_METADATA_MODULE, "FlattenedTensorMetadata"), (SGLANG_METADATA_MODULE, "FlattenedTensorBucket")]
)
_CUDA_DEVICE_ARG = 6  # rebuild_cuda_tensor's argument that names the device (torch 2.x, as SGLang relies on)


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Where one tensor lives inside a flattened bucket (SGLang's field names)."""

    name: str
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_STORAGE_BY_VALUE = ("torch.storage", "_load_from_bytes")  # SGLang's find_class loads it with weights_only


def sglang_admits(module: str, name: str) -> bool:
    """Whether SGLang's restricted unpickler imports ``module.name`` (as far as a payload goes)."""
    return (module, name) in SGLANG_ALLOWED_GLOBALS or (module, name) == _STORAGE_BY_VALUE


class SGLangUnpickler(pickle.Unpickler):
    """An unpickler with SGLang's allowlist, usable where SGLang is not installed.

    SGLang's allowlist; SGLang's metadata class becomes ours where SGLang is not installed,
    and CUDA tensors named by GPU UUID are rebuilt on this process's device of that UUID.
    """

    def find_class(self, module: str, name: str) -> Any:
        """The class ``module.name`` if SGLang's allowlist admits it, else UnpicklingError."""
        if not sglang_admits(module, name):
            raise pickle.UnpicklingError(f"SGLang's unpickler refuses {module}.{name} (not in its allowlist)")
        if (module, name) == (SGLANG_METADATA_MODULE, "FlattenedTensorMetadata"):
            try:
                return super().find_class(module, name)
            except ImportError:
                return FlattenedTensorMetadata
        if (module, name) == _STORAGE_BY_VALUE:
            return _load_storage_safely
        if (module, name) == (_REDUCTIONS, "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_on_uuid
        return super().find_class(module, name)


def _load_storage_safely(data: bytes) -> Any:
    """A by-value storage, as SGLang loads it (``_safe_load_torch_storage``: ``torch.load`` with weights_only)."""
    import torch

    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def restricted_loads(data: bytes) -> Any:
    """Unpickle ``data`` as SGLang's ``MultiprocessingSerializer.deserialize`` does."""
    import torch.multiprocessing  # noqa: F401  (tensor rebuild functions)

    return SGLangUnpickler(io.BytesIO(data)).load()


def gpu_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` of this process, as SGLang writes it."""
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def _device_index(device: int | str) -> int:
    """This process's index of the GPU a payload names (by UUID, or by index as torch does)."""
    import torch

    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == device:
            return index
    raise pickle.UnpicklingError(f"the payload's GPU {device} is not visible to this process")


def _rebuild_cuda_tensor_on_uuid(*args: Any) -> Any:
    from torch.multiprocessing import reductions

    args = (*args[:_CUDA_DEVICE_ARG], _device_index(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]  # torch leaves it untyped


def _naming_gpus_by_uuid(reduce: Callable[[Any], tuple[Any, tuple[Any, ...]]]) -> Callable[[Any], Any]:
    """A tensor reducer like ``reduce`` whose CUDA IPC handles name their GPU by UUID."""

    def reduce_naming_the_gpu(obj: Any) -> tuple[Any, tuple[Any, ...]]:
        rebuild, args = reduce(obj)
        if getattr(rebuild, "__name__", None) == "rebuild_cuda_tensor":
            index = args[_CUDA_DEVICE_ARG]
            args = (*args[:_CUDA_DEVICE_ARG], gpu_uuid(index), *args[_CUDA_DEVICE_ARG + 1 :])
        return rebuild, args

    return reduce_naming_the_gpu


class _PayloadPickler(pickle._Pickler):
    """ForkingPickler's reductions (tensors as handles), and our metadata under SGLang's class path.

    The pure-Python pickler is used because it lets :meth:`save_global` write a class path
    that is not importable here: the metadata dataclass is written as SGLang's class, whose
    fields it shares, so SGLang's allowlist admits it and its server rebuilds its own class.
    """

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file: io.BytesIO, protocol: int, by_value: bool = False) -> None:
        from multiprocessing.reduction import ForkingPickler

        super().__init__(file, protocol)
        self.dispatch_table = copyreg.dispatch_table.copy()
        if not by_value:
            self.dispatch_table.update(
                (cls, _naming_gpus_by_uuid(reduce))
                for cls, reduce in ForkingPickler._extra_reducers.items()  # type: ignore[attr-defined]  # untyped private table
            )

    # typeshed's pickle._Pickler declares only the public Pickler API, not the pure-Python
    # pickler's save_global, write and memoize that this override uses.
    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is FlattenedTensorMetadata:
            self.write(pickle.GLOBAL + f"{SGLANG_METADATA_MODULE}\nFlattenedTensorMetadata\n".encode())  # type: ignore[attr-defined]
            self.memoize(obj)  # type: ignore[attr-defined]
            return
        super().save_global(obj, name)  # type: ignore[misc]

    dispatch[type] = save_global  # type: ignore[assignment]  # typeshed types dispatch as the Unpickler's table


def buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group consecutive tensors into buckets of at most ``bucket_bytes`` (a larger tensor goes alone).

    A bucket never mixes dtypes, so it can be flattened into one tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > bucket_bytes or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def pack(named_tensors: list[tuple[str, Any]], load_format: str | None = FLATTENED_BUCKET) -> Any:
    """The object a payload pickles: the flattened bucket dict, or the ``(name, tensor)`` list."""
    import torch

    if not named_tensors:
        raise ValueError("cannot serialize an empty bucket")
    if load_format == FLATTENED_BUCKET:
        dtypes = {t.dtype for _, t in named_tensors}
        if len(dtypes) != 1:
            raise ValueError(f"a flattened bucket needs one dtype, got {sorted(map(str, dtypes))}")
        metadata, start = [], 0
        for name, t in named_tensors:
            metadata.append(
                FlattenedTensorMetadata(
                    name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + t.numel(), numel=t.numel()
                )
            )
            start += t.numel()
        if len(named_tensors) == 1:  # a tensor larger than the bucket goes alone: no copy of it
            flat = named_tensors[0][1].detach().reshape(-1)
        else:
            flat = torch.cat([t.detach().reshape(-1) for _, t in named_tensors])
        return {"flattened_tensor": flat, "metadata": metadata}
    if load_format is None:
        return [(name, t.detach()) for name, t in named_tensors]
    raise ValueError(f"unknown load_format {load_format!r} (None or {FLATTENED_BUCKET!r})")


def dumps(packed: Any) -> str:
    """One ``serialized_named_tensors`` entry: ``base64(pickle)`` with ForkingPickler's reductions.

    Every call makes new handles; a receiver consumes its entry's handles, so each receiver
    (each engine, each TP rank) needs an entry of its own.
    """
    import torch.multiprocessing  # noqa: F401  (registers tensor reductions with ForkingPickler)

    buf = io.BytesIO()
    _PayloadPickler(buf, pickle.HIGHEST_PROTOCOL).dump(packed)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_by_value(named_tensors: list[tuple[str, Any]]) -> str:
    """One flattened-bucket entry holding the tensors' bytes themselves (module docstring), from host copies."""
    packed = pack([(name, t.detach().cpu()) for name, t in named_tensors], FLATTENED_BUCKET)
    flat = packed["flattened_tensor"]
    if flat.untyped_storage().nbytes() != flat.numel() * flat.element_size():
        packed["flattened_tensor"] = flat.clone()  # a view would carry its whole storage
    buf = io.BytesIO()
    _PayloadPickler(buf, pickle.HIGHEST_PROTOCOL, by_value=True).dump(packed)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize(named_tensors: list[tuple[str, Any]], load_format: str | None = FLATTENED_BUCKET) -> str:
    """``dumps(pack(named_tensors, load_format))``: one entry for one receiver."""
    return dumps(pack(named_tensors, load_format))


def deserialize(payload: str, load_format: str | None) -> list[tuple[str, Any]]:
    """Inverse of :func:`serialize`, as a server does it: ``[(name, tensor)]``.

    Unpickling goes through SGLang's allowlist (:class:`SGLangUnpickler`), so a payload naming
    a class SGLang would refuse fails here too.
    """
    obj = restricted_loads(base64.b64decode(payload, validate=True))
    if load_format == FLATTENED_BUCKET:
        flat = obj["flattened_tensor"]
        return [(m.name, flat[m.start_idx : m.end_idx].reshape(m.shape).to(m.dtype)) for m in obj["metadata"]]
    if load_format is None:
        return [(name, t) for name, t in obj]
    raise ValueError(f"unknown load_format {load_format!r}")
