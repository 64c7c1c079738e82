"""RolloutBatch: the rows of one rollout step, as tensors, per-row Python objects and meta.

Every tensor has the batch size N as its leading dimension ([N], [N, T], ...), every object
list has N entries (prompt texts, verifier breakdowns, ...), and ``meta`` holds batch-level
facts (step, weight version, ...). All row operations (slice, split, chunk, select by mask,
index, concat, repeat_interleave) keep the three parts aligned; a shape or length mismatch
raises at once with the field's name.

Written here rather than on tensordict: rows here carry plain Python objects next to ragged
[N, T] tensors that need right-padding on concat, which tensordict handles only awkwardly,
and ~150 lines spare a dependency.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


class RolloutBatch:
    """N rows: ``tensors`` (leading dim N), ``objects`` (lists of N) and a ``meta`` dict."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        objects: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ):
        self.tensors: dict[str, torch.Tensor] = {}
        self.objects: dict[str, list[Any]] = {}
        self.meta: dict[str, Any] = dict(meta or {})
        self._size: int | None = None
        for key, value in (tensors or {}).items():
            self[key] = value
        for key, items in (objects or {}).items():
            self[key] = items

    # ----- fields -------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._size or 0

    def keys(self) -> list[str]:
        """The field names: tensor fields, then object fields."""
        return [*self.tensors, *self.objects]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.objects

    def __getitem__(self, key: str) -> Any:  # a tensor field, or an object field (a list)
        if key in self.tensors:
            return self.tensors[key]
        if key in self.objects:
            return self.objects[key]
        raise KeyError(f"RolloutBatch has no field {key!r}; fields: {', '.join(self.keys()) or '(none)'}")

    def __setitem__(self, key: str, value: torch.Tensor | Sequence[Any]) -> None:
        """Add or replace a field: a tensor (leading dim N) or a sequence of N objects."""
        if not isinstance(key, str):
            raise TypeError(f"RolloutBatch field names are strings, got {key!r}")
        if key in (self.objects if isinstance(value, torch.Tensor) else self.tensors):
            raise ValueError(f"field {key!r} exists with the other kind (tensor vs objects)")
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise ValueError(f"tensor field {key!r} is 0-dim; put batch-level values in meta")
            size = value.shape[0]
        else:
            value = list(value)
            size = len(value)
        others = [k for k in self.keys() if k != key]
        if others and size != self._size:
            raise ValueError(f"field {key!r} has {size} rows, the batch has {self._size}")
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.objects[key] = value
        self._size = size

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        return (
            f"RolloutBatch(rows={len(self)}, tensors={{{tensors}}}, objects={list(self.objects)}, "
            f"meta={list(self.meta)})"
        )

    # ----- row operations -----------------------------------------------------------------
    def _derive(self, tensors: dict[str, torch.Tensor], objects: dict[str, list[Any]]) -> RolloutBatch:
        out = RolloutBatch(meta=self.meta)
        out.tensors, out.objects = tensors, objects
        sizes = [t.shape[0] for t in tensors.values()] + [len(o) for o in objects.values()]
        out._size = sizes[0] if sizes else 0
        return out

    def slice(self, start: int, stop: int | None = None) -> RolloutBatch:
        """Rows [start, stop), Python slice semantics."""
        rows = slice(start, stop)
        return self._derive(
            {k: v[rows] for k, v in self.tensors.items()}, {k: v[rows] for k, v in self.objects.items()}
        )

    def index(self, indices: torch.Tensor | Sequence[int]) -> RolloutBatch:
        """Rows in the given order (may repeat)."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if idx.numel() and not (-len(self) <= int(idx.min()) and int(idx.max()) < len(self)):
            raise IndexError(f"row index out of range for a batch of {len(self)} rows")
        rows = idx.tolist()
        return self._derive(
            {k: v[idx.to(v.device)] for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.objects.items()},
        )

    def select(self, mask: torch.Tensor | Sequence[bool]) -> RolloutBatch:
        """Rows where the boolean ``mask`` [N] is True, in order."""
        mask = torch.as_tensor(mask)
        if mask.dtype != torch.bool or mask.shape != (len(self),):
            raise ValueError(f"select needs a bool mask of shape ({len(self)},), got {mask.dtype} {tuple(mask.shape)}")
        return self.index(mask.cpu().nonzero().reshape(-1))

    def split(self, rows_per_part: int) -> list[RolloutBatch]:
        """Consecutive parts of ``rows_per_part`` rows (the last one may be shorter)."""
        if rows_per_part < 1:
            raise ValueError(f"split needs rows_per_part >= 1, got {rows_per_part!r}")
        return [self.slice(i, i + rows_per_part) for i in range(0, len(self), rows_per_part)]

    def chunk(self, parts: int) -> list[RolloutBatch]:
        """Exactly ``parts`` consecutive parts whose sizes differ by at most one (larger first)."""
        if parts < 1:
            raise ValueError(f"chunk needs parts >= 1, got {parts!r}")
        base, extra = divmod(len(self), parts)
        bounds = [0]
        for p in range(parts):
            bounds.append(bounds[-1] + base + (p < extra))
        return [self.slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def repeat_interleave(self, repeats: int) -> RolloutBatch:
        """Each row ``repeats`` times in a row (a prompt batch -> its G samples' rows)."""
        return self.index(torch.arange(len(self)).repeat_interleave(repeats))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RolloutBatch:
        """The batch with its tensors moved to ``device`` (objects and meta shared)."""
        return self._derive(
            {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors.items()}, dict(self.objects)
        )

    @classmethod
    def concat(
        cls, batches: Iterable[RolloutBatch], pad_values: Mapping[str, float | int] | None = None
    ) -> RolloutBatch:
        """Rows of all batches in order.

        All must have the same fields. A tensor whose trailing dims differ between batches (e.g. [N,
        T] with different T) is right-padded to the largest with ``pad_values[key]``; without an
        entry for it, the mismatch raises. Meta dicts are merged; one key with two different values
        raises.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        pad_values = pad_values or {}
        first = batches[0]
        for i, b in enumerate(batches[1:], 1):
            if sorted(b.tensors) != sorted(first.tensors) or sorted(b.objects) != sorted(first.objects):
                raise ValueError(f"concat: batch {i} has fields {sorted(b.keys())}, batch 0 has {sorted(first.keys())}")
        tensors = {k: _cat_padded(k, [b.tensors[k] for b in batches], pad_values.get(k)) for k in first.tensors}
        objects = {k: [o for b in batches for o in b.objects[k]] for k in first.objects}
        out = first._derive(tensors, objects)
        out.meta = _merge_meta([b.meta for b in batches])
        return out


def _cat_padded(key: str, parts: list[torch.Tensor], pad_value: float | int | None) -> torch.Tensor:
    trailing = [p.shape[1:] for p in parts]
    if len(set(trailing)) > 1:
        if pad_value is None or len({len(t) for t in trailing}) > 1:
            raise ValueError(
                f"concat: field {key!r} has trailing shapes {[tuple(t) for t in trailing]}; "
                f"give pad_values[{key!r}] to right-pad it"
            )
        target = [max(dims) for dims in zip(*trailing)]
        padded = []
        for p in parts:
            out = p.new_full((p.shape[0], *target), pad_value)
            region = (slice(None), *(slice(0, d) for d in p.shape[1:]))
            out[region] = p
            padded.append(out)
        parts = padded
    return torch.cat(parts, dim=0)


def _merge_meta(metas: list[Mapping[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for meta in metas:
        for k, v in meta.items():
            if k in merged and not _same(merged[k], v):
                raise ValueError(f"concat: meta {k!r} differs between batches ({merged[k]!r} vs {v!r})")
            merged.setdefault(k, v)
    return merged


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a is b or bool(a == b)
