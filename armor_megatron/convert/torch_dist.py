"""Megatron torch_dist checkpoints, written and read one tensor at a time on CPU.

A torch_dist checkpoint is a torch.distributed.checkpoint (DCP) directory (``.metadata`` +
``__0_0.distcp``) plus Megatron's ``metadata.json`` and ``common.pt``. Every tensor is stored
at its global shape; decoder tensors are stacked on a leading layer axis (and an expert axis
for MoE experts) exactly as ``GPTModel.sharded_state_dict()`` describes them, so Megatron
loads the result at any TP/PP/EP (tests/convert pin the keys, shapes and object names against
a real GPTModel and load the result with ``megatron.core.dist_checkpointing``).

Writing streams: every chunk (one layer / expert of a stacked tensor, as Megatron's
``ShardedTensor`` with ``prepend_axis_num`` describes it) becomes one DCP write item. DCP
plans the items and writes ``.metadata``; the data step writes each item as the
``torch.save`` archive DCP would, with its bytes copied in by the kernel from the source
files' segments (see ``segments``): no tensor passes through memory. (``dist_checkpointing.save``
would need the whole state dict in memory, and its writer assumes CUDA.)

Reading: a chunk stored as one item (this converter's output, a layer saved without TP) is
located in its file (``stored_segment``) and copied or read straight from there; any other chunk is assembled by DCP's
resharding read (a load planner asking for it at its global offsets) from whatever pieces a
training run stored at its TP/PP/EP. Bucket by bucket, without a process group. A checkpoint
from elsewhere runs no code: ``.metadata`` and stored objects are read through
`dcp_safety.safe_reader_class` (an allowlist unpickler) and its data files stay inside it.

Neither direction imports megatron-core.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import os
from collections.abc import Callable, Sequence

import torch

from armor_megatron.convert.dcp_safety import safe_reader_class
from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.raw_io import ChunkBuffer, pread_into, torch_save_storage_offset
from armor_megatron.convert.rules import TensorRule, tensor_rules
from armor_megatron.convert.segments import FileSegment, HoleFillingWriter
from armor_megatron.models import ModelArch

# megatron.core.dist_checkpointing.core.CheckpointingConfig, as metadata.json
MEGATRON_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored piece of a stacked tensor: a rule at one layer (and expert)."""

    rule: TensorRule
    layer: int | None = None
    expert: int | None = None

    @property
    def stacked_index(self) -> tuple[int, ...]:
        """The (layer, expert) indices of a stacked chunk, those that are set."""
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
    """Unique keys of the ``_extra_state`` objects of Megatron's linear layers.

    Unique keys of the ``_extra_state`` objects (None under the local spec) that Megatron's
    linear layers put in the sharded state dict: ``<key>/shard_<offset>_<global shape>``, dims
    joined by '.', as ``ShardedObject.unique_key`` spells them. Layers stacked on a leading axis
    count it; a layer of its own (``decoder.layers.{i}.…``: dense and MoE layers mixed) has none.
    """
    keys = []
    for rule in tensor_rules(arch):
        if rule.ckpt_key.startswith("decoder.layers.") and _is_linear_weight(rule.ckpt_key):
            key = rule.ckpt_key.removesuffix("weight") + "_extra_state"
            if rule.per_layer:
                shape = (arch.num_layers, arch.num_experts) if rule.per_expert else (arch.num_layers,)
            else:
                shape = (arch.num_experts,) if rule.per_expert else (1,)
            for layer, expert in rule.indices(arch):
                offset = tuple(i for i in (layer, expert) if i is not None) or (0,)
                keys.append(f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}")
    return keys


def _is_linear_weight(ckpt_key: str) -> bool:
    """Whether ``ckpt_key`` is the weight of one of megatron's linear layers.

    They are all named ``linear_*`` (linear_qkv, linear_proj, linear_fc1/fc2, MLA's
    linear_q/kv_*_proj); routers, norms and the shared-expert gate are not linear layers and
    keep no ``_extra_state``.
    """
    *_, module, leaf = ckpt_key.split(".")
    return leaf == "weight" and module.startswith("linear_")


