"""Megatron torch_dist checkpoints, written and read one tensor at a time on CPU.

A torch_dist checkpoint is a torch.distributed.checkpoint (DCP) directory (``.metadata`` +
``__0_0.distcp``) plus Megatron's ``metadata.json`` and ``common.pt``. Every tensor is stored
at its global shape; decoder tensors are stacked on a leading layer axis (and an expert axis
for MoE experts) exactly as ``GPTModel.sharded_state_dict()`` describes them, so Megatron
loads the result at any TP/PP/EP.

Writing streams: the chunks are described with Megatron's own ``ShardedTensor`` /
``ShardedObject`` (for the keys, offsets and global shapes), and handed to DCP's
``FileSystemWriter`` through a planner whose ``resolve_data`` produces each chunk only when the
writer asks for it. The writer serialises one item at a time, so memory holds one tensor (the
whole-state-dict path of ``dist_checkpointing.save`` would hold the model at once).

Reading goes through ``megatron.core.dist_checkpointing.load`` with small sharded state dicts
(one bucket of chunks at a time), in a world-size-1 gloo group.

This is the only module of ``armor_megatron.convert`` that imports megatron (lazily).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import tempfile
from typing import Callable, Iterator, Optional, Sequence

import torch

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.rules import TensorRule, tensor_rules
from armor_megatron.models import ModelArch

_LINEAR_MODULES = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One stored piece of a stacked tensor: a rule at one layer (and expert)."""

    rule: TensorRule
    layer: Optional[int] = None
    expert: Optional[int] = None

    def rank_offsets(self, arch: ModelArch) -> list[tuple[int, int, int]]:
        offsets = []
        if self.layer is not None:
            offsets.append((0, self.layer, arch.num_layers))
        if self.expert is not None:
            offsets.append((len(offsets), self.expert, arch.num_experts))
        return offsets

    def sharded_tensor(self, arch: ModelArch, data: torch.Tensor, key: Optional[str] = None):
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        offsets = self.rank_offsets(arch)
        return ShardedTensor.from_rank_offsets(key or self.rule.ckpt_key, data, *offsets,
                                               prepend_axis_num=len(offsets))


def chunks(arch: ModelArch) -> list[Chunk]:
    """Every chunk of ``arch`` in checkpoint order (rules outermost, then layers, then experts)."""
    return [Chunk(rule, layer, expert) for rule in tensor_rules(arch) for layer, expert in rule.indices(arch)]


