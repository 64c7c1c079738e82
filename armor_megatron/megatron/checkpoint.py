"""Distributed training checkpoints (megatron ``dist_checkpointing``, torch_dist format).

Public interface (every rank calls every function)::

    path = save_checkpoint(root, step, actor, reference, extra, critic=None)   # -> "{root}/iter_{step:07d}"
    path = find_latest(root)                                      # newest intact checkpoint, or None
    verify_checkpoint(path)                                       # DamagedCheckpointError naming the bad file
    step, extra = load_checkpoint(path_or_root, actor, reference, load_optimizer=True, critic=None)
    removed = prune_checkpoints(root, keep_last)

Layout of ``{root}``::

    iter_0000100/            a complete checkpoint (torch_dist files + common.pt + metadata.json)
        trainer_state.pt     `extra` (trainer state: containers of str/int/float/bool/None and
                             tensors; loaded with ``weights_only=True``)
        armor_manifest.json  size and xxh3 checksum of every other file (`checkpoint_manifest`)
    latest                   text: "iter_0000100", the newest complete checkpoint
    latest_checkpointed_iteration.txt   text: "100", megatron's own tracker, for megatron's tools

What a checkpoint holds: the actor's model (keys exactly ``model.sharded_state_dict()``, no
prefix, so `load_model_weights` and the converter read it too; a LoRA actor whose base no reset has
merged into yet saves its adapters alone and records where the base comes from under ``lora_base``,
`base_source.BaseSource`, which loading checks and reads the base from), its optimizer state (Adam
moments sharded like the weights; none before the first update), LR schedule, stability guard, the reference model under
keys prefixed ``reference.``, the PPO critic when there is one (model keys prefixed ``critic.``,
its own optimizer, LR schedule and guard under ``critic``), the RNG states of every rank (python, numpy, torch, CUDA and
megatron's model-parallel tracker), the step and the parallel layout.

Atomicity: every rank writes into ``{root}/iter_{step:07d}.tmp-<uuid>``; when all are done
rank 0 renames it to ``iter_{step:07d}`` and only then replaces ``latest`` (write a temporary
file, fsync, ``os.replace``). A crash at any point leaves the previous ``latest`` naming a
complete checkpoint: before the rename the new one is only a ``.tmp-`` directory; between
rename and ``latest`` it is complete but unnamed (a later save of the same step replaces it).
Saving over the checkpoint ``latest`` names is refused.

Checkpoints from elsewhere run no code: ``.metadata`` is unpickled admitting only DCP's metadata
classes, stored objects (RNG states) and ``trainer_state.pt`` with ``torch.load(weights_only=True)``,
``common.pt`` by megatron with torch's default ``weights_only=True``; every file a checkpoint names
stays inside it (`model_state.use_safe_checkpoint_reader`, `convert.dcp_safety`). The manifest
detects damage, not tampering: whoever wrote the files can rewrite it.

Damage: `load_checkpoint` checks every file against the manifest first and names the first bad
one in a `DamagedCheckpointError` (one line). `find_latest` (what ``--resume auto`` uses) skips a
damaged ``latest`` for the newest intact ``iter_*`` and removes the ``.tmp-`` leftovers of
interrupted saves.

Preemption signals: SIGTERM/SIGUSR1 are held (blocked) in the saving thread while megatron
starts its writer processes, which inherit the mask and so survive a signal sent to the whole
process group; the rank receives a held signal as soon as the save returns.

Resharding: model weights (actor and reference) and the Adam moments load at any TP/PP/EP
layout (megatron stores every tensor at its global shape). RNG states are restored only when
the layout and world size are the ones saved (otherwise each rank keeps its seeded streams).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from armor_megatron.errors import UserInputError
from armor_megatron.megatron import model_state
from armor_megatron.megatron.base_source import LORA_BASE
from armor_megatron.megatron.checkpoint_manifest import (
    DamagedCheckpointError,
    damaged_file,
    describe_files,
    list_files,
    read_as_checkpoint,
    write_manifest,
)
from armor_megatron.megatron.model_state import (
    LATEST,
    latest_name,
    resolve_checkpoint_dir,
    use_safe_checkpoint_reader,
)

_T = TypeVar("_T")
TRACKER = "latest_checkpointed_iteration.txt"  # megatron's name for `latest` (it holds the step)
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ModelState(Protocol):
    """What a checkpoint needs of a model without an optimizer (the reference)."""

    def sharded_state_dict(self) -> dict[str, Any]:
        """The state to save, as a sharded state dict."""

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """Restore from what ``dist_checkpointing.load`` returned for :meth:`sharded_state_dict_to_load`."""


class TrainableState(ModelState, Protocol):
    """What a checkpoint needs of a trained model (actor, critic: `trained_model.TrainedModel`).

    ``sharded_state_dict`` holds the optimizer only once it has state.
    """

    @property
    def has_optimizer_state(self) -> bool:
        """Whether the optimizer holds state yet (it is saved only then)."""

    def sharded_state_dict_to_load(self, load_optimizer: bool) -> dict[str, Any]:
        """The sharded state dict to load into; with or without the optimizer."""

    def restore_base(self, checkpoint: str, saved: dict[str, Any] | None) -> None:
        """Before the load: read the base from where ``saved`` (a checkpoint's ``lora_base``) says, when the checkpoint left it out."""


EXTRA_FILE = "trainer_state.pt"


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint at ``step``: ``iter_0000042``."""
    return f"iter_{step:07d}"


# ----------------------------------------------------------------------------- save
def save_checkpoint(
    root: str,
    step: int,
    actor: TrainableState,
    reference: ModelState | None,
    extra: dict[str, Any],
    *,
    critic: TrainableState | None = None,
) -> str:
    """Write a checkpoint of step `step` atomically (see module docstring); returns its path."""
    from megatron.core import dist_checkpointing

    name = checkpoint_name(step)
    tmp = os.path.join(root, _agreed_tmp_name(root, name))
    state = actor.sharded_state_dict()
    if reference is not None:
        state["reference"] = reference.sharded_state_dict()
    if critic is not None:
        state["critic"] = critic.sharded_state_dict()
    state.update(
        step=step,
        layout=_layout(),
        has_reference=reference is not None,
        has_optimizer="optimizer" in state,
        has_critic=critic is not None,
        critic_has_optimizer=critic is not None and critic.has_optimizer_state,
        rng=_rng_sharded_object(),
    )
    try:
        with preemption_signals_held():
            dist_checkpointing.save(state, tmp)
        _on_rank_0(lambda: torch.save(extra, os.path.join(tmp, EXTRA_FILE)))
        manifest = _agreed_manifest(tmp)
        _on_rank_0(lambda: _finish(tmp, root, name, manifest))
    except (Exception, CheckpointException) as e:
        reason = _space_problem(e)
        if reason is None:
            raise
        if dist.get_rank() == 0:  # frees what the save took; nothing names it (`latest` is never `name`)
            shutil.rmtree(tmp, ignore_errors=True)
            if latest_name(root) != name:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)  # renamed, `latest` not yet moved
        raise CheckpointSpaceError(_space_message(root, step, reason)) from None
    return os.path.join(root, name)


class CheckpointSpaceError(UserInputError):
    """A checkpoint could not be written for lack of space (a full disk, a quota, a file-size limit)."""


_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _space_problem(error: BaseException) -> str | None:
    """What says the disk is full in ``error``, its causes or the errors it wraps; None if nothing does.

    megatron's writer processes report an ``OSError`` as text (``Worker failure: [Errno 28] ...``),
    inside DCP's ``CheckpointException``; torch's archive writer turns a short write into ``unexpected
    pos``.
    """
    pending: list[BaseException | None] = [error]
    seen = set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _SPACE_ERRNOS:
            return os.strerror(e.errno)
        text = str(e)
        for code in _SPACE_ERRNOS:
            if f"[Errno {code}]" in text:
                return os.strerror(code)
        if "unexpected pos" in text:
            return "a write came up short"
        failures = getattr(e, "failures", None)
        inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else []
        pending += [e.__cause__, e.__context__, *inner]
    return None


def _space_message(root: str, step: int, reason: str) -> str:
    """The one line for a save that ran out of space, saying what is left (checked, not assumed)."""
    latest = latest_name(root)
    if latest and os.path.isfile(os.path.join(root, latest, "metadata.json")):
        kept = f"the previous checkpoint {os.path.join(root, latest)} is intact and `{LATEST}` still names it"
    else:
        kept = "there is no earlier checkpoint"
    return f"checkpoint of step {step} not written: no space left on {root} ({reason}); the partial save was removed; {kept}"


def _on_rank_0(fn: Callable[[], object]) -> None:
    """Run ``fn`` on rank 0; every rank returns when it did, or raises when it failed (no rank waits forever)."""
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - handed to every rank, re-raised here as it was
            error = e
    box: list[Any] = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise RuntimeError(f"rank 0 failed to write the checkpoint: {box[0]}")


def _finish(tmp: str, root: str, name: str, manifest: dict[str, Any]) -> None:
    """Rank 0: write the manifest, rename the checkpoint into place, point `latest` at it."""
    write_manifest(tmp, manifest)
    _publish(tmp, os.path.join(root, name))
    _write_latest(root, name)


@contextlib.contextmanager
def preemption_signals_held() -> Iterator[None]:
    """Block SIGTERM/SIGUSR1 in this thread.

    Processes started meanwhile inherit the mask (across exec too) and never see them; this process
    gets a held signal when the block ends.

    multiprocessing's resource tracker unblocks the signals after starting itself, so it is
    started first. megatron's long-lived writer-results server is started inside the block
    (`_start_writer_results_server`): it holds the signals from its first instruction on.
    """
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, PREEMPTION_SIGNALS)
    try:
        _start_writer_results_server()
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_writer_results_server = None  # keeps the Manager (and so its process) alive with this process


def _start_writer_results_server() -> None:
    """Start the server of megatron's checkpoint-writer results queue ourselves, once.

    megatron's async writer reports through ``filesystem_async._results_queue``, served by a
    ``multiprocessing`` Manager process it starts on the first save and keeps for the life of
    the trainer. Started by megatron inside `preemption_signals_held`, that process ignores
    SIGTERM/SIGUSR1 forever and, holding the job's stdout/stderr, outlives a trainer that was
    killed, keeping whatever reads the job's output waiting. Started here (also inside the
    block: it is born holding the signals, so a SIGTERM to the process group during a save,
    even while it starts, leaves it serving the save), it is killed when the trainer dies
    (``PR_SET_PDEATHSIG``) and its stdio is ``/dev/null``.
    """
    global _writer_results_server
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    server = SyncManager(ctx=multiprocessing.get_context("spawn"))
    server.start(_serve_only_for, (os.getpid(),))
    filesystem_async._results_queue = server.Queue()
    _writer_results_server = server


def _serve_only_for(parent: int) -> None:
    """Initializer of the writer-results server process (see `_start_writer_results_server`)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the trainer died before the line above took effect
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)


