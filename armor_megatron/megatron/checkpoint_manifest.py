"""Per-file checksums of a checkpoint directory: written when a save completes, checked before a load.

``{checkpoint}/armor_manifest.json``::

    {"format": 1, "files": {"<relative path>": {"size": <bytes>, "xxh3_64": "<hex>"}, ...}}

Every regular file of the checkpoint but the manifest is listed. A file that is missing, has
another size (truncated, half-written) or another hash (corrupted) makes the checkpoint
*damaged*; `damaged_file` names the first such file in one line. Checkpoints without a
manifest (written before it existed, converter outputs) are taken as they are.

The work splits across ranks: file ``i`` (in sorted order) is hashed by rank ``i % world``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from armor_megatron.confined import inside
from armor_megatron.errors import UserInputError

MANIFEST_FILE = "armor_manifest.json"
_CHUNK = 8 << 20


class DamagedCheckpointError(UserInputError):
    """A checkpoint file does not match the manifest written with it, or cannot be read."""


@contextlib.contextmanager
def read_as_checkpoint(path: str) -> Iterator[None]:
    """Turn what reading a damaged checkpoint raises into one line naming it.

    Whatever reading the checkpoint at ``path`` raises (megatron's CheckpointingException, a
    truncated file's EOFError or zip error, a shape mismatch with the model) becomes one
    `DamagedCheckpointError` line naming ``path``; our own ValueErrors pass as they are.
    """
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        yield
    except ValueError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch and megatron raise many kinds
        ours = _input_error_within(e)
        if ours is not None:  # our own refusal, raised inside DCP, which wraps each rank's error
            raise ours from None
        reason = type(e).__name__ + (f": {str(e).strip().splitlines()[0]}" if str(e).strip() else "")
        raise DamagedCheckpointError(f"{path}: cannot be loaded ({reason})") from None


def _input_error_within(error: BaseException) -> ValueError | None:
    """The ValueError a DCP ``CheckpointException`` wraps ({rank: (exception, traceback)}), if any."""
    for failure in (getattr(error, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, ValueError):
            return inner
    return None


def list_files(path: str) -> list[str]:
    """Relative paths of the regular files under ``path``, sorted, the manifest excluded."""
    found = []
    for folder, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(folder, name), path)
            if rel != MANIFEST_FILE:
                found.append(rel)
    return sorted(found)


def file_digest(path: str) -> str:
    """The xxh3-64 hex digest of a file's bytes."""
    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(path: str, names: list[str], rank: int = 0, world: int = 1) -> dict[str, Any]:
    """{name: {"size", "xxh3_64"}} for this rank's share of ``names``."""
    share = {}
    for i, name in enumerate(names):
        if i % world == rank:
            full = os.path.join(path, name)
            share[name] = {"size": os.path.getsize(full), "xxh3_64": file_digest(full)}
    return share


def write_manifest(path: str, files: dict[str, Any]) -> None:
    """Write the manifest of ``path`` from the gathered `describe_files` results (durably)."""
    tmp = os.path.join(path, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST_FILE))


def read_manifest(path: str) -> dict[str, Any] | None:
    """The manifest's ``files`` table; None when the checkpoint has no manifest."""
    full = os.path.join(path, MANIFEST_FILE)
    if not os.path.exists(full):
        return None
    try:
        with open(full) as f:
            files: dict[str, Any] = json.load(f)["files"]
            return files
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpointError(f"{full}: unreadable checkpoint manifest ({type(e).__name__})") from None


def damaged_file(path: str, rank: int = 0, world: int = 1) -> str | None:
    """The first damaged file of this rank's share, or None.

    One line naming the first damaged file of this rank's share (sizes: every rank checks
    all of them, they are cheap), or None when the share is intact or there is no manifest.
    """
    try:
        files = read_manifest(path)
    except DamagedCheckpointError as e:
        return str(e)
    if files is None:
        return None
    for i, (name, want) in enumerate(sorted(files.items())):
        try:
            full = inside(path, name, os.path.join(path, MANIFEST_FILE))
        except UserInputError as e:
            return str(e)
        if not os.path.isfile(full):
            return f"{full}: missing (the checkpoint manifest lists it)"
        size = os.path.getsize(full)
        if size != want["size"]:
            return f"{full}: {size} bytes, the checkpoint manifest says {want['size']} (truncated or half-written)"
        if i % world == rank and file_digest(full) != want["xxh3_64"]:
            return f"{full}: checksum differs from the checkpoint manifest (corrupted)"
    return None
