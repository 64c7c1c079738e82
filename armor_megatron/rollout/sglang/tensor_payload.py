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

SGLang unpickles payloads with a restricted unpickler (``SafeUnpickler`` in
``sglang/srt/utils/common.py``, behind ``MultiprocessingSerializer.deserialize``): it imports
only from an allowlist of module prefixes (``builtins``, ``collections``, ``torch``, ...,
``sglang.srt.weight_sync.tensor_bucket``) minus a deny list (``eval``, ``exec``, ``os.system``
...). Its ``_update_weights_from_flattened_bucket`` reads each ``m`` by attribute and rebuilds
SGLang's own ``FlattenedTensorMetadata`` (fields ``name, shape, dtype, start_idx, end_idx,
numel``). So ``m`` is pickled as ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``
with exactly those fields in its ``__dict__``, even where SGLang is not installed (the
trainer): :func:`dumps` writes that class path for our field-identical dataclass.
:func:`restricted_loads` is the same allowlist for servers without SGLang (the test double),
which rebuild the metadata as our dataclass.
"""

from __future__ import annotations

import base64
import copyreg
import dataclasses
import io
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

FLATTENED_BUCKET = "flattened_bucket"
SGLANG_METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"

# SGLang's SafeUnpickler (sglang/srt/utils/common.py): a global is imported only if its module
# starts with one of these prefixes and (module, name) is not denied.
SGLANG_UNPICKLE_PREFIXES = (
    "builtins.",
    "collections.",
    "copyreg.",
    "functools.",
    "itertools.",
    "operator.",
    "types.",
    "weakref.",
    "torch.",
    "multiprocessing.resource_sharer.",
    "multiprocessing.reduction.",
    "pickletools.",
    "peft.",
    "transformers.",
    "huggingface_hub.",
    SGLANG_METADATA_MODULE + ".",
    "sglang.srt.model_executor.model_runner.",
    "sglang.srt.layers.",
    "sglang.srt.utils.",
    "torch_npu.",
)
SGLANG_UNPICKLE_DENIED = {
    ("builtins", "eval"),
    ("builtins", "exec"),
    ("builtins", "compile"),
    ("os", "system"),
    ("subprocess", "Popen"),
    ("subprocess", "run"),
    ("codecs", "decode"),
    ("types", "CodeType"),
    ("types", "FunctionType"),
}


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Where one tensor lives inside a flattened bucket (SGLang's field names)."""

    name: str
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def sglang_admits(module: str, name: str) -> bool:
    """Whether SGLang's restricted unpickler imports ``module.name``."""
    if (module, name) in SGLANG_UNPICKLE_DENIED:
        return False
    return any((module + ".").startswith(prefix) for prefix in SGLANG_UNPICKLE_PREFIXES)


class SGLangUnpickler(pickle.Unpickler):
    """SGLang's allowlist; SGLang's metadata class becomes ours where SGLang is not installed."""

    def find_class(self, module, name):
        if not sglang_admits(module, name):
            raise pickle.UnpicklingError(f"SGLang's unpickler refuses {module}.{name} (not in its allowlist)")
        if (module, name) == (SGLANG_METADATA_MODULE, "FlattenedTensorMetadata"):
            try:
                return super().find_class(module, name)
            except ImportError:
                return FlattenedTensorMetadata
        return super().find_class(module, name)


def restricted_loads(data: bytes) -> Any:
    """Unpickle ``data`` as SGLang's ``MultiprocessingSerializer.deserialize`` does."""
    import torch.multiprocessing  # noqa: F401  (tensor rebuild functions)

    return SGLangUnpickler(io.BytesIO(data)).load()


class _PayloadPickler(pickle._Pickler):
    """ForkingPickler's reductions (tensors as handles), and our metadata under SGLang's class path.

    The pure-Python pickler is used because it lets :meth:`save_global` write a class path
    that is not importable here: the metadata dataclass is written as SGLang's class, whose
    fields it shares, so SGLang's allowlist admits it and its server rebuilds its own class.
    """

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file, protocol):
        from multiprocessing.reduction import ForkingPickler

        super().__init__(file, protocol)
        self.dispatch_table = copyreg.dispatch_table.copy()
        self.dispatch_table.update(ForkingPickler._extra_reducers)

    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:
            self.write(pickle.GLOBAL + f"{SGLANG_METADATA_MODULE}\nFlattenedTensorMetadata\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch[type] = save_global


def buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group consecutive tensors into buckets of at most ``bucket_bytes`` (a larger tensor goes alone).

    A bucket never mixes dtypes, so it can be flattened into one tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket, size = [], 0
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