def _agreed_manifest(path: str) -> dict[str, Any]:
    """Every rank hashes its share of the files; the whole manifest table, on every rank."""
    names = list_files(path) if dist.get_rank() == 0 else None
    names = _broadcast(names)
    share = describe_files(path, names, dist.get_rank(), dist.get_world_size())
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, share)
    return {k: v for s in shares for k, v in s.items()}


def _broadcast(obj: _T | None) -> _T:
    """Rank 0's ``obj`` on every rank (what the other ranks pass, None, is ignored)."""
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=0)
    received: _T = box[0]
    return received


def _agreed_tmp_name(root: str, name: str) -> str:
    """Rank 0 checks the target and creates ``{name}.tmp-<uuid>``; every rank gets its name or its error."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            if latest_name(root) == name:
                raise FileExistsError(
                    f"{os.path.join(root, name)} is the checkpoint `latest` names; refusing to overwrite it"
                )
            message[0] = f"{name}.tmp-{uuid.uuid4().hex[:12]}"
            os.makedirs(os.path.join(root, message[0]))
        except OSError as e:
            message[0] = e
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], Exception):
        raise message[0]
    return str(message[0])


def _publish(tmp: str, final: str) -> None:
    """Rename the finished temporary checkpoint directory into place.

    An unnamed leftover of the same step (a save interrupted before `latest` was written) is
    replaced.
    """
    _VERIFIED.discard(os.path.abspath(final))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def _write_latest(root: str, name: str) -> None:
    """``latest`` names the checkpoint; megatron's tracker, written first, holds its step."""
    _replace_text(root, TRACKER, str(int(name.removeprefix("iter_"))))
    _replace_text(root, LATEST, name)
    _fsync_dir(root)