# ---------------------------------------------------------------------- writing
def _planner(write_items: list):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class DeclaredItemsSavePlanner(DefaultSavePlanner):
        """Plans the declared items without a state dict (the writer produces the data)."""

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            self.state_dict, self.is_coordinator = {}, is_coordinator

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(list(write_items))
            return self.plan

    return DeclaredItemsSavePlanner()


def _segment_writer(out_dir: str, chunk_of: dict, objects: dict, produce: Callable[[Chunk], list[FileSegment]]):
    """DCP's file-system writer with its data step replaced.

    One file, items in plan order, each tensor a ``torch.save`` archive whose data the kernel copies
    in from ``produce(chunk)``'s segments (see ``segments``). DCP still plans the items and writes
    ``.metadata``.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class SegmentWriter(FileSystemWriter):
        def write_data(self, plan, planner) -> Future:
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            results = []
            with HoleFillingWriter(os.path.join(out_dir, name)) as stream:
                for item in plan.items:
                    key = (item.index.fqn, tuple(item.index.offset or ()))
                    offset = stream.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        stream.write(objects[key])
                    else:
                        chunk = chunk_of[key]
                        stream.save_tensor(chunk.stored_shape(), item.tensor_data.properties.dtype, produce(chunk))
                    length = stream.tell() - offset
                    results.append(
                        WriteResult(
                            index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)
                        )
                    )
            done: Future[list[WriteResult]] = Future()
            done.set_result(results)
            return done

    return SegmentWriter(out_dir, single_file_per_rank=True, thread_count=1, sync_files=False)


def write_checkpoint(
    out_dir: str,
    arch: ModelArch,
    dtype_of: Callable[[TensorRule], torch.dtype],
    produce: Callable[[Chunk], list[FileSegment]],
) -> None:
    """Write a torch_dist checkpoint of ``arch`` into the existing empty directory ``out_dir``.

    ``produce(chunk)`` returns the file segments whose bytes, concatenated, are the chunk's
    tensor (shape ``chunk.rule.shape``, dtype ``dtype_of(chunk.rule)``, row-major); it is
    called once per chunk, in ``chunks(arch)`` order, and the segments are copied before the
    next call.
    """
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    write_items, chunk_of = [], {}
    for chunk in chunks(arch):
        offset = torch.Size(chunk.global_offset())
        write_items.append(
            WriteItem(
                index=MetadataIndex(chunk.rule.ckpt_key, offset),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offset, sizes=torch.Size(chunk.stored_shape())),
                    properties=TensorProperties(dtype=dtype_of(chunk.rule)),
                    size=torch.Size(chunk.rule.stacked_shape(arch)),
                ),
            )
        )
        chunk_of[(chunk.rule.ckpt_key, tuple(offset))] = chunk
    none_list = io.BytesIO()
    torch.save([None], none_list)  # megatron stores each object key as the list of its shards' data
    objects = {}
    for key in extra_state_keys(arch):
        write_items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
        objects[(key, ())] = none_list.getvalue()
    dcp_save(
        {},
        storage_writer=_segment_writer(out_dir, chunk_of, objects, produce),
        planner=_planner(write_items),
        no_dist=True,
    )
    torch.save({}, os.path.join(out_dir, "common.pt"))
    with open(os.path.join(out_dir, "metadata.json"), "w") as f:
        json.dump(MEGATRON_CONFIG, f)


# ---------------------------------------------------------------------- reading
class TorchDistReader:
    """Reads chunks of a torch_dist checkpoint at their global shapes (any saving parallelism).

    A vocabulary tensor stored with more rows (a training run's padded vocabulary) is read up to the
    HF vocabulary size.

    A chunk the checkpoint stores as one item (this converter's output; a layer saved at TP=1)
    is read straight from the file into a reused buffer of ``buffer_bytes`` (at least the
    largest chunk). Other chunks (TP / EP fragments of a training run) are assembled by DCP's
    resharding read into fresh memory. No process group is needed.
    """

    def __init__(self, ckpt_dir: str, arch: ModelArch, buffer_bytes: int = 0):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self._files: dict[str, int] = {}  # before anything can raise: close() runs from __del__
        _check_megatron_config(ckpt_dir)
        self.ckpt_dir, self.arch = ckpt_dir, arch
        self._storage = safe_reader_class()(ckpt_dir)  # runs no code a crafted checkpoint carries
        self.metadata = self._storage.read_metadata()
        stored = {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
        adapter = next((k for k in stored if ".lora.A." in k or ".lora.B." in k), None)  # megatron.lora's keys
        if adapter is not None:
            if all(".lora." in k for k in stored):  # saved before a reference reset merged into the base
                problem = (
                    "without their base (a LoRA run saves the base once a reset has merged into it; until then "
                    "it is the run's model.path or model.mcore_path)"
                )
            else:
                problem = "which converting would drop"
            raise CheckpointError(
                f"{ckpt_dir}: holds LoRA adapters ({adapter}) {problem}; use the run's merged HF copies (checkpoint.save_hf)"
            )
        self.keys: dict[TensorRule, str] = {}
        self.dtypes: dict[TensorRule, torch.dtype] = {}
        for rule in tensor_rules(arch):
            key = next((k for k in (rule.ckpt_key, *rule.alt_ckpt_keys) if k in stored), None)
            if key is None:
                raise CheckpointError(f"{ckpt_dir}: tensor {rule.ckpt_key} is missing")
            if not _shape_fits(tuple(stored[key].size), rule.stacked_shape(arch), rule.tp == "vocab"):
                raise CheckpointError(
                    f"{ckpt_dir}: tensor {key} has shape {list(stored[key].size)}, "
                    f"expected {list(rule.stacked_shape(arch))}"
                )
            self.keys[rule], self.dtypes[rule] = key, stored[key].properties.dtype
        largest = max(self.chunk_bytes(c) for c in chunks(arch))
        self._buffer = ChunkBuffer(max(buffer_bytes, largest))

    def chunk_bytes(self, chunk: Chunk) -> int:
        """Size of a chunk's data in bytes."""
        return self.dtypes[chunk.rule].itemsize * math.prod(chunk.rule.shape)

    def read(self, wanted: Sequence[Chunk]) -> list[torch.Tensor]:
        """The chunks' tensors (shape ``rule.shape``), in order.

        At most ``buffer_bytes`` (or one chunk) per call; the tensors are valid until the next call.
        """
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.api import CheckpointException

        out, used = {}, 0
        for i, chunk in enumerate(wanted):
            tensor = self._read_stored_item(chunk, used)
            if tensor is not None:
                out[i], used = tensor, used + tensor.nbytes
        targets = {
            (self.keys[c.rule], c.global_offset()): torch.empty(c.stored_shape(), dtype=self.dtypes[c.rule])
            for i, c in enumerate(wanted)
            if i not in out
        }
        if targets:
            try:
                dcp_load({}, storage_reader=self._storage, planner=_chunk_load_planner_class()(targets), no_dist=True)
            except CheckpointError:
                raise
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a short or corrupt file, however DCP says it
                reason = _root_cause(e)
                raise CheckpointError(f"{self.ckpt_dir}: a data file is truncated or corrupt ({reason})") from None
        return [
            out[i].reshape(c.rule.shape)
            if i in out
            else targets[(self.keys[c.rule], c.global_offset())].reshape(c.rule.shape)
            for i, c in enumerate(wanted)
        ]

    def _read_stored_item(self, chunk: Chunk, buffer_offset: int) -> torch.Tensor | None:
        """Read a chunk stored as one plain item straight into the buffer.

        The chunk read into the buffer at ``buffer_offset`` if it is stored as one plain
        item that fits there, else None.
        """
        segment = self.stored_segment(chunk)
        if segment is None or buffer_offset + segment.nbytes > self._buffer.nbytes:
            return None
        tensor = self._buffer.get(chunk.stored_shape(), self.dtypes[chunk.rule], buffer_offset)
        try:
            pread_into(segment.fd, tensor, segment.offset)
        except EOFError as e:
            raise CheckpointError(f"{self.ckpt_dir}: a data file is truncated ({e})") from None
        return tensor

    def stored_segment(self, chunk: Chunk) -> FileSegment | None:
        """The file segment holding a chunk's raw bytes, if stored as one plain item.

        Where the chunk's raw bytes lie if the checkpoint stores exactly it as one plain
        (untransformed, uncompressed, little-endian) item, else None.
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        key, offset, shape = self.keys[chunk.rule], torch.Size(chunk.global_offset()), chunk.stored_shape()
        meta = self.metadata.state_dict_metadata[key]
        assert isinstance(meta, TensorStorageMetadata)  # self.keys holds tensor keys only
        stored = meta.chunks
        if not any(c.offsets == offset and tuple(c.sizes) == shape for c in stored):
            return None
        info = self.metadata.storage_data.get(MetadataIndex(key, offset))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        nbytes = self.chunk_bytes(chunk)
        fd = self._fd(info.relative_path)
        with open(fd, "rb", closefd=False) as f:
            start = torch_save_storage_offset(f, info.offset, info.length, nbytes)
        if start is None:
            return None
        if os.fstat(fd).st_size < start + nbytes:
            raise CheckpointError(
                f"{self.ckpt_dir}: {info.relative_path} is truncated (tensor {key} ends at byte {start + nbytes})"
            )
        return FileSegment(fd, start, nbytes)

    def _fd(self, relative_path: str) -> int:
        if relative_path not in self._files:
            self._files[relative_path] = os.open(os.path.join(self.ckpt_dir, relative_path), os.O_RDONLY)
        return self._files[relative_path]

    def close(self) -> None:
        """Close the open checkpoint files."""
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self) -> None:
        self.close()


def read_whole_tensors(ckpt_dir: str, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of a torch_dist checkpoint at their global shapes, assembled from whatever pieces it stores.

    Reads no model and needs no process group; the checkpoint's metadata is read safely
    (`dcp_safety`). A truncated or corrupt file is a one-line CheckpointError.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = safe_reader_class()(ckpt_dir)
    stored = storage.read_metadata().state_dict_metadata
    targets = {}
    for key in keys:
        meta = stored.get(key)
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"{ckpt_dir}: tensor {key} is missing")
        targets[(key, (0,) * len(meta.size))] = torch.empty(meta.size, dtype=meta.properties.dtype)
    try:
        dcp_load({}, storage_reader=storage, planner=_chunk_load_planner_class()(targets), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a short or corrupt file, however DCP says it
        raise CheckpointError(f"{ckpt_dir}: a data file is truncated or corrupt ({_root_cause(e)})") from None
    return {key: tensor for (key, _), tensor in targets.items()}


def _root_cause(error: BaseException) -> str:
    """The first line of the underlying error (DCP's CheckpointException wraps each rank's)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))  # (exception, its frames)
        error = error[0] if isinstance(error, tuple) else error
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0].split('. ')[0]}" if text else type(error).__name__


