"""Reading a torch_dist checkpoint from elsewhere without running its code.

torch.distributed.checkpoint (DCP) keeps a checkpoint's index in ``.metadata``, a pickle, and
its ``FileSystemReader`` reads it with plain ``pickle.load``; the objects a checkpoint stores
(Megatron's ``ShardedObject``: RNG states, ``_extra_state``) are read with
``torch.load(weights_only=False)``. Either would run whatever a crafted file asks. `SafeReader`
is a ``FileSystemReader`` that instead

* unpickles ``.metadata`` admitting only the classes DCP writes there (`METADATA_GLOBALS`: its
  metadata and plan dataclasses, ``torch.Size``, dtypes, layouts), and refuses anything else in one
  line naming the file and the global (`UnsafeCheckpointError`);
* keeps every data file ``.metadata`` names inside the checkpoint directory (`confined.inside`);
* unpickles stored objects with ``torch.load(weights_only=True)`` (plus numpy arrays, which RNG
  states hold) and hands DCP's planner a re-serialised copy of what that admitted.

Both the converter (`torch_dist.TorchDistReader`) and Megatron's loader
(`megatron.model_state.use_safe_checkpoint_reader`) read through it. It also reads ``.metadata``
once per reader (Megatron asks for it several times per load).
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, cast

import torch

from armor_megatron.confined import inside
from armor_megatron.convert.errors import CheckpointError

METADATA_FILE = ".metadata"

# (module, name) of every global DCP's FileSystemWriter pickles into .metadata (torch 2.13, with
# megatron-core 0.16.1's saves); torch's dtypes, layouts and memory formats are admitted by type.
METADATA_GLOBALS = frozenset(
    [("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")]
    + [("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")]  # StorageMeta.checkpoint_id
    + [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo")]
    + [
        ("torch.distributed.checkpoint.planner", name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
    ]
)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asks to load something other than checkpoint data (it could run code)."""


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only `METADATA_GLOBALS` and torch's dtype/layout/memory-format constants."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refers to {module}.{name}, which is not checkpoint metadata; "
            "refusing to load it (a crafted checkpoint could run code this way)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.path}: holds a persistent reference, which checkpoint metadata never does")


def read_metadata(ckpt_dir: str) -> Any:
    """``ckpt_dir/.metadata`` unpickled with `_MetadataUnpickler`, its data files confined to ``ckpt_dir``.

    Raises `UnsafeCheckpointError` for a global outside `METADATA_GLOBALS`, `PathEscapeError` for a
    data file outside ``ckpt_dir``, `CheckpointError` for a missing or unreadable file.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = os.path.join(ckpt_dir, METADATA_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt_dir}: unreadable checkpoint metadata (no {METADATA_FILE})")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or garbled pickle raises many kinds
        raise CheckpointError(f"{ckpt_dir}: unreadable checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
    for info in (metadata.storage_data or {}).values():
        inside(ckpt_dir, getattr(info, "relative_path", None), path)
    return metadata


def load_object(data: io.BytesIO, where: str) -> io.BytesIO:
    """A stored DCP object re-serialised after a ``weights_only`` load (numpy arrays admitted).

    ``where`` names the object for the one-line refusal of anything else.
    """
    import numpy as np

    reconstruct = np.ndarray(0).__reduce__()[0]  # numpy's array unpickler, wherever this numpy keeps it
    numpy_globals = [reconstruct, np.ndarray, np.dtype]
    numpy_globals += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.uint8)]
    try:
        with torch.serialization.safe_globals(numpy_globals):
            obj = torch.load(data, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        # torch's message: advice, then the line naming the global ("... unsupported GLOBAL posix.system ...")
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(e).__name__)
        raise UnsafeCheckpointError(f"{where}: refused to load a stored object ({reason})") from None
    copy = io.BytesIO()
    torch.save(obj, copy)
    copy.seek(0)
    return copy


def safe_reader_class() -> Any:
    """`SafeReader`, defined on first use (DCP is imported lazily)."""
    global _SAFE_READER
    if _SAFE_READER is None:
        from torch.distributed.checkpoint import FileSystemReader

        class SafeReader(FileSystemReader):
            """DCP's file-system reader with `read_metadata` and stored objects read safely (see module)."""

            def __init__(self, path: str | os.PathLike, *args, **kwargs):
                super().__init__(path, *args, **kwargs)
                self._metadata: Any = None

            def read_metadata(self, *args, **kwargs):
                if self._metadata is None:
                    from torch.distributed.checkpoint.metadata import StorageMeta

                    self._metadata = read_metadata(os.fspath(self.path))
                    if getattr(self._metadata, "storage_meta", None) is None:
                        self._metadata.storage_meta = StorageMeta()
                    self._metadata.storage_meta.load_id = self.load_id
                return self._metadata

            def read_data(self, plan, planner):
                return super().read_data(plan, cast(Any, _SafeBytesPlanner(planner, os.fspath(self.path))))

        _SAFE_READER = SafeReader
    return _SAFE_READER


_SAFE_READER: Any = None


class _SafeBytesPlanner:
    """A load planner's stand-in for the reader: `load_bytes` admits only what `load_object` does."""

    def __init__(self, planner, ckpt_dir: str):
        self._planner, self._ckpt_dir = planner, ckpt_dir

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        where = f"{self._ckpt_dir}: {read_item.storage_index.fqn}"
        self._planner.load_bytes(read_item, load_object(value, where))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)
