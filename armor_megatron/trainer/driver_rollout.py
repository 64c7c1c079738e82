"""The driver's rollouts: the batch each step trains, drawn from the engines, with its advantages.

Rank 0 owns the prompt loader, the engines and the anchor cache (built by
`ArmorTrainer.start_engines`). A step's batch takes one of these routes, then gets its group
advantages (`trainer.advantages`) once, over the groups that train:

* one round: P prompts, G−1 on-policy responses and one anchor from π_ref each
  (`rollout_phase.collect_groups`);
* DAPO dynamic sampling: rounds until P groups have signal (`algo.DynamicSampler`), at most
  ``1 + max_oversample_rounds`` of them (`merge_rounds` gives their metrics);
* ``rollout.partial``: the groups the partial generator completed (`trainer.partial_rollout`);
* ``rollout.overlap: one_step``: the batch generated during the last step (`trainer.overlap`),
  its anchors of an older reference resampled, then the next step's generation started.

A preemption signal that stops the step's reward calls gives `STOPPED` instead, with the loader
back where the step began.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from armor_megatron.algo import DynamicSampler
from armor_megatron.config.schema import RunConfig
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.data.prompts import PromptLoader
from armor_megatron.rewards.isolated import CallsInterrupted
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.engine import RolloutEngine
from armor_megatron.trainer.advantages import group_advantages
from armor_megatron.trainer.overlap import BackgroundRollout, OneStepOverlap, check_lag, generate_pending
from armor_megatron.trainer.partial_rollout import PartialRollouts
from armor_megatron.trainer.preemption import PreemptionHandler
from armor_megatron.trainer.rollout_phase import (
    RolloutSettings,
    anchor_truths,
    collect_groups,
    replace_stale_anchors,
    stale_anchor_rows,
)
from armor_megatron.trainer.step_report import StepReport, StepTimer

STOPPED = "stopped"  # the driver's batch when a preemption signal stopped the step's rollout
_T = TypeVar("_T")


def driver_only(value: _T | None, what: str) -> _T:
    """``value``, which only the driver rank holds; None means driver code ran on another rank (a bug)."""
    if value is None:
        raise RuntimeError(f"{what} exists on the driver rank only")
    return value


class DriverRollout:
    """The driver's loader, engines and anchor cache, and the batch each step trains.

    Args:
        cfg: the run's config.
        settings: what `rollout_phase` needs of the run (group size, sampling, verifiers, shaping).
        encode: a dataset prompt's token ids (chat and prompt templates applied).
        loader: the training prompts, ``prompts_per_step`` at a time.
        pad_id: the padding token of the batch's rows.
        reference_version: the name of π_ref's current weights (``ref-<resets>``).
    """

    def __init__(
        self,
        cfg: RunConfig,
        settings: RolloutSettings,
        encode: Callable[[Any], list[int]],
        loader: PromptLoader,
        pad_id: int,
        reference_version: Callable[[], str],
    ) -> None:
        self.cfg, self.settings, self.encode = cfg, settings, encode
        self.loader = loader
        self.rows_by_index = {row.index: row for row in loader.dataset.rows}  # stale anchors' prompts
        self.pad_id = pad_id
        self.reference_version = reference_version
        # built by ArmorTrainer.start_engines; a checkpoint's anchor cache, loaded into it there
        self.policy_engine: RolloutEngine | None = None
        self.reference_engine: RolloutEngine | None = None
        self.anchors: AnchorCache | None = None
        self.anchor_state: dict[str, Any] | None = None
        self.preemption: PreemptionHandler | None = None  # while ArmorTrainer.run runs
        # the state a background generation (``overlap: one_step``) uses until it is joined
        self.background = BackgroundRollout()
        self.overlapped = cfg.rollout.overlap == "one_step"
        self.overlap = OneStepOverlap(self.background, self._rollout_untimed, loader, cfg)  # used when overlapped
        self.partial = PartialRollouts(cfg, settings, encode, self.rows_by_index, pad_id)

    # the driver's state that a background generation (``overlap: one_step``) uses until it is joined
    @property
    def prompts(self) -> PromptLoader:
        """The prompt loader, refused while a background generation draws from it."""
        self.background.check_access("the prompt loader")
        return driver_only(self.loader, "the prompt loader")

    @property
    def engine(self) -> RolloutEngine:
        """The policy engine, refused while a background generation uses it."""
        self.background.check_access("the policy engine")
        return driver_only(self.policy_engine, "the policy engine")

    @property
    def anchor_cache(self) -> AnchorCache:
        """The anchor cache, refused while a background generation uses it."""
        self.background.check_access("the anchor cache")
        return driver_only(self.anchors, "the anchor cache")

    def step_batch(self, step: int, report: StepReport) -> tuple[RolloutBatch | str | None, dict[str, Any]]:
        """The batch the update of ``step`` trains and its rollout metrics; ``report`` learns which generations ran.

        ``STOPPED`` when a preemption signal stopped its reward calls: then the loader (and a batch
        generated during the last step) go back to where the step began, so the resumed run trains
        on the same prompts; with ``rollout.partial`` the loader stays where it is: the generator
        kept the groups drawn, with their tokens, for the checkpoint.
        """
        before, pending = self.prompts.state_dict(), self.overlap.pending
        try:
            if self.overlapped:
                return self._overlapped_batch(step, report)
            generated = generate_pending(functools.partial(self.rollout, step, report), step)
            report.generated(generated)
            return generated.batch, generated.metrics
        except CallsInterrupted:
            if not self.cfg.rollout.partial.enabled:  # partial rollouts: the generator holds what was drawn
                self.prompts.load_state_dict(before)
            self.overlap.pending = pending  # a batch generated during the last step stays for the checkpoint
            return STOPPED, {}

    def rollout(self, step: int, timer: StepTimer) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Groups for ``prompts_per_step`` prompts, for the update of ``step`` (it seeds the engines).

        With DAPO dynamic sampling, groups whose accuracies are all equal are dropped and refilled
        from further prompts.
        """
        cfg, G = self.cfg, self.cfg.rollout.group_size

        def one_round() -> tuple[RolloutBatch, dict[str, Any]]:
            return collect_groups(
                self.prompts.next_batch(),
                self.encode,
                self.engine,
                self.settings,
                anchors=self.anchors,
                pad_id=self.pad_id,
            )

        if self.anchors is not None:
            self.anchors.wait()  # a pre-generation still running would race the reseed below
        self.reseed_engines(step)
        ds = cfg.algorithm.dynamic_sampling
        if cfg.rollout.partial.enabled:
            with timer.phase("rollout"):
                return self._partial_rollout(step)
        with timer.phase("rollout"):
            if not ds.enabled:
                batch, metrics = one_round()
                self._pregenerate_anchors()
                return self._with_advantages(batch, metrics)
            sampler = DynamicSampler(
                cfg.rollout.prompts_per_step,
                pad_values={"input_ids": self.pad_id, "response_mask": 0.0, "engine_logprobs": 0.0},
            )
            rounds: list[dict[str, Any]] = []
            for _ in range(1 + ds.max_oversample_rounds):
                batch, round_metrics = one_round()
                rounds.append(round_metrics)
                sampler.add(batch, batch["accuracy"].view(-1, G))
                if sampler.done:
                    break
        self._pregenerate_anchors()
        metrics = merge_rounds(rounds)
        metrics.update(sampler.stats())
        return self._with_advantages(sampler.take(allow_partial=True), metrics)

    def _rollout_untimed(self, step: int) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """`rollout` in the background: its phases are timed as the generation, not as a step's."""
        return self.rollout(step, StepTimer())

    def _partial_rollout(self, step: int) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """The step's groups from the partial generator (`trainer.partial_rollout`), with their advantages."""
        anchors = None if self.anchors is None else self.anchor_cache
        accepted, metrics = self.partial.generate(self.engine, self.prompts, anchors, self.reference_version())
        self._pregenerate_anchors()  # anchor.cache false: the cache's anchors serve once
        batch, metrics = self.partial.assemble(accepted, metrics, step, self.engine, anchors, self.reference_version())
        return self._with_advantages(batch, metrics)

    def reseed_engines(self, step: int, salt: int = 0) -> None:
        """Seed both engines from the step (and ``salt``, for a second draw in one step).

        So a resumed run samples what the uninterrupted one did.
        """
        for offset, engine in enumerate((self.policy_engine, self.reference_engine)):
            if engine is not None:
                engine.reseed(self.cfg.rollout.seed + 1_000_003 * (2 * step + offset) + 7_919 * salt)

    def _with_advantages(
        self, batch: RolloutBatch | None, metrics: dict[str, Any]
    ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """The step's advantages, once, over the batch that trains (None: no group had signal)."""
        if batch is None:
            return None, metrics
        batch, adv_metrics = group_advantages(batch, self.settings)
        if self.anchors is not None:  # of the groups that train (dynamic sampling keeps some of them)
            adv_metrics["anchor/trained_groups_rate"] = (
                batch["is_anchor"].view(-1, self.cfg.rollout.group_size).any(1).float().mean().item()
            )
        return batch, {**metrics, **adv_metrics}

    def _pregenerate_anchors(self) -> None:
        """After the step's anchors are drawn.

        With ``anchor.cache: false`` they are dropped (never reused). With ``anchor.pregenerate``:
        sample the next batch's anchors in the background while the trainer updates (the loader is
        peeked, not advanced); they serve once.
        """
        if self.anchors is None:
            return
        if not self.cfg.anchor.cache:
            self.anchors.reset(self.reference_version())
        if not self.cfg.anchor.pregenerate:
            return
        loader = self.prompts
        state = loader.state_dict()
        rows = loader.next_batch()
        loader.load_state_dict(state)
        truths = anchor_truths(rows, self.settings)  # as collect_groups asks
        self.anchors.prefetch([self.encode(r.prompt) for r in rows], truths, keys=[r.index for r in rows])

    # ------------------------------------------------------------------ overlap
    def _overlapped_batch(self, step: int, report: StepReport) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """With ``overlap: one_step``: the batch generated during the last step (or now, when none is pending).

        It is checked (`trainer.overlap.check_lag`) after its anchors of an older reference were
        resampled; then the next step's generation starts in the background (not with
        ``overlap_forced_wait``: the next step generates its own batch, after this update).
        """
        overlap = self.overlap
        with report.phase("rollout"):
            pending, overlap.pending = overlap.pending, None
            if pending is None:  # the first step, or after the update with the forced wait
                overlap.start(step)
                pending = self.background.join()
                if pending is None:
                    raise RuntimeError(f"the rollout for step {step + 1} returned no batch")
                report.generated(pending)
            batch, metrics = pending.batch, dict(pending.metrics)
            if pending.for_step != step:
                raise RuntimeError(f"the pending batch was generated for step {pending.for_step + 1}, not {step + 1}")
            if batch is not None and self.anchors is not None:
                batch, metrics = self._resample_stale_anchors(batch, metrics, step)
            metrics.update(check_lag(batch, step, self.reference_version() if self.anchors is not None else None))
        report.trains(pending)
        preempted = self.preemption is not None and self.preemption.requested()
        if not self.cfg.rollout.overlap_forced_wait and step + 1 < self.cfg.train.steps and not preempted:
            overlap.beside_update = True  # before the thread starts: a signal from now on spares it
            overlap.start(step + 1)
        return batch, metrics

    def _resample_stale_anchors(
        self, batch: RolloutBatch, metrics: dict[str, Any], step: int
    ) -> tuple[RolloutBatch | None, dict[str, Any]]:
        """Replace the anchors an older reference produced, and recompute advantages.

        Anchors of an older reference (the batch was generated before a reset) replaced by the
        current reference's (`rollout_phase.replace_stale_anchors`), advantages recomputed;
        ``anchor/stale_resampled`` counts them.
        """
        if not stale_anchor_rows(batch, self.reference_version()):
            return batch, {**metrics, "anchor/stale_resampled": 0.0}
        self.reseed_engines(step, salt=1)  # the draws below are the same after a resume
        replaced, stale = replace_stale_anchors(
            batch,
            self.reference_version(),
            self.rows_by_index,
            self.encode,
            self.engine,
            self.settings,
            self.anchor_cache,
            pad_id=self.pad_id,
        )
        if not self.cfg.anchor.cache:
            self.anchor_cache.reset(self.reference_version())  # they serve once
        trained, metrics = self._with_advantages(replaced, metrics)
        return trained, {**metrics, "anchor/stale_resampled": float(stale)}

    def join_next(self, step: int, report: StepReport) -> None:
        """With ``overlap: one_step``: the trainer waits for the next step's batch, if it is not ready yet."""
        if not self.overlapped:
            return
        with report.phase("rollout"):
            self.overlap.pending = self.overlap.join(step, self.preemption)
        report.generated(self.overlap.pending)

    def close(self) -> None:
        """Stop the partial generator's requests and threads (the run ends, however it ends)."""
        self.partial.close()


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of a step's rollout rounds.

    The first round describes the policy's samples (``rollout/*``, before dynamic sampling filtered
    anything); anchor rates are averaged over every round, since anchors of later rounds train too,
    and what generation cost is summed.
    """
    merged = dict(rounds[0])
    for key in {k for r in rounds for k in r if k.startswith("anchor/") or k in _SUMMED_OVER_ROUNDS}:
        values = [r[key] for r in rounds if key in r]
        merged[key] = sum(values) if key in _SUMMED_OVER_ROUNDS else sum(values) / len(values)
    return merged


_SUMMED_OVER_ROUNDS = (
    "anchor/tries",
    "anchor/generated_tokens",
    "anchor/dropped",
    "rollout/generated_tokens",
    "reward/timeouts",
)
