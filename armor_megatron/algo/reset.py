"""Reference reset schedules: when to copy the policy into the reference (θ_ref ← θ).

The trainer asks ``schedule.should_reset(step, metrics)`` once after every optimizer step,
``step`` counting completed steps from 1, ``metrics`` holding that step's logged values
(validation results included on steps that ran validation). On True it refreshes the
trainer's reference model AND the weights the rollout samples anchors from.

    every τ        reset after steps τ, 2τ, 3τ, ...            (paper, 7B: τ = 160)
    two-stage      every τ₁ (default 1) up to step N, then frozen  (paper, 8B: N = 180)
    never          static reference
    validation     a user hook, or reset when a validation metric reaches a new best
                   (the reference then tracks the best checkpoint so far)

Every schedule is a class registered in ``RESET_SCHEDULES`` (``reference.reset`` names one) with
the ``reference`` config keys that supply its constructor's arguments (``config_keys``) and one
trait, ``needs_eval``: the schedule reads validation metrics, so the run must evaluate
periodically. Adding one is a decorated class, its config keys and its test.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from armor_megatron.registry import Registry

Metrics = Mapping[str, float] | None


@runtime_checkable
class ResetSchedule(Protocol):
    """What the trainer calls.

    ``observe_start`` once with the evaluation before training, ``should_reset`` after every step,
    ``state_dict`` / ``load_state_dict`` with checkpoints.
    """

    def should_reset(self, step: int, metrics: Metrics = None) -> bool:
        """Whether θ_ref ← θ after ``step`` (1-based), given the step's metrics when there are any."""

    def observe_start(self, metrics: Metrics) -> None:
        """See the metrics of the run's start (before step 1)."""

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state, for checkpoints."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""


class StatelessSchedule:
    """The rest of the `ResetSchedule` surface for schedules that depend on the step alone."""

    def observe_start(self, metrics: Metrics) -> None:
        """Nothing to observe."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """No state: an empty dict."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """No state to restore."""
        return None


RESET_SCHEDULES = Registry("reset schedule", traits={"needs_eval": False})
register_reset_schedule = RESET_SCHEDULES.register


def _check_step(step: int) -> None:
    if step < 1:
        raise ValueError(f"reset schedules count completed steps from 1, got step={step!r}")


@register_reset_schedule("every", config_keys={"tau": "tau"})
@dataclass(frozen=True)
class EveryTau(StatelessSchedule):
    """Reset after every ``tau``-th step."""

    tau: int

    def __post_init__(self) -> None:
        if self.tau < 1:
            raise ValueError(f"reset tau must be >= 1, got {self.tau!r}")

    def should_reset(self, step: int, metrics: Metrics = None) -> bool:
        """True every ``tau`` steps."""
        _check_step(step)
        return step % self.tau == 0


@register_reset_schedule("two_stage", config_keys={"first_stage_steps": "stage_one_steps", "tau": "tau"})
@dataclass(frozen=True)
class TwoStage(StatelessSchedule):
    """Reset every ``tau`` steps for the first ``first_stage_steps`` steps, then never."""

    first_stage_steps: int
    tau: int = 1

    def __post_init__(self) -> None:
        if self.first_stage_steps < 0 or self.tau < 1:
            raise ValueError(
                f"two-stage reset needs first_stage_steps >= 0 and tau >= 1, got "
                f"{self.first_stage_steps!r}, {self.tau!r}"
            )

    def should_reset(self, step: int, metrics: Metrics = None) -> bool:
        """True every ``tau`` steps up to ``first_stage_steps``, then never."""
        _check_step(step)
        return step <= self.first_stage_steps and step % self.tau == 0


@register_reset_schedule("never")
@dataclass(frozen=True)
class Never(StatelessSchedule):
    """A static reference."""

    def should_reset(self, step: int, metrics: Metrics = None) -> bool:
        """Never true: the reference stays frozen."""
        _check_step(step)
        return False


@register_reset_schedule("validation_hook", config_keys={"hook": "validation_hook"})
@dataclass
class ValidationHook(StatelessSchedule):
    """Delegates to ``hook(step, metrics) -> bool``, a callable or a ``"module:function"`` path."""

    hook: Callable[[int, Metrics], bool] | str

    def __post_init__(self) -> None:
        if isinstance(self.hook, str):
            self.hook = load_callable(self.hook)

    def should_reset(self, step: int, metrics: Metrics = None) -> bool:
        """What the user hook answers for this step and its metrics."""
        _check_step(step)
        assert not isinstance(self.hook, str)  # __post_init__ loaded the path
        return bool(self.hook(step, metrics))


@register_reset_schedule("validation_best", needs_eval=True, config_keys={"metric": "validation_metric"})
@dataclass
class OnValidationBest:
    """Reset when a validation metric beats its best so far.

    Reset when ``metrics[metric]`` (present on validation steps) beats the best so far by
    more than ``min_delta`` (``mode`` "max" or "min"). Stateful: save ``state_dict()`` with the
    trainer checkpoint.
    """

    metric: str
    mode: str = "max"
    min_delta: float = 0.0
    best: float = field(default=math.nan)

    def __post_init__(self) -> None:
        if self.mode not in ("max", "min"):
            raise ValueError(f"validation reset mode must be 'max' or 'min', got {self.mode!r}")

    def should_reset(self, step: int, metrics: Metrics = None) -> bool:
        """True when the step's evaluation improves ``metric`` beyond the best so far."""
        _check_step(step)
        if not metrics or self.metric not in metrics:
            return False
        value = float(metrics[self.metric])
        sign = 1.0 if self.mode == "max" else -1.0
        if math.isnan(self.best) or sign * (value - self.best) > self.min_delta:
            self.best = value
            return True
        return False

    def observe_start(self, metrics: Metrics) -> None:
        """The evaluation before any training (the initial reference's).

        Later evaluations reset only when they beat it.
        """
        if metrics and self.metric in metrics and math.isnan(self.best):
            self.best = float(metrics[self.metric])

    def state_dict(self) -> dict[str, Any]:
        """The best value so far, for checkpoints."""
        return {"best": self.best}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the best value so far."""
        self.best = float(state["best"])


def load_callable(path: str) -> Callable[..., Any]:
    """Import ``"package.module:function"``; raises ValueError naming the path on failure."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:function', got {path!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load {path!r}: {exc}") from None
    if not callable(obj):
        raise ValueError(f"{path!r} is not callable")
    fn: Callable[..., Any] = obj
    return fn


def build_reset_schedule(kind: str, **params: Any) -> ResetSchedule:
    """The reset schedule registered as ``kind``, built from its parameters.

    ``build_reset_schedule("every", tau=160)``, ``("two_stage", first_stage_steps=180)``,
    ``("never")``, ``("validation_hook", hook="pkg.mod:fn")``,
    ``("validation_best", metric="val/acc")``; an unknown name or argument raises one line.
    """
    schedule: ResetSchedule = RESET_SCHEDULES.call(kind, **params)
    return schedule