def extra_state_objects(arch: ModelArch) -> list:
    """The ``_extra_state`` ShardedObjects (value None) Megatron's linear layers put in the state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    objects = []
    for rule in tensor_rules(arch):
        if not rule.ckpt_key.endswith(_LINEAR_MODULES) or not rule.per_layer:
            continue
        key = rule.ckpt_key.removesuffix("weight") + "_extra_state"
        shape = (arch.num_layers, arch.num_experts) if rule.per_expert else (arch.num_layers,)
        for layer, expert in rule.indices(arch):
            offset = (layer, expert) if rule.per_expert else (layer,)
            objects.append(ShardedObject(key, None, shape, offset, replica_id=0))
    return objects


# ---------------------------------------------------------------------- writing
def _streaming_planner(items: dict, objects: dict, produce: Callable[[object], torch.Tensor]):
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
                return objects[index][1]
            _, what = items[index]
            tensor = produce(what)
            planned = write_item.tensor_data
            if tuple(tensor.shape) != what.rule.shape or tensor.dtype != planned.properties.dtype:
                raise RuntimeError(f"{write_item.index.fqn}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                                   f"planned {what.rule.shape} {planned.properties.dtype}")
            return tensor.reshape(planned.chunk.sizes)

    return StreamingSavePlanner()


def write_checkpoint(out_dir: str, arch: ModelArch, dtype_of: Callable[[TensorRule], torch.dtype],
                     produce: Callable[[Chunk], torch.Tensor]) -> None:
    """Write a torch_dist checkpoint of ``arch`` into the existing empty directory ``out_dir``.

    ``produce(chunk)`` returns the chunk's tensor (shape ``chunk.rule.shape``, dtype
    ``dtype_of(chunk.rule)``); it is called once per chunk, in ``chunks(arch)`` order.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = {}
    for chunk in chunks(arch):
        meta = torch.empty(chunk.rule.shape, dtype=dtype_of(chunk.rule), device="meta")
        sh = chunk.sharded_tensor(arch, meta)
        offset = torch.Size(sh.global_offset)
        sizes = torch.Size([1] * sh.prepend_axis_num + list(sh.local_shape))  # stacked axes stored as size 1
        item = WriteItem(
            index=MetadataIndex(sh.key, offset),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offset, sizes=sizes),
                properties=TensorProperties(dtype=sh.dtype),
                size=torch.Size(sh.global_shape),
            ),
        )
        items[(sh.key, tuple(offset))] = (item, chunk)
    none_bytes = io.BytesIO()
    torch.save([None], none_bytes)  # megatron stores a list of the objects' data per unique key
    objects = {}
    for obj in extra_state_objects(arch):
        objects[(obj.unique_key, ())] = (WriteItem(index=MetadataIndex(obj.unique_key), type=WriteItemType.BYTE_IO),
                                         io.BytesIO(none_bytes.getvalue()))
    writer = FileSystemWriter(out_dir, single_file_per_rank=True, thread_count=1, sync_files=False)
    dcp_save({}, storage_writer=writer, planner=_streaming_planner(items, objects, produce), no_dist=True)
    torch.save({}, os.path.join(out_dir, "common.pt"))
    save_config(CheckpointingConfig(sharded_backend="torch_dist"), out_dir)


# ---------------------------------------------------------------------- reading
@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A world-size-1 gloo group for Megatron's checkpoint code, unless one already exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="armor_convert_pg_") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


class TorchDistReader:
    """Reads chunks of a torch_dist checkpoint at their global shapes (any saving parallelism).

    Use inside :func:`single_process_group` (or an existing process group).
    """

    def __init__(self, ckpt_dir: str, arch: ModelArch):
        from megatron.core import dist_checkpointing

        if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
            raise CheckpointError(f"{ckpt_dir}: not a Megatron dist checkpoint (no metadata.json)")
        self.ckpt_dir, self.arch = ckpt_dir, arch
        try:
            stored = dist_checkpointing.load_tensors_metadata(ckpt_dir)
        except Exception as e:  # megatron raises several types for unreadable metadata
            raise CheckpointError(f"{ckpt_dir}: unreadable checkpoint metadata ({e})") from None
        self.keys: dict[TensorRule, str] = {}
        self.dtypes: dict[TensorRule, torch.dtype] = {}
        for rule in tensor_rules(arch):
            key = next((k for k in (rule.ckpt_key, *rule.alt_ckpt_keys) if k in stored), None)
            if key is None:
                raise CheckpointError(f"{ckpt_dir}: tensor {rule.ckpt_key} is missing")
            if tuple(stored[key].global_shape) != rule.stacked_shape(arch):
                raise CheckpointError(f"{ckpt_dir}: tensor {key} has shape {list(stored[key].global_shape)}, "
                                      f"expected {list(rule.stacked_shape(arch))}")
            self.keys[rule], self.dtypes[rule] = key, stored[key].dtype

    def read(self, wanted: Sequence[Chunk]) -> list[torch.Tensor]:
        """Load the given chunks (one DCP read) and return their tensors in order."""
        from megatron.core import dist_checkpointing

        request = {}
        for i, chunk in enumerate(wanted):
            data = torch.empty(chunk.rule.shape, dtype=self.dtypes[chunk.rule])
            request[str(i)] = chunk.sharded_tensor(self.arch, data, key=self.keys[chunk.rule])
        loaded = dist_checkpointing.load(request, self.ckpt_dir, validate_access_integrity=False)
        return [loaded[str(i)] for i in range(len(wanted))]
