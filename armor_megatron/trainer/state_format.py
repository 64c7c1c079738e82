"""The format of the trainer state a checkpoint stores (``trainer_state.pt``), versioned.

The loop's state (`loop.ArmorTrainer.trainer_state`) carries ``format_version``; a checkpoint
written before the field existed is version 1. `migrated` brings an older state to the current
version, one step at a time, and refuses, in one line, a state newer than this code reads (a
checkpoint written by a newer release).

Versions:

1. no ``format_version``; ``step``, ``loader``, ``monitor``, ``ref_resets`` and
   ``last_train_accuracy`` always there; ``reset_schedule``, ``anchor_cache``,
   ``pending_batch`` and ``step_record`` only in checkpoints written once they existed.
2. ``format_version``, and every key present (None where there is nothing to restore).
3. ``partial_rollouts``: ``rollout.partial``'s generator state (buffered responses, groups in
   progress), the rows drawn and not yet requested, the groups named so far; None when off.
4. partial rollouts with anchors: each group in progress holds its anchor lookup, the
   reference version it was made under and the generator call that started it (``anchor``,
   ``reference``, ``started``; the generator counts its ``calls``), and ``partial_rollouts``
   holds the lookups made for rows drawn and not yet requested (``anchors``).

A change to the state's keys or their meaning is a new version here and a migration from the one
before, with a checkpoint of the previous version under ``tests/trainer/data/`` that a test resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from armor_megatron.errors import UserInputError

FORMAT_VERSION = 4
KEY = "format_version"


class TrainerStateVersionError(UserInputError):
    """A checkpoint's trainer state is of a format this code cannot read."""


def _v1_to_v2(state: dict[str, Any]) -> dict[str, Any]:
    """Version 1 -> 2: the optional keys present (None: nothing to restore)."""
    optional = ("reset_schedule", "anchor_cache", "pending_batch", "step_record")
    return {**{key: None for key in optional}, **state}


def _v2_to_v3(state: dict[str, Any]) -> dict[str, Any]:
    """Version 2 -> 3: no partial rollouts in progress."""
    return {"partial_rollouts": None, **state}


def _v3_to_v4(state: dict[str, Any]) -> dict[str, Any]:
    """Version 3 -> 4: partial rollouts ran without anchors (anchors were refused with them)."""
    partial = state.get("partial_rollouts")
    if partial is None:
        return state
    generator = partial["generator"]
    if generator is not None:
        groups = [{**g, "anchor": None, "reference": None, "started": 0} for g in generator["groups"]]
        generator = {**generator, "calls": 0, "groups": groups}  # its groups count as started one step ago
    return {**state, "partial_rollouts": {**partial, "generator": generator, "anchors": []}}


# version n -> the function that turns a version-n state into a version n+1 state
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4}


def versioned(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the current ``format_version``."""
    return {KEY: FORMAT_VERSION, **state}


def migrated(state: dict[str, Any], source: str = "the checkpoint") -> dict[str, Any]:
    """``state`` of any version this code reads, brought to `FORMAT_VERSION` (``format_version`` included).

    ``source`` names where the state comes from in the error of an unreadable version.
    """
    version = state.get(KEY, 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TrainerStateVersionError(f"{source}: trainer state format_version {version!r} is not a version")
    if version > FORMAT_VERSION:
        raise TrainerStateVersionError(
            f"{source}: trainer state format_version {version} is newer than this armor_megatron reads "
            f"(up to {FORMAT_VERSION}); resume it with the release that wrote it"
        )
    state = {k: v for k, v in state.items() if k != KEY}
    for v in range(version, FORMAT_VERSION):
        state = MIGRATIONS[v](state)
    return versioned(state)
