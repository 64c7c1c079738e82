"""Megatron torch_dist checkpoints, written and read one tensor at a time on CPU.

A torch_dist checkpoint is a torch.distributed.checkpoint (DCP) directory (``.metadata`` +
``__0_0.distcp``) plus Megatron's ``metadata.json`` and ``common.pt``. Every tensor is stored
at its global shape; decoder tensors are stacked on a leading layer axis (and an expert axis
for MoE experts) exactly as ``GPTModel.sharded_state_dict()`` describes them, so Megatron
loads the result at any TP/PP/EP (tests/convert pin the keys, shapes and object names against
a real GPTModel and load the result with ``megatron.core.dist_checkpointing``).

Writing streams: every chunk (one layer / expert of a stacked tensor, as Megatron's
``ShardedTensor`` with ``prepend_axis_num`` describes it) becomes one DCP write item, and a
save planner produces its tensor only when DCP's ``FileSystemWriter`` asks for it; the writer
serialises one item at a time, so memory holds one tensor. (``dist_checkpointing.save``
would need the whole state dict in memory, and its writer assumes CUDA.)

Reading: a chunk stored as one item (this converter's output, a layer saved without TP) is
read straight from its bytes into a reused buffer; any other chunk is assembled by DCP's
resharding read (a load planner asking for it at its global offsets) from whatever pieces a
training run stored at its TP/PP/EP. Bucket by bucket, without a process group.

Neither direction imports megatron-core.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import functools
import io
import json
import os
from typing import Callable, Iterator, Optional, Sequence

import torch

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.raw_io import ChunkBuffer, open_sliced, pread_into, torch_save_storage_offset
from armor_megatron.convert.rules import TensorRule, tensor_rules
from armor_megatron.models import ModelArch

_LINEAR_MODULES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
# megatron.core.dist_checkpointing.core.CheckpointingConfig, as metadata.json
MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored piece of a stacked tensor: a rule at one layer (and expert)."""

    rule: TensorRule
    layer: Optional[int] = None
    expert: Optional[int] = None

    @property
    def stacked_index(self) -> tuple[int, ...]:
        return tuple(i for i in (self.layer, self.expert) if i is not None)

    def global_offset(self) -> tuple[int, ...]:
        """Offset in the stacked global tensor: (layer, [expert,] 0, ...)."""
        return self.stacked_index + (0,) * len(self.rule.shape)

    def stored_shape(self) -> tuple[int, ...]:
        """The chunk as stored: size-1 stacked axes, then the tensor's own shape."""
        return (1,) * len(self.stacked_index) + self.rule.shape


def chunks(arch: ModelArch) -> list[Chunk]:
    """Every chunk of ``arch`` in checkpoint order (rules outermost, then layers, then experts)."""
    return [Chunk(rule, layer, expert) for rule in tensor_rules(arch) for layer, expert in rule.indices(arch)]


def extra_state_keys(arch: ModelArch) -> list[str]:
    """Unique keys of the ``_extra_state`` objects (None under the local spec) that Megatron's
    linear layers put in the sharded state dict: ``<key>/shard_<offset>_<global shape>``, dims
    joined by '.', as ``ShardedObject.unique_key`` spells them."""
    keys = []
    for rule in tensor_rules(arch):
        if rule.per_layer and rule.ckpt_key.endswith(_LINEAR_MODULES):
            key = rule.ckpt_key.removesuffix("weight") + "_extra_state"
            shape = (arch.num_layers, arch.num_experts) if rule.per_expert else (arch.num_layers,)
            for layer, expert in rule.indices(arch):
                offset = (layer, expert) if rule.per_expert else (layer,)
                keys.append(f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}")
    return keys