def _replace_text(root: str, filename: str, text: str) -> None:
    tmp = os.path.join(root, f"{filename}.tmp-{uuid.uuid4().hex[:12]}")
    with open(tmp, "w") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, filename))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- find / verify / prune
def find_latest(root: str) -> str | None:
    """The checkpoint to resume from in ``root``.

    The one ``latest`` names when it is intact, else the newest intact ``iter_*`` (each damaged one
    skipped with a one-line warning); None when ``root`` has neither a ``latest`` nor a complete
    ``iter_*`` (a fresh run). A missing, empty or garbled ``latest`` beside complete checkpoints (a
    save that died between publishing and naming its checkpoint, a damaged file) is warned about,
    never taken for a fresh start that would overwrite them. Removes the leftovers of interrupted
    saves first. Every rank of a job calls it (the checks are split between them).
    """
    has_latest = latest_name(root) is not None
    complete = (
        sorted((n for n in os.listdir(root) if _is_complete_name(n)), reverse=True) if os.path.isdir(root) else []
    )
    if not has_latest and not complete:
        return None
    if not dist.is_initialized() or dist.get_rank() == 0:
        remove_save_leftovers(root)
    if dist.is_initialized():
        dist.barrier()
    candidates: list[str] = []
    if has_latest:
        try:
            latest = model_state.find_latest(root)
            candidates = [] if latest is None else [latest]
        except FileNotFoundError as e:
            _warn(str(e))
    else:
        _warn(f"{root} has checkpoints but no `{LATEST}` file; resuming from its newest intact one")
    candidates += [os.path.join(root, n) for n in complete if os.path.join(root, n) not in candidates]
    for path in candidates:
        problem = agreed_damage(path)
        if problem is None:
            _VERIFIED.add(os.path.abspath(path))
            return path
        _warn(f"skipping a damaged checkpoint: {problem}")
    raise DamagedCheckpointError(f"{root}: every checkpoint is damaged (see the lines above)")


