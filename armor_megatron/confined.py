"""Paths that files from elsewhere name, kept inside the directory that holds them.

An HF index names its shards, a torch_dist checkpoint's ``.metadata`` names its data files, a
checkpoint manifest names the files it checks: each is a path relative to its directory, written
by whoever made the directory. `inside` resolves such a name (symbolic links included) and refuses
one that leaves the directory (``../x``, ``/etc/passwd``, a link pointing out), so a model or
checkpoint from elsewhere cannot make the project read, hash or train on an unrelated file. (The
one place links legitimately point out, the Hugging Face hub cache's snapshot folders linking to
their repository's ``blobs/``, is admitted.)
"""

from __future__ import annotations

import os

from armor_megatron.errors import UserInputError


class PathEscapeError(UserInputError):
    """A file names a path outside its own directory."""


def inside(directory: str | os.PathLike, name: object, named_by: str) -> str:
    """``directory/name`` when it stays inside ``directory`` after resolving links; else `PathEscapeError`.

    Args:
        directory: the directory the name is relative to (a model or checkpoint directory).
        name: the relative path as the file wrote it.
        named_by: the file that names it (for the message), e.g. ``.../model.safetensors.index.json``.

    Returns:
        ``os.path.join(directory, name)`` (unresolved: messages keep the user's spelling).
    """
    if not isinstance(name, str) or not name or "\0" in name:
        raise PathEscapeError(f"{named_by}: names {name!r}, not a file name")
    joined = os.path.join(directory, name)  # an absolute name replaces the directory: caught below
    target = os.path.realpath(joined)
    if os.path.isabs(name) or not any(os.path.commonpath([r, target]) == r for r in _roots(directory)):
        raise PathEscapeError(f"{named_by}: names {name!r}, which lies outside {directory}; refusing to read it")
    return joined


def _roots(directory: str | os.PathLike) -> list[str]:
    """Where files of ``directory`` may resolve to: itself and, for a hub cache snapshot, its blobs.

    The Hugging Face hub cache keeps a model as ``models--org--name/snapshots/<revision>/`` whose
    files are links to ``models--org--name/blobs/<hash>``.
    """
    roots = [os.path.realpath(directory)]
    snapshots = os.path.dirname(os.path.abspath(directory))
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(repo).startswith("models--"):
        roots.append(os.path.realpath(os.path.join(repo, "blobs")))
    return roots
