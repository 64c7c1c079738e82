"""The anchors of partial rollouts' groups: looked up before a step's on-policy requests, kept exact across resets.

An ARMOR group is G−1 on-policy responses and one anchor from π_ref, or G on-policy responses
when none was found (`rollout_phase.collect_groups`). Under ``rollout.partial`` a group may be
started in one step and trained in a later one, so its anchor is looked up when the group is
started, before any of its on-policy requests: the request then asks for G−1 responses beside a
kept anchor (`rollout_phase.kept_anchor`), G otherwise.

:meth:`HeldAnchors.prepare` runs at the start of each step, before the generator sends anything,
and makes one `AnchorCache.get` call for

* the groups in progress (started in an earlier step) whose anchor an older reference sampled
  (a reset since): that anchor is discarded (``partial/anchors_discarded``) and replaced by a
  lookup under the current reference; when it finds none, the group gets one more on-policy
  response instead (`PartialGenerator.reanchor`);
* the rows the step may start (the head of the rows drawn and not yet requested, as many as the
  generator may take), except those holding a lookup of the current reference already.

Lookups for rows the step did not start are held with those rows (not returned to the cache,
whose pools ``anchor.cache: false`` empties every step and whose draws count uses) and serve when
the row is started; a reset discards them too (counted). So every anchor that trains is of the
trainer's current π_ref, and ``anchor.source: swap`` puts π_ref into the policy engines only
while no on-policy request decodes on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from armor_megatron.data.prompts import PromptRow
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorResult
from armor_megatron.rollout.partial_generation import GroupRequest, PartialGenerator
from armor_megatron.trainer.rollout_phase import RolloutSettings, anchor_truths, kept_anchor

NONE_FOUND = AnchorResult(0, None, 0, 0)  # a group that keeps no anchor (nothing to train with)


class HeldAnchors:
    """Anchor lookups held for the rows drawn and not yet requested (the head of that queue, in order).

    ``held[i]``: ``(reference, result)`` for the i-th queued row; :meth:`state_dict` is plain data.
    """

    def __init__(self) -> None:
        self.held: list[tuple[str, AnchorResult]] = []

    def prepare(
        self,
        generator: PartialGenerator,
        rows: Sequence[PromptRow],
        row_of: Callable[[GroupRequest], PromptRow],
        cache: AnchorCache,
        reference: str,
        settings: RolloutSettings,
        encode: Callable[[Any], list[int]],
        max_new_tokens: int,
    ) -> int:
        """The step's anchors, in one lookup before any on-policy request (module docs); returns the held ones discarded.

        ``rows``: the queued rows the step may start, in order; ``row_of``: a group's row. The
        groups in progress re-anchored here are counted by the generator.
        """
        stale = generator.stale_anchors(reference)
        relook = [g for g in stale if kept_anchor(g.anchor, settings) is not None]
        for g in stale:  # an anchor it did not keep: its G on-policy responses stand, with no anchor
            if kept_anchor(g.anchor, settings) is None:
                generator.reanchor(g.key, NONE_FOUND, reference, g.max_new_tokens)
        todo = [i for i in range(len(rows)) if i >= len(self.held) or self.held[i][0] != reference]
        discarded = sum(self.held[i][1].found for i in todo if i < len(self.held))
        lookup = [row_of(g) for g in relook] + [rows[i] for i in todo]
        if not lookup:
            return discarded
        prompts = [list(g.prompt_ids) for g in relook] + [encode(rows[i].prompt) for i in todo]
        results = cache.get(prompts, anchor_truths(lookup, settings), [r.index for r in lookup], settings.timeout)
        for g, result in zip(relook, results):
            grown = () if kept_anchor(result, settings) is not None else (max_new_tokens,)
            generator.reanchor(g.key, result, reference, g.max_new_tokens + grown)
        held: list[tuple[str, AnchorResult] | None] = [*self.held, *[None] * (len(rows) - len(self.held))]
        for i, result in zip(todo, results[len(relook) :]):
            held[i] = (reference, result)
        self.held = [h for h in held if h is not None]  # every slot is filled: held or looked up
        return discarded

    def request(
        self, key: str, prompt_ids: Sequence[int], settings: RolloutSettings, max_new_tokens: int
    ) -> GroupRequest:
        """The next queued row's group request, with its held anchor: G−1 on-policy responses beside a kept one, else G."""
        if not self.held:
            raise RuntimeError(f"group {key!r}: no anchor was looked up for its row before the step")
        reference, result = self.held.pop(0)
        members = settings.group_size - (kept_anchor(result, settings) is not None)
        return GroupRequest(key, tuple(prompt_ids), (max_new_tokens,) * members, result, reference)

    def state_dict(self) -> list[list[Any]]:
        """``[reference, result]`` per held row, plain data."""
        return [[reference, result.to_state()] for reference, result in self.held]

    def load_state_dict(self, state: list[list[Any]]) -> None:
        """Restore :meth:`state_dict`."""
        self.held = [(str(reference), AnchorResult.from_state(result)) for reference, result in state]


def holds_anchors(partial_state: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``partial_rollouts`` holds anchors: of groups in progress, or looked up for rows."""
    generator = partial_state["generator"]
    groups = [] if generator is None else generator["groups"]
    return bool(partial_state["anchors"]) or any(g["anchor"] is not None for g in groups)
