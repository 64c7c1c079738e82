"""One-step-off-policy rollout (``rollout.overlap: one_step``): the driver's side of the overlap.

Timeline of the driver with the overlap on (step t trains batch B_t; ``step-k`` names the
weights after k updates, the engine's ``weight_version``)::

    step t:   take B_t (generated during step t−1 by step-(t−2), or now if none is pending)
              start generating B_{t+1} in a background thread, engine at step-(t−1)
              lp_old, lp_ref, update on B_t (every rank)              ← overlaps the generation
              join B_{t+1}; push step-t to the engine; evaluate; reset; checkpoint (B_{t+1} in it)

So B_t's on-policy samples are one update behind π_old (the trainer's weights before the update
of step t): ``lag = t_π_old − k = 1``, except for the first step and a batch generated without
overlap (``lag = 0``). TIS corrects it: w = min(π_old/π_engine, C) with π_engine the stale
policy's log-probs as the engine reported them. A batch with a sample more than one update
behind (or from weights of no known step) is refused in one line. Anchors come from π_ref and
must carry the reference version of the step that trains them; across a reset the pending
batch's old-reference anchors are resampled (`rollout_phase.replace_stale_anchors`).

The background thread runs only driver work (engine requests, rewards, dynamic sampling) and no
collective, so every rank's collective sequence is that of ``overlap: off``. A checkpoint holds
the pending batch itself (`pending_state`), joined before the save, so resume is exact. A
preemption signal does not stop the generation's reward calls (its weights are gone after the
update, so a regenerated batch would differ): the join grants it ``reward.timeout_s`` after the
signal, then stops them (`OneStepOverlap.join`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from armor_megatron.config.schema import RunConfig
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.data.prompts import PromptLoader
from armor_megatron.rewards.isolated import CallsInterrupted, interrupt_calls
from armor_megatron.rollout.engine import StaleWeightsError
from armor_megatron.trainer.preemption import PreemptionHandler

MAX_LAG = 1
_STEP_VERSION = re.compile(r"^step-(\d+)$")


class LaggingBatchError(StaleWeightsError, ValueError):
    """A batch holds samples more than ``MAX_LAG`` updates behind the trainer (one line)."""


@dataclasses.dataclass
class PendingBatch:
    """A generated batch waiting for its step.

    ``batch`` (None: no group had signal), its rollout ``metrics``, the step whose update it feeds,
    and when its generation ran (``perf_counter``).
    """

    batch: RolloutBatch | None
    metrics: dict[str, Any]
    for_step: int
    begin: float = 0.0
    end: float = 0.0

    @property
    def generation_s(self) -> float:
        """Seconds the generation took."""
        return self.end - self.begin


class BackgroundRollout:
    """At most one generation at a time, in a daemon thread.

    ``join`` returns its `PendingBatch` and re-raises its error in the caller's thread.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: PendingBatch | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether a generation was started and not joined yet."""
        return self._thread is not None

    def check_access(self, what: str) -> None:
        """Refuse ``what`` (state the generation uses: the prompt loader, the engines, the anchor cache) to other threads.

        From `start` until `join`, only the generation's own thread may touch it: the driver reading
        the loader mid-draw would checkpoint prompts the pending batch holds too, or draw them twice.
        Raises RuntimeError (a bug in the loop, with its traceback).
        """
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise RuntimeError(
                f"{what} is in use by the background rollout ({self._thread.name}) until it is joined; "
                "join it first (BackgroundRollout.join)"
            )

    def start(self, generate: Callable[[], PendingBatch]) -> None:
        """Start ``generate`` in the background; one already running raises."""
        if self._thread is not None:
            raise RuntimeError("a background rollout is already running")

        def run() -> None:
            try:
                self._result = generate()
            except BaseException as err:  # noqa: BLE001 - re-raised by join() in the trainer's thread
                self._error = err

        self._result = self._error = None
        self._thread = threading.Thread(target=run, name="overlapped-rollout", daemon=True)
        self._thread.start()

    def finished(self, timeout: float = 0.0) -> bool:
        """Wait up to ``timeout`` seconds for the running generation; whether it has ended (True when none runs)."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def join(self) -> PendingBatch | None:
        """The running generation's batch (None when none runs)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        result, self._result = self._result, None
        return result