# ---------------------------------------------------------------------- writing
@contextlib.contextmanager
def _torch_save_without_crc32() -> Iterator[None]:
    """torch.save skips the zip CRC-32 (half its time on big tensors); torch.load does not check it."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _streaming_planner(items: dict, objects: dict, produce: Callable[[Chunk], torch.Tensor]):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    class StreamingSavePlanner(DefaultSavePlanner):
        """Plans the declared items; materialises each tensor only in ``resolve_data``."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan([item for item, _ in items.values()] + [item for item, _ in objects.values()])
            return self.plan

        def resolve_data(self, write_item):
            index = (write_item.index.fqn, tuple(write_item.index.offset or ()))
            if write_item.type == WriteItemType.BYTE_IO:
                return io.BytesIO(objects[index][1])
            chunk = items[index][1]
            tensor = produce(chunk)
            dtype = write_item.tensor_data.properties.dtype
            if tuple(tensor.shape) != chunk.rule.shape or tensor.dtype != dtype:
                raise RuntimeError(f"{write_item.index.fqn}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"planned {chunk.rule.shape} {dtype}")
            return tensor.reshape(chunk.stored_shape())

    return StreamingSavePlanner()


def write_checkpoint(out_dir: str, arch: ModelArch, dtype_of: Callable[[TensorRule], torch.dtype],
                     produce: Callable[[Chunk], torch.Tensor]) -> None:
    """Write a torch_dist checkpoint of ``arch`` into the existing empty directory ``out_dir``.

    ``produce(chunk)`` returns the chunk's tensor (shape ``chunk.rule.shape``, dtype
    ``dtype_of(chunk.rule)``); it is called once per chunk, in ``chunks(arch)`` order.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = {}
    for chunk in chunks(arch):
        offset = torch.Size(chunk.global_offset())
        item = WriteItem(
            index=MetadataIndex(chunk.rule.ckpt_key, offset),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offset, sizes=torch.Size(chunk.stored_shape())),
                properties=TensorProperties(dtype=dtype_of(chunk.rule)),
                size=torch.Size(chunk.rule.stacked_shape(arch)),
            ),
        )
        items[(chunk.rule.ckpt_key, tuple(offset))] = (item, chunk)
    none_list = io.BytesIO()
    torch.save([None], none_list)  # megatron stores each object key as the list of its shards' data
    objects = {(key, ()): (WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO), none_list.getvalue())
               for key in extra_state_keys(arch)}
    # TORCH_SAVE writes each item as it comes (the safetensors format would keep every
    # produced tensor until the end of the file, and ours share one buffer).
    writer = FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=1, sync_files=False,
                              serialization_format=SerializationFormat.TORCH_SAVE)
    writer.fs = _sliced_writes_filesystem_class()()
    with _torch_save_without_crc32():
        dcp_save({}, storage_writer=writer, planner=_streaming_planner(items, objects, produce), no_dist=True)
    torch.save({}, os.path.join(out_dir, "common.pt"))
    with open(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump(MEGATRON_CONFIG, f)


# ---------------------------------------------------------------------- reading
class TorchDistReader:
    """Reads chunks of a torch_dist checkpoint at their global shapes (any saving parallelism).

    A chunk the checkpoint stores as one item (this converter's output; a layer saved at TP=1)
    is read straight from the file into a reused buffer of ``buffer_bytes`` (at least the
    largest chunk). Other chunks (TP / EP fragments of a training run) are assembled by DCP's
    resharding read into fresh memory. No process group is needed.
    """

    def __init__(self, ckpt_dir: str, arch: ModelArch, buffer_bytes: int = 0):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._files: dict[str, int] = {}  # before anything can raise: close() runs from __del__
        _check_megatron_config(ckpt_dir)
        self.ckpt_dir, self.arch = ckpt_dir, arch
        self._storage = FileSystemReader(ckpt_dir)
        try:
            self.metadata = self._storage.read_metadata()
        except Exception as e:  # missing / corrupt .metadata: torch raises several types
            raise CheckpointError(f"{ckpt_dir}: unreadable checkpoint metadata ({e})") from None
        self._storage.read_metadata = lambda *args, **kwargs: self.metadata  # parse the pickle once
        stored = {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        self.keys: dict[TensorRule, str] = {}
        self.dtypes: dict[TensorRule, torch.dtype] = {}
        for rule in tensor_rules(arch):
            key = next((k for k in (rule.ckpt_key, *rule.alt_ckpt_keys) if k in stored), None)
            if key is None:
                raise CheckpointError(f"{ckpt_dir}: tensor {rule.ckpt_key} is missing")
            if tuple(stored[key].size) != rule.stacked_shape(arch):
                raise CheckpointError(f"{ckpt_dir}: tensor {key} has shape {list(stored[key].size)}, "
                                      f"expected {list(rule.stacked_shape(arch))}")
            self.keys[rule], self.dtypes[rule] = key, stored[key].properties.dtype
        largest = max(self.chunk_bytes(c) for c in chunks(arch))
        self._buffer = ChunkBuffer(max(buffer_bytes, largest))

    def chunk_bytes(self, chunk: Chunk) -> int:
        return self.dtypes[chunk.rule].itemsize * math.prod(chunk.rule.shape)

    def read(self, wanted: Sequence[Chunk]) -> list[torch.Tensor]:
        """The chunks' tensors (shape ``rule.shape``), in order. At most ``buffer_bytes`` (or one
        chunk) per call; the tensors are valid until the next call."""
        from torch.distributed.checkpoint import load as dcp_load

        out, used = {}, 0
        for i, chunk in enumerate(wanted):
            tensor = self._read_stored_item(chunk, used)
            if tensor is not None:
                out[i], used = tensor, used + tensor.nbytes
        targets = {(self.keys[c.rule], c.global_offset()): torch.empty(c.stored_shape(), dtype=self.dtypes[c.rule])
                   for i, c in enumerate(wanted) if i not in out}
        if targets:
            dcp_load({}, storage_reader=self._storage, planner=_chunk_load_planner_class()(targets), no_dist=True)
        return [out[i].reshape(c.rule.shape) if i in out else targets[(self.keys[c.rule], c.global_offset())].reshape(
            c.rule.shape) for i, c in enumerate(wanted)]

    def _read_stored_item(self, chunk: Chunk, buffer_offset: int) -> Optional[torch.Tensor]:
        """The chunk read into the buffer at ``buffer_offset`` if the checkpoint stores exactly
        it as one plain item, else None."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        key, offset, shape = self.keys[chunk.rule], torch.Size(chunk.global_offset()), chunk.stored_shape()
        stored = self.metadata.state_dict_metadata[key].chunks
        if not any(c.offsets == offset and tuple(c.sizes) == shape for c in stored):
            return None
        info = self.metadata.storage_data.get(MetadataIndex(key, offset))
        nbytes = self.chunk_bytes(chunk)
        if info is None or getattr(info, "transform_descriptors", None) or buffer_offset + nbytes > self._buffer.nbytes:
            return None
        fd = self._fd(info.relative_path)
        with open(fd, "rb", closefd=False) as f:
            start = torch_save_storage_offset(f, info.offset, info.length, nbytes)
        if start is None:
            return None
        tensor = self._buffer.get(shape, self.dtypes[chunk.rule], buffer_offset)
        try:
            pread_into(fd, tensor, start)
        except EOFError as e:
            raise CheckpointError(f"{self.ckpt_dir}: {info.relative_path} is truncated ({e})") from None
        return tensor

    def _fd(self, relative_path: str) -> int:
        if relative_path not in self._files:
            self._files[relative_path] = os.open(os.path.join(self.ckpt_dir, relative_path), os.O_RDONLY)
        return self._files[relative_path]

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self) -> None:
        self.close()


