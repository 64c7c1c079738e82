"""Distributed training checkpoints (megatron ``dist_checkpointing``, torch_dist format).

Public interface (every rank calls every function)::

    path = save_checkpoint(root, step, actor, reference, extra, critic=None)   # -> "{root}/iter_{step:07d}"
    path = find_latest(root)                                      # the dir `latest` names, or None
    step, extra = load_checkpoint(path_or_root, actor, reference, load_optimizer=True, critic=None)
    removed = prune_checkpoints(root, keep_last)

Layout of ``{root}``::

    iter_0000100/            a complete checkpoint (torch_dist files + common.pt + metadata.json)
        trainer_state.pt     `extra` (small picklable trainer state), written by rank 0
    latest                   text: "iter_0000100", the newest complete checkpoint

What a checkpoint holds: the actor's model (keys exactly ``model.sharded_state_dict()``, no
prefix, so `load_model_weights` and the converter read it too), its optimizer state (Adam
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

Resharding: model weights (actor and reference) and the Adam moments load at any TP/PP/EP
layout (megatron stores every tensor at its global shape). RNG states are restored only when
the layout and world size are the ones saved (otherwise each rank keeps its seeded streams).
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from typing import Protocol

import torch
import torch.distributed as dist

from armor_megatron.megatron.model_state import (  # find_latest: part of this module's interface
    LATEST,
    find_latest,  # noqa: F401
    latest_name,
    resolve_checkpoint_dir,
)


class ModelState(Protocol):
    """What a checkpoint needs of a model without an optimizer (the reference)."""

    def sharded_state_dict(self) -> dict: ...

    def load_sharded_state_dict(self, loaded: dict) -> None: ...


class TrainableState(ModelState, Protocol):
    """What a checkpoint needs of a trained model (actor, critic: `trained_model.TrainedModel`):
    ``sharded_state_dict`` holds the optimizer only once it has state."""

    @property
    def has_optimizer_state(self) -> bool: ...

    def sharded_state_dict_to_load(self, load_optimizer: bool) -> dict: ...


EXTRA_FILE = "trainer_state.pt"


def checkpoint_name(step: int) -> str:
    return f"iter_{step:07d}"


# ----------------------------------------------------------------------------- save
def save_checkpoint(
    root: str,
    step: int,
    actor: TrainableState,
    reference: ModelState | None,
    extra: dict,
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
    dist_checkpointing.save(state, tmp)
    if dist.get_rank() == 0:
        torch.save(extra, os.path.join(tmp, EXTRA_FILE))
    dist.barrier()
    if dist.get_rank() == 0:
        _publish(tmp, os.path.join(root, name))
        _write_latest(root, name)
    dist.barrier()
    return os.path.join(root, name)


def _agreed_tmp_name(root: str, name: str) -> str:
    """Rank 0 checks the target and creates ``{name}.tmp-<uuid>``; every rank gets its name or its error."""
    message = [None]
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
    return message[0]


def _publish(tmp: str, final: str) -> None:
    """Rename the finished temporary directory into place (an unnamed leftover of the same step,
    from a save interrupted before `latest` was written, is replaced)."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f"{LATEST}.tmp-{uuid.uuid4().hex[:12]}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- find / prune
def adopt_as_latest(root: str, path: str) -> None:
    """Resuming from ``path``, an earlier checkpoint in ``root``: ``latest`` names it, so the
    run's own later saves replace the abandoned timeline's checkpoints of the same steps (and
    ``--resume auto`` after a crash comes back to this timeline). Every rank calls it."""
    root, path = os.path.abspath(root), os.path.abspath(path)
    if os.path.dirname(path) == root and latest_name(root) != os.path.basename(path):
        if not dist.is_initialized() or dist.get_rank() == 0:
            _write_latest(root, os.path.basename(path))
    if dist.is_initialized():
        dist.barrier()


def prune_checkpoints(root: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` ``iter_*`` checkpoints (never the one ``latest``
    names) and the leftovers of interrupted saves; returns the removed paths. Any rank may call
    it (in a distributed job only rank 0 deletes, the others return []); not while a save into
    `root` is running."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    latest = latest_name(root)
    complete = sorted(n for n in os.listdir(root) if n.startswith("iter_") and ".tmp-" not in n)
    doomed = [n for n in complete[:-keep_last] if n != latest]
    doomed += [n for n in os.listdir(root) if ".tmp-" in n]
    removed = []
    for n in doomed:
        path = os.path.join(root, n)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        removed.append(path)
    return removed


# ----------------------------------------------------------------------------- load
def load_checkpoint(
    path_or_root: str,
    actor: TrainableState,
    reference: ModelState | None,
    *,
    load_optimizer: bool = True,
    critic: TrainableState | None = None,
) -> tuple[int, dict]:
    """Restore `actor` (and `reference`, `critic`) from a checkpoint dir, or from the one
    ``latest`` names in a root. Returns (step, extra)."""
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint_dir(path_or_root)
    common = dist_checkpointing.load_common_state_dict(path)
    if reference is not None and not common["has_reference"]:
        raise ValueError(f"{path} holds no reference model; load it with reference=None and reset the reference")
    if critic is not None and not common.get("has_critic", False):
        raise ValueError(f"{path} holds no critic; start the critic from the actor's weights instead")
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
    extra = torch.load(os.path.join(path, EXTRA_FILE), weights_only=False)
    return int(common["step"]), extra


# ----------------------------------------------------------------------------- layout, RNG
def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return dict(
        world=dist.get_world_size(),
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
    )


def _rng_sharded_object():
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


def _set_rng_state(states: dict) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
