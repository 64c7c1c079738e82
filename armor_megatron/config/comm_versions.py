"""One torch and one NCCL on both sides of a weight sync: ask each interpreter, refuse a mix.

``rollout.sglang.weight_sync: distributed`` puts the trainer's sender and every engine TP rank in
one NCCL communicator, and NCCL refuses ranks that run different versions ("Mismatched NCCL
version detected", ``ncclInvalidUsage``, at the first collective). ``tensor`` pickles CUDA IPC
handles with the trainer's torch and rebuilds them with the servers' torch, a pair only one torch
release is known to read. ``disk`` shares files only. When ``rollout.sglang.python`` names another
interpreter than the trainer's, `sync_problem` asks it, in one subprocess that needs no GPU (the
installed wheels' versions: ``torch``, ``nvidia-nccl-cu<N>``), and compares with this one.
``armor-train --check`` and the start of every job run it (`armor_megatron.config.needs`).

A torch built without the NCCL wheel (a container's own build) reports no NCCL version; the check
then names what it could not compare only when the other side has a version, as a mismatch cannot
be ruled out. The locks in ``tools/envs`` share the exact torch and NCCL wheel by construction
(``tools/check_envs.py`` fails when they do not).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from typing import Any

PROBE_TIMEOUT_S = 60.0
FIX = "install the same torch (and so its nvidia-nccl wheel) in both environments: tools/envs/*.lock share them"

# Run by the probed interpreter (``python -c``) and by this one (exec): the installed wheels'
# versions, read from their metadata; nothing is imported, so no CUDA is needed.
_PROBE = """
import importlib.metadata as _md


def _comm_versions():
    found = {"torch": None, "nccl": None}
    for dist in _md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == "torch":
            found["torch"] = dist.version
        elif name.startswith("nvidia-nccl-cu"):
            found["nccl"] = dist.version
    return found
"""


@dataclasses.dataclass(frozen=True)
class CommVersions:
    """The torch and NCCL wheel versions an interpreter has (None: not installed as a wheel)."""

    torch: str | None
    nccl: str | None


class ProbeError(RuntimeError):
    """The interpreter could not be asked (missing, not executable, no answer); the message says why."""


def local_versions() -> CommVersions:
    """This interpreter's versions."""
    namespace: dict[str, Any] = {}
    exec(_PROBE, namespace)  # noqa: S102 - our own constant, shared with the subprocess
    return CommVersions(**namespace["_comm_versions"]())


def interpreter_versions(python: str, timeout: float = PROBE_TIMEOUT_S) -> CommVersions:
    """The versions of interpreter ``python`` (a path or a name on PATH), asked in one subprocess."""
    exe = shutil.which(python) if os.sep not in python else python
    if exe is None or not os.access(exe, os.X_OK):
        raise ProbeError(f"{python}: no such interpreter")
    code = _PROBE + "\nimport json\nprint(json.dumps(_comm_versions()))\n"
    try:
        done = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ProbeError(f"{python}: {err}") from None
    lines = done.stdout.strip().splitlines()
    try:
        if done.returncode != 0 or not lines:
            raise ValueError("no answer")
        found = json.loads(lines[-1])
        return CommVersions(torch=found["torch"], nccl=found["nccl"])
    except (ValueError, TypeError, KeyError):
        tail = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise ProbeError(
            f"{python} could not tell its torch and NCCL versions (exit {done.returncode}: {tail})"
        ) from None


def sync_problem(mode: str, trainer: CommVersions, engines: CommVersions, engine_python: str) -> str | None:
    """One line when weight-sync ``mode`` would span two versions, naming both and the fix; else None."""
    if mode == "distributed":
        what, mine, theirs = "NCCL", trainer.nccl, engines.nccl
        why = "one NCCL communicator holds trainer and engine ranks, and NCCL refuses mixed versions"
    elif mode == "tensor":
        what, mine, theirs = "torch", trainer.torch, engines.torch
        why = "CUDA IPC handles pickled by one torch are rebuilt by the other"
    else:
        return None
    if mine == theirs or (mine is None and theirs is None):
        return None
    return (
        f"weight_sync {mode}: the trainer has {what} {mine or 'unknown (no wheel)'}, the engines' "
        f"{engine_python} has {what} {theirs or 'unknown (no wheel)'} ({why}); {FIX}, or use weight_sync disk"
    )