def _check_megatron_config(ckpt_dir: str) -> None:
    path = os.path.join(ckpt_dir, "metadata.json")
    try:
        with open(path) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError):
        raise CheckpointError(f"{ckpt_dir}: not a Megatron dist checkpoint (no readable metadata.json)") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{ckpt_dir}: sharded backend {backend!r} is not supported (only torch_dist)")


@functools.cache
def _sliced_writes_filesystem_class():
    """DCP's local file system with big writes issued in slices (see ``raw_io``)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class SlicedWritesFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode: str):
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with open_sliced(path, mode) as stream:
                yield stream

    return SlicedWritesFileSystem


@functools.cache
def _chunk_load_planner_class():
    """A DCP load planner filling ``targets`` {(key, global offsets): tensor} from any stored pieces.

    Defined once (DCP is imported lazily): a class created per call sits in a reference cycle
    and would keep every bucket's tensors alive until the cyclic garbage collector runs."""
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class ChunkLoadPlanner(DefaultLoadPlanner):
        def __init__(self, targets: dict):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.targets = targets

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            self.state_dict, self.metadata, self.is_coordinator = {}, metadata, is_coordinator

        def create_local_plan(self) -> LoadPlan:
            items = []
            for (key, offsets), tensor in self.targets.items():
                want = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.shape)
                reads = create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [want])
                covered = sum(math.prod(r.lengths) for r in reads)
                if covered != tensor.numel():
                    raise CheckpointError(f"{key} at {list(offsets)}: the checkpoint stores {covered} of "
                                          f"{tensor.numel()} elements")
                items += reads
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            target = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
            return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)

        def commit_tensor(self, read_item, tensor) -> None:
            pass

    return ChunkLoadPlanner