def _shape_fits(stored: tuple[int, ...], expected: tuple[int, ...], vocabulary: bool) -> bool:
    """Whether a stored global shape fits the expected one: equal, or a padded vocabulary.

    A vocabulary tensor (embedding, output layer) may have more rows: a training run pads the
    vocabulary (Megatron: to a multiple of 128·TP) and the rows past the HF vocabulary are
    padding, left unread.
    """
    if stored == expected:
        return True
    return vocabulary and len(stored) == len(expected) and stored[0] > expected[0] and stored[1:] == expected[1:]


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
def _chunk_load_planner_class():
    """A DCP load planner filling ``targets`` {(key, global offsets): tensor} from any stored pieces.

    Defined once (DCP is imported lazily): a class created per call sits in a reference cycle
    and would keep every bucket's tensors alive until the cyclic garbage collector runs.
    """
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
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
                assert self.metadata is not None  # set_up_planner ran
                meta = self.metadata.state_dict_metadata[key]
                assert isinstance(meta, TensorStorageMetadata)
                reads = create_read_items_for_chunk_list(key, meta, [want])
                covered = sum(math.prod(r.lengths) for r in reads)
                if covered != tensor.numel():
                    raise CheckpointError(
                        f"{key} at {list(offsets)}: the checkpoint stores {covered} of {tensor.numel()} elements"
                    )
                items += reads
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            target = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
            return narrow_tensor_by_index(target, read_item.dest_offsets, read_item.lengths)

        def commit_tensor(self, read_item, tensor) -> None:
            pass

    return ChunkLoadPlanner