class OneStepOverlap:
    """The driver's pending batch: generated in the background beside an update, joined before the weight sync.

    Args:
        background: the thread the generation runs in (its guard keeps the driver off the loader,
            engines and anchor cache meanwhile).
        rollout: the rollout for the update of a step (its index).
        loader: the prompt loader the generation draws from.
        cfg: the run's config (its name, and ``reward.timeout_s``: the grace after a preemption signal).
    """

    def __init__(
        self,
        background: BackgroundRollout,
        rollout: Callable[[int], tuple[RolloutBatch | None, dict[str, Any]]],
        loader: PromptLoader,
        cfg: RunConfig,
    ) -> None:
        self.background, self._rollout, self._loader, self._cfg = background, rollout, loader, cfg
        self.pending: PendingBatch | None = None  # generated for the next step; a checkpoint holds it
        self.beside_update = False  # the next step's batch is generating while this step trains
        self._loader_before: dict[str, Any] | None = None  # the loader before the background generation drew

    def start(self, for_step: int) -> None:
        """Generate the batch of ``for_step`` in the background (the loader's state kept first)."""
        self._loader_before = self._loader.state_dict()
        self.background.start(functools.partial(generate_pending, functools.partial(self._rollout, for_step), for_step))

    def stop_reward_calls(self) -> None:
        """The preemption signal's handler: stop the reward calls in flight, unless they are the next batch's.

        The rollout a step waits for is stopped at once (`interrupt_calls`): the step trains nothing,
        and the resumed run generates the same batch from the same weights. The next step's batch,
        generated beside this step's update, comes from weights the checkpoint no longer holds; it
        is left to finish, so the checkpoint holds it and the resume stays exact (`join` bounds the
        wait).
        """
        if not self.beside_update:
            interrupt_calls()

    def join(self, step: int, preemption: PreemptionHandler | None) -> PendingBatch | None:
        """The background generation's batch, ``step`` the updates done.

        After a preemption signal the generation gets ``reward.timeout_s`` (the bound of one
        verifier call) to finish, counted from the signal or from the join, whichever is later;
        then its reward calls are stopped (an engine request in flight still ends within its own
        timeout). Once the batch is in hand the reward calls are stopped too, so the step's
        evaluation is skipped as it is without overlap. None when they were: the loader goes back to where it
        was before that generation drew its prompts, so a resumed run draws them again, from the
        updated weights (lag 0 where the uninterrupted run had 1; logged).
        """
        grace_ends = None
        while self.background.running and not self.background.finished(timeout=0.05):
            if preemption is None or not preemption.requested():
                continue
            grace_ends = grace_ends or time.monotonic() + self._cfg.reward.timeout_s
            if time.monotonic() >= grace_ends:
                print(
                    f"[{self._cfg.name}] warning: the next step's generation did not finish within "
                    f"reward.timeout_s={self._cfg.reward.timeout_s:g}s of the preemption signal: its reward calls "
                    f"are stopped, and the resumed run regenerates its batch from the updated weights (not "
                    f"bit-exact from step {step + 1})",
                    flush=True,
                )
                interrupt_calls()
                break
        self.beside_update = False
        try:
            pending = self.background.join()
        except CallsInterrupted:
            if self._loader_before is not None:
                self._loader.load_state_dict(self._loader_before)
            return None
        if preemption is not None and preemption.requested():
            interrupt_calls()  # the batch is in hand: what the step does after this (an evaluation) is skipped
        return pending

    def settled(self, step: int, preemption: PreemptionHandler | None) -> PendingBatch | None:
        """The pending batch, once no generation runs (a checkpoint holds it)."""
        if self.background.running:
            self.pending = self.join(step, preemption)
        return self.pending


