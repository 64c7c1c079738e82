"""Load model weights straight from an HF safetensors directory: each rank reads its own slices.

Public interface (every rank calls it; no collective runs)::

    load_weights(model_chunks, path, exclude=())         # an HF directory or a torch_dist checkpoint
    load_hf_weights(model_chunks, hf_dir, exclude=())    # an HF directory
    is_hf_dir(path)                                      # config.json + safetensors weights

What is read is what ``dist_checkpointing.load`` would read from the converter's torch_dist
checkpoint of the same HF directory, without writing one: the chunks' sharded state dict
(``model.sharded_state_dict()``, factories applied, as megatron's loader does) names every
tensor of this rank by its checkpoint key with its global shape and this rank's box in it
(layers and experts on leading axes, then the TP / expert-TP offsets). The converter's family
rules (``convert.rules``) say which HF tensors make each key's global tensor and how their rows
tile it (``row_blocks``), so every box is a few row ranges of HF tensors:

* rows a rank needs whole (column / vocab / QKV / fc1 splits, norms, routers) are read with
  ``preadv`` straight into the parameter's memory when it is a contiguous CPU tensor of the
  file's dtype;
* a column slice (row-parallel ``linear_proj`` / ``fc2``), another dtype (a bf16 file into an
  fp32 model, which is the cast ``copy_`` DCP's loader does too) or a GPU parameter goes
  through one reused buffer of at most ``buffer_bytes``;
* vocabulary rows beyond the HF vocabulary (megatron's padding) are zeros, as megatron's loader
  leaves them (``allow_shape_mismatch`` tensors are zeroed before the read).

So the parameters equal, bit for bit, those loaded from ``armor-convert hf-to-mcore``'s output,
and a rank's memory holds its own parameters plus that one buffer: no rank reads a tensor it
does not hold, and nothing is read into memory twice. (Reads use ``preadv`` rather than a
memory map: mapped pages count in a process's RSS and fault in 4 KiB at a time; see
``convert.hf_io``.)
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from armor_megatron.convert.errors import CheckpointError
from armor_megatron.convert.hf_io import HFCheckpoint
from armor_megatron.convert.rules import TensorRule, hf_shapes, row_blocks, tensor_rules
from armor_megatron.megatron.model_state import chunks_sharded_state_dict, load_chunks_state, load_model_weights

DEFAULT_BUFFER_BYTES = 64 << 20


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` is an HF model directory (a config.json; a torch_dist checkpoint has a metadata.json instead).

    Its weights must be safetensors (`HFCheckpoint` says so otherwise).
    """
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(os.path.join(path, "metadata.json"))


def load_weights(chunks: list[torch.nn.Module], path: str, exclude: tuple[str, ...] = ()) -> None:
    """Model weights from ``path``.

    An HF directory (`load_hf_weights`: each rank reads its own slices) or a torch_dist checkpoint /
    checkpoint root (`model_state.load_model_weights`).
    """
    if is_hf_dir(path):
        load_hf_weights(chunks, path, exclude)
    else:
        load_model_weights(chunks, path, exclude)