def verify_checkpoint(path: str) -> None:
    """Check a checkpoint against its manifest on every rank.

    Raise `DamagedCheckpointError` naming the first file of ``path`` that does not match its
    manifest (all ranks agree on the answer; each hashes a share of the files).
    """
    if os.path.abspath(path) in _VERIFIED:
        return
    problem = agreed_damage(path)
    if problem is not None:
        raise DamagedCheckpointError(problem)


_VERIFIED: set[str] = set()  # checkpoints this process found intact (find_latest, then load: hash once)


def agreed_damage(path: str) -> str | None:
    """The first damaged file any rank finds in ``path``, the same line on every rank; None when intact."""
    if not dist.is_initialized():
        return damaged_file(path)
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, damaged_file(path, dist.get_rank(), dist.get_world_size()))
    return next((p for p in problems if p is not None), None)


def remove_save_leftovers(root: str) -> list[str]:
    """Delete the ``*.tmp-*`` folders and files interrupted saves left in ``root``."""
    removed = []
    for n in os.listdir(root):
        if ".tmp-" in n:
            path = os.path.join(root, n)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            removed.append(path)
    return removed


def _is_complete_name(name: str) -> bool:
    return name.startswith("iter_") and ".tmp-" not in name


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[armor] warning: {message}", file=sys.stderr, flush=True)


def adopt_as_latest(root: str, path: str) -> None:
    """Resuming from ``path``, an earlier checkpoint in ``root``.

    ``latest`` names it, so the run's own later saves replace the abandoned timeline's checkpoints
    of the same steps (and ``--resume auto`` after a crash comes back to this timeline). Every rank
    calls it.
    """
    root, path = os.path.abspath(root), os.path.abspath(path)
    if os.path.dirname(path) == root and latest_name(root) != os.path.basename(path):
        if not dist.is_initialized() or dist.get_rank() == 0:
            _write_latest(root, os.path.basename(path))
    if dist.is_initialized():
        dist.barrier()