def generate_pending(rollout: Callable[[], tuple[RolloutBatch | None, dict[str, Any]]], for_step: int) -> PendingBatch:
    """Run ``rollout()`` and time it."""
    begin = time.perf_counter()
    batch, metrics = rollout()
    return PendingBatch(batch, metrics, for_step, begin, time.perf_counter())


def step_of_version(version: str) -> int | None:
    """``"step-12"`` -> 12; None for any other name."""
    match = _STEP_VERSION.match(str(version))
    return int(match.group(1)) if match else None


def check_lag(batch: RolloutBatch | None, trainer_step: int, reference_version: str | None) -> dict[str, float]:
    """Refuse a batch the update of ``trainer_step`` (π_old = ``step-<trainer_step>``) must not train on.

    Return ``rollout/lag`` (most updates behind, on-policy rows) and ``rollout/lag_min``.

    On-policy rows must come from ``step-k`` with 0 ≤ trainer_step − k ≤ MAX_LAG; anchor rows
    from ``reference_version`` (π_ref of this step). Raises `LaggingBatchError` in one line.
    """
    if batch is None:
        return {}
    versions, anchors = batch["weight_version"], batch["is_anchor"].tolist()
    lags = []
    for row, (version, is_anchor) in enumerate(zip(versions, anchors)):
        if is_anchor:
            if reference_version is not None and version != reference_version:
                raise LaggingBatchError(
                    f"step {trainer_step + 1}'s batch holds an anchor (row {row}) of reference {version!r}, "
                    f"but this step's reference is {reference_version!r}"
                )
            continue
        k = step_of_version(version)
        lag = None if k is None else trainer_step - k
        if lag is None or not 0 <= lag <= MAX_LAG:
            behind = "from weights of no step" if lag is None else f"{lag} updates behind"
            raise LaggingBatchError(
                f"step {trainer_step + 1}'s batch holds a sample (row {row}) of weight_version {version!r}, "
                f"{behind} the trainer's 'step-{trainer_step}'; rollout.overlap one_step trains on samples at "
                f"most {MAX_LAG} update behind"
            )
        lags.append(lag)
    if not lags:
        return {}
    return {"rollout/lag": float(max(lags)), "rollout/lag_min": float(min(lags))}


def pending_state(pending: PendingBatch | None) -> dict[str, Any] | None:
    """The pending batch as checkpointable containers and tensors (``trainer_state.pt``)."""
    if pending is None:
        return None
    batch = pending.batch
    return {
        "for_step": pending.for_step,
        "metrics": dict(pending.metrics),
        "generation_s": pending.generation_s,
        "batch": None
        if batch is None
        else {"tensors": dict(batch.tensors), "objects": dict(batch.objects), "meta": dict(batch.meta)},
    }


def load_pending(state: dict[str, Any] | None) -> PendingBatch | None:
    """Inverse of `pending_state` (generation times restart at zero: they describe the past run)."""
    if state is None:
        return None
    b = state["batch"]
    batch = None if b is None else RolloutBatch(b["tensors"], b["objects"], b["meta"])
    return PendingBatch(batch, dict(state["metrics"]), int(state["for_step"]), 0.0, float(state["generation_s"]))


def timing_metrics(step_s: float, busy_trainer_s: float, generation_s: float, waited_s: float) -> dict[str, float]:
    """A step's generation time, the part of it overlap hid, and idle fractions.

    Per step: ``time/generation`` (engine seconds spent on rollouts during the step's wall time),
    ``time/overlap_saved`` (of them, the seconds hidden behind the trainer's work: generation − the
    time the trainer waited for it), and the idle fractions of the trainer (1 − log-probs, values and
    update over the step) and of the engines (1 − generation over the step).
    """
    step_s = max(step_s, 1e-9)
    return {
        "time/generation": generation_s,
        "time/overlap_saved": max(generation_s - waited_s, 0.0),
        "time/trainer_idle_frac": min(max(1.0 - busy_trainer_s / step_s, 0.0), 1.0),
        "time/engine_idle_frac": min(max(1.0 - generation_s / step_s, 0.0), 1.0),
    }