def load_hf_weights(
    chunks: list[torch.nn.Module], hf_dir: str, exclude: tuple[str, ...] = (), buffer_bytes: int = DEFAULT_BUFFER_BYTES
) -> None:
    """Fill this rank's model chunks from the HF directory ``hf_dir``.

    Tensors whose keys start with one of ``exclude`` are not read (the critic's value head). Raises
    `CheckpointError` (one line) for a tensor that is missing, mis-shaped or unknown to the family's
    rules.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace, merge, nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    state = {
        name: {k: v for k, v in sd.items() if not k.startswith(exclude)}
        for name, sd in chunks_sharded_state_dict(chunks).items()
    }
    sharded, nonpersistent, factories = load_preprocess(state)
    with HFCheckpoint(hf_dir) as hf:
        reader = _SliceReader(hf, buffer_bytes)
        for value in nested_values(sharded):
            if isinstance(value, ShardedTensor):
                reader.fill(value)
    storages = {t.untyped_storage().data_ptr() for c in chunks for t in (*c.parameters(), *c.buffers())}
    boxes = [v.data for v in nested_values(sharded) if isinstance(v, ShardedTensor)]
    if all(t.untyped_storage().data_ptr() in storages for t in boxes):
        return  # every box was a view of a parameter or buffer: the model holds the weights now
    # Some factory built its tensors as copies: finish as dist_checkpointing.load does.
    loaded = dict_list_map_outplace(
        lambda v: v.data if isinstance(v, ShardedTensor) else (None if isinstance(v, ShardedObject) else v), sharded
    )
    merge(loaded, nonpersistent)
    loaded = apply_factory_merges(loaded, factories)
    load_chunks_state(chunks, loaded, exclude=exclude)


class _SliceReader:
    """Fills megatron ShardedTensors (one rank's boxes of global tensors) from HF tensors."""

    def __init__(self, hf: HFCheckpoint, buffer_bytes: int):
        self.hf, self.arch = hf, hf.arch
        self.rules: dict[str, TensorRule] = {
            key: rule for rule in tensor_rules(self.arch) for key in (rule.ckpt_key, *rule.alt_ckpt_keys)
        }
        self.buffer_bytes = buffer_bytes
        self._buffer: torch.Tensor | None = None

    def fill(self, st: Any) -> None:
        arch, rule = self.arch, self.rules.get(st.key)
        if rule is None:
            raise CheckpointError(
                f"{self.hf.path}: the model's tensor {st.key} has no HF counterpart in a {arch.family}"
            )
        if st.flattened_range is not None:
            raise CheckpointError(f"{st.key}: flattened (distributed-optimizer) shards are not model weights")
        lead = len(rule.stacked_shape(arch)) - len(rule.shape)
        if st.prepend_axis_num != lead or len(st.global_shape) != lead + len(rule.shape):
            raise CheckpointError(
                f"{st.key}: the model's global shape {list(st.global_shape)} is not {list(rule.stacked_shape(arch))}"
            )
        stacked = iter(st.global_offset[:lead])
        layer = next(stacked) if rule.per_layer else None
        expert = next(stacked) if rule.per_expert else None
        global_shape, offset, data = tuple(st.global_shape[lead:]), tuple(st.global_offset[lead:]), st.data.detach()
        if global_shape != rule.shape and not (
            rule.tp == "vocab" and global_shape[0] >= rule.shape[0] and global_shape[1:] == rule.shape[1:]
        ):
            raise CheckpointError(f"{st.key}: the model's shape {list(global_shape)} is not {list(rule.shape)}")
        names = rule.hf(layer, expert)
        for name, shape in zip(names, hf_shapes(arch, rule)):
            self.hf.check(name, shape)
        first, count = offset[0], data.shape[0]
        inner = tuple(zip(offset[1:], data.shape[1:]))  # the box in the other dims
        if any(o + n > s for (o, n), s in zip(inner, rule.shape[1:])):
            raise CheckpointError(f"{st.key}: the model's box {offset} + {list(data.shape)} leaves {list(rule.shape)}")
        columns = None if all(o == 0 and n == s for (o, n), s in zip(inner, rule.shape[1:])) else inner
        if columns is not None and len(columns) != 1:
            raise CheckpointError(f"{st.key}: a box of {len(inner) + 1} dims is cut in more than rows")
        covered = 0
        for i, hf_row, row, rows in row_blocks(arch, rule):
            lo, hi = max(row, first), min(row + rows, first + count)
            if lo < hi:
                self._copy_rows(
                    names[i], hf_row + lo - row, hi - lo, columns and columns[0], data[lo - first : hi - first]
                )
                covered += hi - lo
        padding = first + count - max(first, rule.shape[0])
        if padding > 0:  # the padded vocabulary's rows: zeros, as megatron loads them
            data[count - padding :].zero_()
            covered += padding
        if covered != count:
            raise CheckpointError(f"{st.key}: the HF tensors cover {covered} of the model's {count} rows")

    def _copy_rows(self, name: str, first: int, count: int, columns: tuple[int, int] | None, out: torch.Tensor) -> None:
        """Copy rows of an HF tensor into a destination slice.

        Rows ``first:first+count`` of HF tensor ``name`` (only ``columns`` = (start, length) of
        dim 1 if given) into ``out``, casting to its dtype.
        """
        info = self.hf.info(name)
        if columns is None and out.device.type == "cpu" and out.dtype == info.dtype and out.is_contiguous():
            self.hf.read_rows_into(name, first, count, out)  # straight into the parameter
            return
        row_numel = math.prod(info.shape[1:])
        per_batch = max(1, self.buffer_bytes // max(1, row_numel * info.dtype.itemsize))
        for start in range(0, count, per_batch):
            n = min(per_batch, count - start)
            rows = self._rows_buffer(n * row_numel * info.dtype.itemsize).view(info.dtype).view(n, *info.shape[1:])
            self.hf.read_rows_into(name, first + start, n, rows)
            source = rows if columns is None else rows[:, columns[0] : columns[0] + columns[1]]
            out[start : start + n].copy_(source)

    def _rows_buffer(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, min(self.buffer_bytes, 1 << 20)), dtype=torch.uint8)
        return self._buffer[:nbytes]