def prune_checkpoints(root: str, keep_last: int) -> list[str]:
    """Delete old ``iter_*`` checkpoints, keeping the newest ``keep_last``.

    Delete all but the newest `keep_last` ``iter_*`` checkpoints (never the one ``latest``
    names) and the leftovers of interrupted saves; returns the removed paths. Any rank may call
    it (in a distributed job only rank 0 deletes, the others return []); not while a save into
    `root` is running.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    latest = latest_name(root)
    complete = sorted(n for n in os.listdir(root) if _is_complete_name(n))
    removed = []
    for n in complete[:-keep_last]:
        if n != latest:
            shutil.rmtree(os.path.join(root, n))
            removed.append(os.path.join(root, n))
    return removed + remove_save_leftovers(root)


# ----------------------------------------------------------------------------- load
def load_checkpoint(
    path_or_root: str,
    actor: TrainableState,
    reference: ModelState | None,
    *,
    load_optimizer: bool = True,
    critic: TrainableState | None = None,
) -> tuple[int, dict[str, Any]]:
    """Restore `actor` (and `reference`, `critic`) from a checkpoint dir, or from the one ``latest`` names in a root.

    Returns (step, extra).
    """
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint_dir(path_or_root)
    verify_checkpoint(path)
    with read_as_checkpoint(path):
        common = dist_checkpointing.load_common_state_dict(path)
    if reference is not None and not common["has_reference"]:
        raise UserInputError(f"{path} holds no reference model; load it with reference=None and reset the reference")
    if critic is not None and not common.get("has_critic", False):
        raise UserInputError(f"{path} holds no critic; start the critic from the actor's weights instead")
    actor.restore_base(path, common.get(LORA_BASE))  # a LoRA checkpoint before the first reset holds no base
    # each model's Adam moments exist only once it has taken an update
    load_critic_optimizer = critic is not None and load_optimizer and common["critic_has_optimizer"]
    load_optimizer = load_optimizer and common["has_optimizer"]
    state = actor.sharded_state_dict_to_load(load_optimizer)
    if reference is not None:
        state["reference"] = reference.sharded_state_dict()
    if critic is not None:
        state["critic"] = critic.sharded_state_dict_to_load(load_critic_optimizer)
    same_layout = common["layout"] == _layout()
    if same_layout:
        state["rng"] = _rng_sharded_object()
    use_safe_checkpoint_reader(path)
    with read_as_checkpoint(path):
        loaded = dist_checkpointing.load(state, path)
    if not load_optimizer:
        loaded.pop("optimizer", None)
    actor.load_sharded_state_dict(loaded)
    if reference is not None:
        reference.load_sharded_state_dict(loaded["reference"])
    if critic is not None:
        if not load_critic_optimizer:
            loaded["critic"].pop("optimizer", None)
        critic.load_sharded_state_dict(loaded["critic"])
    if same_layout:
        _set_rng_state(loaded["rng"])
    return int(common["step"]), load_trainer_state(path)


def load_trainer_state(path: str) -> dict[str, Any]:
    """``trainer_state.pt`` of a checkpoint, unpickled with ``weights_only=True``.

    Only containers, numbers, strings and tensors come back: this file cannot run code (the rest
    of the checkpoint is read as safely: see the module docstring).
    """
    full = os.path.join(path, EXTRA_FILE)
    try:
        state: dict[str, Any] = torch.load(full, weights_only=True)
        return state
    except Exception as e:  # noqa: BLE001 - the unpickler raises many kinds; the line names the file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DamagedCheckpointError(f"{full}: cannot be loaded safely ({reason})") from None


# ----------------------------------------------------------------------------- layout, RNG
def _layout() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return dict(
        world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
    )


def _rng_sharded_object() -> Any:
    """This rank's RNG states as entry `rank` of a world-sized sharded object."""
    import numpy as np
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    states = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return ShardedObject("rng_state", states, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _set_rng_state(states: dict[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
