"""Where a LoRA actor's frozen base comes from, and a cheap check that it is still there, unchanged.

Until a reference reset merges adapters into it, a LoRA actor's base is exactly the weights it was
loaded from (``model.path`` or ``model.mcore_path``). Its training checkpoints then hold the
adapters, not the base, and record a `BaseSource`: the path and a fingerprint of the files the
loader reads. Resuming checks the fingerprint and loads the base from that path again.

Public interface::

    source = BaseSource.of(path)          # an HF directory, a torch_dist checkpoint or a checkpoint root
    source.problem()                      # None, or one line: the path is gone or its files changed
    state = source.to_state()             # plain data (a checkpoint's common state); BaseSource.from_state(state)
    value = on_rank_0(compute)            # compute() on rank 0 alone (the files are read once), its value on every rank

The fingerprint: for each file the loaders read (``*.safetensors``, torch_dist's ``*.distcp`` and the
small files describing them: ``config.json``, ``model.safetensors.index.json``, ``.metadata``,
``common.pt``, ``metadata.json``), its size and the xxh3-64 of its first and last MiB (the whole
file below 2 MiB; a safetensors file's head window also covers its whole header: names, dtypes,
shapes and offsets of its tensors). A file added, removed, replaced, truncated or rewritten by
another training run changes it, for about 2 MiB read per file instead of the whole model (140 GB
at 70B parameters in bf16). An edit confined to the middle of a file that keeps its size goes unseen.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

from armor_megatron.megatron.model_state import resolve_checkpoint_dir

_T = TypeVar("_T")
LORA_BASE = "lora_base"  # the key of a checkpoint's common state recording the base it left out
WINDOW = 1 << 20  # bytes hashed at each end of a file
_WEIGHT_SUFFIXES = (".safetensors", ".distcp")
_DESCRIBING = ("config.json", "model.safetensors.index.json", ".metadata", "common.pt", "metadata.json")


def _file_print(path: str) -> str:
    """``"<size>:<xxh3 of the head and tail windows>"`` of one file (module docstring)."""
    import xxhash

    size = os.path.getsize(path)
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        head = WINDOW
        if path.endswith(".safetensors") and size >= 8:
            head = max(head, 8 + int.from_bytes(f.read(8), "little"))  # the 8-byte length, then the JSON header
            f.seek(0)
        if size <= head + WINDOW:
            digest.update(f.read())
        else:
            digest.update(f.read(head))
            f.seek(size - WINDOW)
            digest.update(f.read(WINDOW))
    return f"{size}:{digest.hexdigest()}"


def fingerprint(directory: str) -> dict[str, str]:
    """{file name: "<size>:<hash>"} of the weight files of ``directory`` and those describing them."""
    names = sorted(os.listdir(directory))
    chosen = [n for n in names if n.endswith(_WEIGHT_SUFFIXES) or n in _DESCRIBING]
    return {n: _file_print(os.path.join(directory, n)) for n in chosen if os.path.isfile(os.path.join(directory, n))}


def _weights_dir(path: str) -> str:
    """The directory whose files are the weights: ``path`` itself (HF, torch_dist) or the one a root's ``latest`` names."""
    from armor_megatron.megatron.hf_weights import is_hf_dir

    return path if is_hf_dir(path) else resolve_checkpoint_dir(path)


@dataclasses.dataclass(frozen=True)
class BaseSource:
    """The weights a LoRA actor's base was loaded from: ``path`` as given, the ``directory`` read, its ``files``' prints."""

    path: str
    directory: str
    files: dict[str, str]

    @classmethod
    def of(cls, path: str) -> BaseSource:
        """Fingerprint the weights at ``path`` (an HF directory, a torch_dist checkpoint or a root with ``latest``)."""
        path = os.path.abspath(path)
        directory = _weights_dir(path)
        return cls(path, directory, fingerprint(directory))

    def problem(self) -> str | None:
        """None when ``path`` still holds these weights; else one line saying what is gone or changed."""
        if not os.path.exists(self.path):
            return f"{self.path} is gone"
        try:
            now = BaseSource.of(self.path)
        except (OSError, ValueError) as e:
            return (
                f"{self.path} cannot be read ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})"
            )
        if now.directory != self.directory:
            return f"{self.path} now names {now.directory}, not {self.directory}"
        for name in sorted(self.files.keys() | now.files.keys()):
            before, after = self.files.get(name), now.files.get(name)
            if before != after:
                what = "is new" if before is None else "is gone" if after is None else "changed"
                return f"{os.path.join(self.directory, name)} {what} since the checkpoint was written"
        return None

    def to_state(self) -> dict[str, Any]:
        """Plain data for a checkpoint's common state."""
        return {"path": self.path, "directory": self.directory, "files": dict(self.files)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> BaseSource:
        """The `BaseSource` that `to_state` wrote."""
        return cls(str(state["path"]), str(state["directory"]), {str(k): str(v) for k, v in state["files"].items()})


def on_rank_0(compute: Callable[[], _T]) -> _T:
    """``compute()`` run on rank 0 alone, its value (or what it raised) on every rank. Every rank calls it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return compute()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = (compute(), None)
        except Exception as e:  # noqa: BLE001 - raised on every rank below, so that none waits for the others
            box[0] = (None, e)
    dist.broadcast_object_list(box, src=0)
    value, error = box[0]
    if error is not None:
        raise error
    result: _T = value
    return result
