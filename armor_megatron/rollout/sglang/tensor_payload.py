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

SGLang's server reads ``m`` by attribute, and its unpickler accepts its own
``FlattenedTensorMetadata`` class; when SGLang is importable we use that class, otherwise a
field-identical dataclass (all a server without SGLang — the test double — needs).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import pickle
from collections.abc import Iterable, Iterator
from typing import Any

FLATTENED_BUCKET = "flattened_bucket"


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Where one tensor lives inside a flattened bucket (SGLang's field names)."""

    name: str
    shape: Any  # torch.Size
    dtype: Any  # torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def _metadata_class():
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as SGLangMetadata

        return SGLangMetadata
    except ImportError:
        return FlattenedTensorMetadata


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
        meta_cls, metadata, start = _metadata_class(), [], 0
        for name, t in named_tensors:
            metadata.append(
                meta_cls(
                    name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + t.numel(), numel=t.numel()
                )
            )
            start += t.numel()
        return {"flattened_tensor": torch.cat([t.detach().reshape(-1) for _, t in named_tensors]), "metadata": metadata}
    if load_format is None:
        return [(name, t.detach()) for name, t in named_tensors]
    raise ValueError(f"unknown load_format {load_format!r} (None or {FLATTENED_BUCKET!r})")


def dumps(packed: Any) -> str:
    """One ``serialized_named_tensors`` entry: ``base64(ForkingPickler.dumps(packed))``.

    Every call makes new handles; a receiver consumes its entry's handles, so each receiver
    (each engine, each TP rank) needs an entry of its own.
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers tensor reductions with ForkingPickler)

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(packed)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize(named_tensors: list[tuple[str, Any]], load_format: str | None = FLATTENED_BUCKET) -> str:
    """``dumps(pack(named_tensors, load_format))``: one entry for one receiver."""
    return dumps(pack(named_tensors, load_format))


def deserialize(payload: str, load_format: str | None) -> list[tuple[str, Any]]:
    """Inverse of :func:`serialize`, as a server does it: ``[(name, tensor)]``.

    Unpickling runs code named in the payload: only call it on payloads from a trusted trainer.
    """
    import torch.multiprocessing  # noqa: F401

    obj = pickle.loads(base64.b64decode(payload, validate=True))
    if load_format == FLATTENED_BUCKET:
        flat = obj["flattened_tensor"]
        return [(m.name, flat[m.start_idx : m.end_idx].reshape(m.shape).to(m.dtype)) for m in obj["metadata"]]
    if load_format is None:
        return [(name, t) for name, t in obj]
    raise ValueError(f"unknown load_format {load_format!r}")
