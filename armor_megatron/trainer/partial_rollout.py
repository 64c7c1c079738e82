"""Partial rollouts' wiring (``rollout.partial``): the generator across steps, the rows it draws, its state.

A step's groups come from the partial generator (`rollout.partial_generation`): the responses
the last step left unfinished are continued first; new groups come from the loader,
``ceil(P · over_provision)`` in flight; with dynamic sampling each group is scored as it
completes and kept when its accuracies differ (at most ``P · over_provision · (1 +
max_oversample_rounds)`` new groups per step, as many as the rounds would draw); once P are kept
the rest are aborted and buffered. The kept groups are then scored (once) and assembled by
`collect_groups`, their per-token versions checked. With anchors, the groups' anchors are looked
up first, before any on-policy request, and those a reset made stale are replaced
(`trainer.partial_anchors`).

`PartialRollouts` keeps, for the checkpoint, the generator's state, the rows drawn from the
loader and not yet requested, a running count naming each group (``"<row>:<draw>"``) and the
anchors held for the head of that queue.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from armor_megatron.algo.dynamic_sampling import dynamic_sampling_keep
from armor_megatron.config.schema import RunConfig
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.data.prompts import PromptLoader, PromptRow
from armor_megatron.rewards.isolated import CallsInterrupted
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.engine import RolloutEngine
from armor_megatron.rollout.partial import Finished, PartialStateError
from armor_megatron.rollout.partial_generation import GenerationStopped, GroupRequest, PartialGenerator
from armor_megatron.trainer import components
from armor_megatron.trainer.partial_anchors import NONE_FOUND, HeldAnchors, holds_anchors
from armor_megatron.trainer.rollout_phase import (
    GroupScores,
    RolloutSettings,
    check_spans,
    collect_groups,
    group_accuracy,
    kept_anchor,
    score_group,
    stale_anchor_rows,
)

Accepted = list[tuple[GroupRequest, list[Finished]]]  # the groups a step keeps, each with its members


class PartialRollouts:
    """The driver's partial generator and what it has drawn from the loader (module docstring).

    Args:
        cfg: the run's config (``rollout.partial``, dynamic sampling, anchors).
        settings: what `rollout_phase` needs of the run (its sampling: ``max_new_tokens`` per response).
        encode: a dataset prompt's token ids.
        rows_by_index: the training set's rows by index (a group's key names its row).
        pad_id: the padding token of the batch's rows.
    """

    def __init__(
        self,
        cfg: RunConfig,
        settings: RolloutSettings,
        encode: Callable[[Any], list[int]],
        rows_by_index: dict[int, PromptRow],
        pad_id: int,
    ) -> None:
        self.cfg, self.settings, self.encode = cfg, settings, encode
        self.rows_by_index, self.pad_id = rows_by_index, pad_id
        self.generator: PartialGenerator | None = None  # built with the first step's engine
        self._state: dict[str, Any] | None = None  # a checkpoint's state for the generator not built yet
        self.queue: list[int] = []  # rows drawn from the loader and not yet requested
        self.draws = 0  # a running count naming each group
        self.held = HeldAnchors()  # anchors looked up for the head of that queue (with anchors)
        self._scored: dict[str, GroupScores] = {}  # a step's group scores by key (dynamic sampling)

    def _row_of(self, request: GroupRequest) -> PromptRow:
        return self.rows_by_index[int(request.key.split(":")[0])]

    def generate(
        self, engine: RolloutEngine, prompts: PromptLoader, anchors: AnchorCache | None, reference: str
    ) -> tuple[Accepted, dict[str, Any]]:
        """The groups the step keeps, by the generator, and its metrics; the step's anchors looked up first.

        ``anchors``: the anchor cache (None without anchors); ``reference``: π_ref's version.
        """
        cfg, G, P = self.cfg, self.cfg.rollout.group_size, self.cfg.rollout.prompts_per_step
        part, ds = cfg.rollout.partial, cfg.algorithm.dynamic_sampling
        if self.generator is None:
            self.generator = components.partial_generator(cfg, engine, self.settings.sampling)
            if self._state is not None:
                self.generator.load_state_dict(self._state)
                self._state = None
        generator = self.generator
        max_new = int(self.settings.sampling.max_new_tokens)
        new_groups = math.ceil(P * part.over_provision) * (1 + ds.max_oversample_rounds) if ds.enabled else None
        discarded = 0
        if anchors is not None:  # the step's anchors, before any on-policy request (`trainer.partial_anchors`)
            if new_groups is None:  # every new group starts at once: as many as free places in flight
                new_groups = max(0, math.ceil(P * part.over_provision) - generator.groups_in_progress)
            while len(self.queue) < new_groups:
                self.queue += [r.index for r in prompts.next_batch()]
            rows = [self.rows_by_index[i] for i in self.queue[:new_groups]]
            discarded = self.held.prepare(
                generator, rows, self._row_of, anchors, reference, self.settings, self.encode, max_new
            )

        def supply() -> Iterator[GroupRequest]:
            while True:
                if not self.queue:
                    self.queue = [r.index for r in prompts.next_batch()]
                index = self.queue.pop(0)
                self.draws += 1
                key, prompt = f"{index}:{self.draws}", self.encode(self.rows_by_index[index].prompt)
                if anchors is None:
                    yield GroupRequest(key, tuple(prompt), (max_new,) * G)
                else:
                    yield self.held.request(key, prompt, self.settings, max_new)

        self._scored = {}

        def accept(request: GroupRequest, members: list[Finished]) -> bool:
            row, anchor = self._row_of(request), kept_anchor(request.anchor, self.settings)
            self._scored[request.key] = score_group(row, [m.sample for m in members], self.settings, anchor)
            accuracy = group_accuracy(row, self._scored[request.key].scores[0], anchor, self.settings)
            return bool(dynamic_sampling_keep(torch.tensor([accuracy]))[0])

        try:
            accepted, metrics = generator.generate(
                itertools.islice(supply(), new_groups), P, engine.weight_version, accept if ds.enabled else None
            )
        except GenerationStopped as stopped:  # the preemption signal: the generator kept every token
            raise CallsInterrupted(str(stopped)) from None
        metrics["partial/anchors_discarded"] += discarded
        return accepted, metrics

    def assemble(
        self,
        accepted: Accepted,
        metrics: dict[str, Any],
        step: int,
        engine: RolloutEngine,
        anchors: AnchorCache | None,
        reference: str,
    ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """The kept groups as the step's batch (None when none was kept), scored once, their spans checked."""
        if not accepted:
            return None, metrics
        accepted.sort(key=lambda group: int(group[0].key.split(":")[1]))  # by draw: no row order decided by time
        scored = None  # without dynamic sampling, collect_groups scores the groups
        if self.cfg.algorithm.dynamic_sampling.enabled:  # the filter's scores of the kept groups, breakdown included
            scored = dataclasses.replace(
                GroupScores.merge([self._scored[r.key] for r, _ in accepted]),
                timeouts=sum(s.timeouts for s in self._scored.values()),  # of every group it scored
            )
        metrics.update(
            check_spans([m.spans for _, ms in accepted for m in ms], step, self.cfg.rollout.partial.max_versions)
        )
        try:
            batch, round_metrics = collect_groups(
                [self._row_of(r) for r, _ in accepted],
                self.encode,
                engine,
                self.settings,
                pad_id=self.pad_id,
                generated=[[m.sample for m in ms] for _, ms in accepted],
                group_scores=scored,
                resolved=None if anchors is None else [r.anchor or NONE_FOUND for r, _ in accepted],
            )
        except CallsInterrupted:  # the signal stopped their scoring: the groups stay with the generator
            if self.generator is not None:
                self.generator.give_back(accepted)
            raise
        if anchors is not None and stale_anchor_rows(batch, reference):
            raise RuntimeError(f"step {step + 1}: a group holds an anchor of another reference than {reference}")
        return batch, {**round_metrics, **metrics}

    def state_dict(self) -> dict[str, Any] | None:
        """For the checkpoint: the generator's state, the rows drawn and not requested (None when off)."""
        if not self.cfg.rollout.partial.enabled:
            return None
        generator = self.generator.state_dict() if self.generator is not None else self._state
        return {
            "generator": generator,
            "queue": list(self.queue),
            "draws": self.draws,
            "anchors": self.held.state_dict(),
        }

    def load_state_dict(self, partial: dict[str, Any] | None, source: str) -> None:
        """Restore `state_dict` from ``source``; refused where the config has partial rollouts (or anchors) off."""
        if partial is not None and not self.cfg.rollout.partial.enabled:
            raise PartialStateError(
                f"{source} holds partial rollouts in progress, but rollout.partial.enabled is false"
            )
        if partial is not None and not self.cfg.anchor.enabled and holds_anchors(partial):
            raise PartialStateError(f"{source} holds partial rollouts with anchors, but anchor.enabled is false")
        self._state = None if partial is None else partial["generator"]
        self.queue = [] if partial is None else [int(i) for i in partial["queue"]]
        self.draws = 0 if partial is None else int(partial["draws"])
        self.held.load_state_dict([] if partial is None else partial["anchors"])
        if self.generator is not None and self._state is not None:  # a generator already running
            self.generator.load_state_dict(self._state)
            self._state = None

    def close(self) -> None:
        """Stop the generator's requests and threads."""
        if self.generator is not None:
            self.generator.close()
