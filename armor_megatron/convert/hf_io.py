"""Streaming reads and writes of Hugging Face safetensors checkpoints.

Reading: every shard header is read up front (names, dtypes, shapes; safetensors rejects a
truncated file here), tensors are read one at a time through a fresh ``safe_open`` mmap, so
nothing stays resident once the caller drops the tensor.

Writing: the caller declares every tensor (name, shape, dtype) in the order it will produce
them; shards are cut at ``max_shard_bytes``, each shard's header is written first and then
tensor bytes are appended as they arrive, so memory holds one tensor at a time. The file
format is safetensors': 8-byte little-endian header length, JSON header
``{name: {dtype, shape, data_offsets}}`` padded to 8 bytes, raw little-endian data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Iterable, Optional, Sequence

import torch
from safetensors import SafetensorError, safe_open

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.models import ModelArch, load_hf_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class HFCheckpoint:
    """An HF model directory: its config, its ModelArch and a lazy tensor index."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        self.path = path
        self.config = load_hf_config(path)
        self.arch = ModelArch.from_hf_config(self.config)
        self.tensors: dict[str, TensorInfo] = {}
        for shard in self._shard_files():
            self._index_shard(shard)

    def _shard_files(self) -> list[str]:
        index_path = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map") or {}
            shards = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(self.path, SINGLE_FILE)):
            shards = [SINGLE_FILE]
        else:
            raise CheckpointError(f"{self.path}: no {SINGLE_FILE} or {INDEX_FILE}")
        for shard in shards:
            if not os.path.isfile(os.path.join(self.path, shard)):
                raise CheckpointError(f"{self.path}: shard {shard} is missing")
        return shards

    def _index_shard(self, shard: str) -> None:
        path = os.path.join(self.path, shard)
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    dtype = _CODE_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {sl.get_dtype()}")
                    self.tensors[name] = TensorInfo(shard, dtype, tuple(sl.get_shape()))
        except SafetensorError as e:
            raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from None

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: tensor {name} is missing") from None

    def check(self, name: str, shape: Sequence[int]) -> TensorInfo:
        """The tensor's info; CheckpointError unless it exists with exactly ``shape``."""
        info = self.info(name)
        if info.shape != tuple(shape):
            raise CheckpointError(f"{self.path}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
        return info

    def read(self, name: str) -> torch.Tensor:
        """One tensor, backed by an mmap that is released when the tensor is freed."""
        info = self.info(name)
        with safe_open(os.path.join(self.path, info.file), framework="pt") as f:
            return f.get_tensor(name)


# ---------------------------------------------------------------------- writing
@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


def shard_plan(tensors: Sequence[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Cut the ordered tensors into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _header(tensors: Iterable[PlannedTensor]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _DTYPE_CODES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter:
    """Writes declared tensors, in declared order, into size-capped shards + index in ``out_dir``."""

    def __init__(self, out_dir: str, tensors: Sequence[PlannedTensor], max_shard_bytes: int):
        self.out_dir = out_dir
        self.shards = shard_plan(tensors, max_shard_bytes)
        n = len(self.shards)
        self.files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._queue = [(i, t) for i, shard in enumerate(self.shards) for t in shard]
        self._pos = 0
        self._open_shard: Optional[int] = None
        self._stream = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._pos >= len(self._queue):
            raise RuntimeError(f"{name}: more tensors written than declared")
        shard, planned = self._queue[self._pos]
        if (name, tuple(tensor.shape), tensor.dtype) != (planned.name, planned.shape, planned.dtype):
            raise RuntimeError(f"wrote {name} {tuple(tensor.shape)} {tensor.dtype}, expected "
                               f"{planned.name} {planned.shape} {planned.dtype}")
        if shard != self._open_shard:
            self._close_stream()
            self._stream = open(os.path.join(self.out_dir, self.files[shard]), "wb")
            self._stream.write(_header(self.shards[shard]))
            self._open_shard = shard
        if tensor.numel():
            self._stream.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._pos += 1

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        """Finish the last shard and write the index (for more than one shard)."""
        self._close_stream()
        if self._pos != len(self._queue):
            raise RuntimeError(f"only {self._pos} of {len(self._queue)} declared tensors were written")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for shard in self.shards for t in shard)},
                     "weight_map": {t.name: f for f, shard in zip(self.files, self.shards) for t in shard}}
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)


class TensorDigest:
    """Content checksum of a set of named tensors, independent of order and file layout:
    sha256 over the sorted lines ``name dtype shape sha256(bytes)``."""

    def __init__(self):
        self._lines: list[str] = []

    def update(self, name: str, tensor: torch.Tensor) -> None:
        import hashlib

        data = hashlib.sha256()
        if tensor.numel():
            data.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        self._lines.append(f"{name} {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)} {data.hexdigest()}")

    def hexdigest(self) -> str:
        import hashlib

        return hashlib.sha256("\n".join(sorted(self._lines)).encode()).hexdigest()
