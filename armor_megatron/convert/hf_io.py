"""Streaming reads and writes of Hugging Face safetensors checkpoints.

Reading: every shard is opened once with ``safe_open`` up front (names, dtypes, shapes; the
library rejects a truncated or malformed file here) and its header's data offsets are kept.
A tensor is then either located (``segment``: the converter has the kernel copy its bytes) or
read with ``os.preadv`` straight into the caller's buffer, rows at a time if wanted. (Reading through
``safe_open``'s mmap was slower on the development machines -- a page fault per 4 KiB -- and
the mapped pages count in the process's RSS.)

Writing: the caller declares every tensor (name, shape, dtype) in the order it will produce
them; shards are cut at ``max_shard_bytes``, each shard's header is written first and then
tensor bytes are appended as they arrive -- from memory (``write_blocks``) or copied by the
kernel from other files (``write_segments``) -- so memory holds at most one tensor. The file
format is safetensors': 8-byte little-endian header length, JSON header
``{name: {dtype, shape, data_offsets}}`` padded to 8 bytes, raw little-endian data.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from armor_megatron.confined import inside
from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.raw_io import byte_view, open_sliced, pread_into
from armor_megatron.convert.segments import FileSegment, copy_segments, read_chunks, total_bytes
from armor_megatron.models import ModelArch, load_hf_config

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a safetensors file, and its dtype and shape."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of the first data byte in the file

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


def safetensors_files(directory: str) -> list[str]:
    """The safetensors files of an HF model directory, relative to it.

    The shards ``model.safetensors.index.json`` names (each confined to ``directory``, links
    resolved: `confined.inside`), else ``model.safetensors``. Existence is the caller's to check.
    """
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: weight_map must map tensor names to files")
        shards = sorted(set(weight_map.values()), key=str)
    elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        index_path, shards = directory, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
    for shard in shards:
        inside(directory, shard, index_path)
    return shards


def declared_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The floating dtype an HF config declares for its weights (``torch_dtype``, or ``dtype`` in transformers 5).

    None when it declares none (or one this project does not know).
    """
    name = config.get("torch_dtype") or config.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def read_header(path: str, declared: torch.dtype | None) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """{name: (dtype, shape, offset of the first data byte)} of a safetensors file, every entry checked.

    Every reader of safetensors files in the project reads headers here. Each tensor's dtype must
    be a floating one (every weight of the supported families is; a header saying ``I32`` for
    ``F32`` bytes would train on garbage) and, at the size of the config's declared ``torch_dtype``,
    that dtype itself (``F16`` is not ``BF16``); floats of other sizes are accepted (fp32 norms,
    routers and biases in bf16 checkpoints are common). Its ``data_offsets`` must span exactly
    shape × dtype size bytes, inside the file. Anything else is a one-line `CheckpointError` naming
    the file, the tensor, what was found and what was expected.
    """
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        size = os.path.getsize(path)
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name} has a malformed header entry {entry!r}") from None
        dtype = _CODE_DTYPES.get(code)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {code}")
        expected = _expected_dtype_codes(dtype, declared)
        if expected is not None:
            raise CheckpointError(f"{path}: tensor {name} is stored as {code}, expected {expected}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not all(isinstance(o, int) for o in (start, end)):
            raise CheckpointError(f"{path}: tensor {name} has a malformed shape or offsets {entry!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if end - start != nbytes:
            raise CheckpointError(
                f"{path}: tensor {name} spans {end - start} bytes, but {code} {list(shape)} is {nbytes} bytes"
            )
        if start < 0 or 8 + header_len + end > size:
            raise CheckpointError(
                f"{path}: unreadable or truncated safetensors file (tensor {name} ends at byte "
                f"{8 + header_len + end}, the file has {size})"
            )
        entries[name] = (dtype, shape, 8 + header_len + start)
    return entries


def _expected_dtype_codes(found: torch.dtype, declared: torch.dtype | None) -> str | None:
    """None when a weight stored as ``found`` is acceptable under ``declared``; else what was expected.

    A float of another size than the declared one is a legitimate mix (fp32 norms in a bf16
    checkpoint, bf16 weights under a config saying float32); a wrong size also shows as a wrong byte
    span. What the span cannot catch is a dtype of the declared one's size with another meaning:
    an integer, or the other 16-bit float.
    """
    declared_code = None if declared is None else f"{_DTYPE_CODES[declared]} (the config's torch_dtype)"
    if not found.is_floating_point:
        return declared_code or "a floating dtype"
    if declared is not None and found != declared and found.itemsize == declared.itemsize:
        return declared_code
    return None


class HFCheckpoint:
    """An HF model directory: its config, its ModelArch and a lazy tensor index."""

    def __init__(self, path: str):
        self._fds: dict[str, int] = {}  # before anything can raise: close() runs from __del__
        if not os.path.isdir(path):
            raise CheckpointError(f"{path}: not a directory")
        self.path = path
        self.config = load_hf_config(path)
        self.arch = ModelArch.from_hf_dir(path)
        self.tensors: dict[str, TensorInfo] = {}
        try:
            for shard in self._shard_files():
                self._index_shard(shard)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the open shard files."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def _shard_files(self) -> list[str]:
        shards = safetensors_files(self.path)
        for shard in shards:
            if not os.path.isfile(os.path.join(self.path, shard)):
                raise CheckpointError(f"{self.path}: shard {shard} is missing")
        return shards

    def _index_shard(self, shard: str) -> None:
        path = os.path.join(self.path, shard)
        entries = read_header(path, declared_dtype(self.config))
        try:
            with safe_open(path, framework="pt"):
                pass  # validates the rest: overlapping or unordered offsets, a garbled header
        except SafetensorError as e:
            raise CheckpointError(f"{path}: unreadable or truncated safetensors file ({e})") from None
        for name, (dtype, shape, offset) in entries.items():
            self.tensors[name] = TensorInfo(shard, dtype, shape, offset)
        self._fds[shard] = os.open(path, os.O_RDONLY)

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of tensor ``name``; a missing one raises CheckpointError."""
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

    def segment(self, name: str) -> FileSegment:
        """Where tensor ``name``'s bytes lie (its shard stays open while this checkpoint is)."""
        info = self.info(name)
        return FileSegment(self._fds[info.file], info.offset, info.nbytes)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read into fresh memory."""
        info = self.info(name)
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_rows_into(name, 0, info.shape[0] if info.shape else 1, out)
        return out

    def read_rows_into(self, name: str, first_row: int, rows: int, out: torch.Tensor) -> None:
        """Read rows ``first_row:first_row+rows`` (dim 0) of tensor ``name`` into the contiguous ``out``."""
        info = self.info(name)
        row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else info.nbytes
        if out.dtype != info.dtype or out.nbytes != rows * row_bytes or not out.is_contiguous():
            raise ValueError(f"{name}: cannot read {rows} rows into a {tuple(out.shape)} {out.dtype} buffer")
        try:
            pread_into(self._fds[info.file], out, info.offset + first_row * row_bytes)
        except EOFError:
            raise CheckpointError(f"{self.path}: {info.file} ended while reading {name}") from None


# ---------------------------------------------------------------------- writing
@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """A tensor the writer is told of before it is written: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize


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
        header[t.name] = {
            "dtype": _DTYPE_CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
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
        self._open_shard: int | None = None
        self._stream: io.BufferedWriter | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next declared tensor ``name`` from ``tensor``."""
        self.write_blocks(name, tuple(tensor.shape), [tensor])

    def write_blocks(self, name: str, shape: tuple[int, ...], blocks: Sequence[torch.Tensor]) -> None:
        """Write tensor ``name`` of ``shape`` whose data is the concatenation of ``blocks``' bytes."""
        stream = self._start_tensor(name, shape, {b.dtype for b in blocks}, sum(b.nbytes for b in blocks))
        for block in blocks:
            if block.numel():
                block = block.contiguous()
                stream.write(byte_view(block))
        self._pos += 1

    def write_segments(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, segments: Sequence[FileSegment]
    ) -> None:
        """Write tensor ``name`` from file segments, copied by the kernel.

        Write tensor ``name`` whose data is the concatenation of the file segments (copied by
        the kernel: the bytes never enter this process).
        """
        nbytes = total_bytes(segments)
        stream = self._start_tensor(name, shape, {dtype}, nbytes)
        stream.flush()
        at = stream.tell()
        copy_segments(segments, stream.fileno(), at)
        stream.seek(at + nbytes)
        self._pos += 1

    def _start_tensor(
        self, name: str, shape: tuple[int, ...], dtypes: set[torch.dtype], nbytes: int
    ) -> io.BufferedWriter:
        """Check the tensor is the next one declared; open its shard (header first) if needed; its stream."""
        if self._pos >= len(self._queue):
            raise RuntimeError(f"{name}: more tensors written than declared")
        shard, planned = self._queue[self._pos]
        if (name, tuple(shape), dtypes, nbytes) != (planned.name, planned.shape, {planned.dtype}, planned.nbytes):
            raise RuntimeError(
                f"wrote {name} {tuple(shape)} {dtypes} ({nbytes} bytes), expected "
                f"{planned.name} {planned.shape} {planned.dtype} ({planned.nbytes} bytes)"
            )
        if shard != self._open_shard:
            self._close_stream()
            self._stream = open_sliced(os.path.join(self.out_dir, self.files[shard]))
            self._stream.write(_header(self.shards[shard]))
            self._open_shard = shard
        assert self._stream is not None  # the shard is open
        return self._stream

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
            index = {
                "metadata": {"total_size": sum(t.nbytes for shard in self.shards for t in shard)},
                "weight_map": {t.name: f for f, shard in zip(self.files, self.shards) for t in shard},
            }
            with open(os.path.join(self.out_dir, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)


class TensorDigest:
    """Content checksum of a set of named tensors, independent of order and file layout.

    It is xxh3-128 over the sorted lines ``name dtype shape xxh3_128(bytes)`` (xxh3 hashes at memory speed
    -- ~5x sha256 on the development machines -- and only has to catch corruption).

    Hashing runs on one worker thread (xxhash releases the GIL) while the caller goes on:

    * ``update(named)`` hashes (name, tensor) pairs -- or the pairs a callable returns,
      evaluated on the worker; it first waits for all earlier work, so at most one batch of
      tensors is kept alive for hashing;
    * ``update_file(name, dtype, shape, segment)`` hashes a tensor's bytes read from its file
      through a small reused buffer (1 MiB: it stays in cache); it is queued without waiting.
    """

    ALGORITHM = "xxh3_128"
    READ_BYTES = 2**20

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._lines: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensor-digest")
        self._pending: list = []
        self._read_buffer: memoryview | None = None  # used by the worker only

    @staticmethod
    def _line(name: str, dtype: torch.dtype, shape: Sequence[int], hexdigest: str) -> str:
        return f"{name} {str(dtype).removeprefix('torch.')} {list(shape)} {hexdigest}"

    @classmethod
    def _lines_of(cls, named) -> list[str]:
        import xxhash

        lines = []
        for name, tensor in named() if callable(named) else named:
            tensor = tensor.contiguous()
            lines.append(cls._line(name, tensor.dtype, tensor.shape, xxhash.xxh3_128(byte_view(tensor)).hexdigest()))
        return lines

    def _file_lines(self, name: str, dtype: torch.dtype, shape: Sequence[int], segment: FileSegment) -> list[str]:
        import xxhash

        if self._read_buffer is None:
            self._read_buffer = memoryview(bytearray(self.READ_BYTES))
        data = xxhash.xxh3_128()
        for chunk in read_chunks(segment, self._read_buffer):
            data.update(chunk)
        return [self._line(name, dtype, shape, data.hexdigest())]

    def wait(self) -> None:
        """Block until all queued hashing is done (tensors handed to ``update`` may then be reused)."""
        for future in self._pending:
            self._lines += future.result()
        self._pending = []

    def update(self, named) -> None:
        """Add named tensors (an iterable, or a callable giving one) to the checksum, hashed on a worker thread."""
        self.wait()
        self._pending.append(self._pool.submit(self._lines_of, named if callable(named) else list(named)))

    def update_file(self, name: str, dtype: torch.dtype, shape: Sequence[int], segment: FileSegment) -> None:
        """Add one tensor read from a file segment to the checksum."""
        self._pending.append(self._pool.submit(self._file_lines, name, dtype, tuple(shape), segment))

    def hexdigest(self) -> str:
        """The checksum of everything added, once the pending work is done."""
        import xxhash

        self.wait()
        self._pool.shutdown()
        return xxhash.xxh3_128("\n".join(sorted(self._lines)).encode()).hexdigest()
