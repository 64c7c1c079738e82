"""StabilityGuard: judge every optimizer step and intervene, in stages, before training collapses.

Public interface::

    guard = StabilityGuard(max_ratio=10.0, config=StabilityConfig(...))   # or field overrides:
    guard = StabilityGuard(3.0, window=4, min_history=1)                   #   StabilityGuard(r, **fields)
    guard.clip_scale                        # multiply eps_low / eps_high of this step's loss by it
    decision = guard.check(metrics)         # after backward, before the update; metrics: loss, grad_norm, ...
    decision.skip, decision.reasons, decision.interventions, decision.lr_scale, decision.clip_scale
    decision.metrics(), decision.log_line() # floats for the step's metrics; a line when it intervened
    action = guard.observe_step(metrics)    # trainer, once per RL step after it: "rollback" or None
    guard.rolled_back()                     # after the trainer restored the last good checkpoint
    guard.healthy                           # no strike, no reduction: a checkpoint now is a good one
    guard.skipped_total, guard.level
    guard.state_dict() / guard.load_state_dict(state)   # also reads the old {history, skipped_total}

Signals of one step (``metrics`` of ``check``; keys a model does not report are not judged):

* veto -- the update is skipped: a non-finite ``loss`` or ``grad_norm`` (pre-clipping), or a
  spike ``grad_norm > max_ratio · median(H)``, H the last ``window`` accepted grad norms, once
  |H| >= ``min_history``. Only accepted steps enter H, so one spike cannot let the next through.
* drift -- the update is applied, the step counts as unhealthy: ``clip_frac_low +
  clip_frac_high > max_clip_frac``; ``max(|log ratio_max|, |log ratio_min|) >
  max_abs_log_ratio``; ``approx_kl_ref > max_kl_ref``; ``entropy < min_entropy``; the
  engine-vs-trainer gap ``rollout/logprob_abs_diff`` last given to ``observe_step`` ``>
  max_logprob_gap``; any of these non-finite. They measure the policy's state (its distance to
  π_old and π_ref, its entropy, the engine's numerics), which a skipped update leaves as it is:
  skipping on them would repeat the same verdict forever.

Interventions, with level ℓ in 0..max_reductions, lr_scale = lr_factor^ℓ, clip_scale = clip_factor^ℓ:

* ``skip``: a vetoed step is not applied (no update, LR schedule not advanced);
* after K = ``max_consecutive_skips`` unhealthy steps in a row the guard escalates, so it never
  skips more than K steps in a row without changing something: ``reduce`` (ℓ += 1) -- at ℓ =
  max_reductions instead ``rollback`` (asked of the trainer through ``observe_step``, at most
  ``max_rollbacks`` times) or ``exhausted``; and ``rebaseline``: the finite grad norms of the
  run's skipped steps replace H, so a lasting upward shift of the grad norm (after a reference
  reset, say) is accepted from then on, at the lowered LR, instead of skipped forever;
* ``relax``: N = ``recover_after`` healthy steps in a row undo one reduction (ℓ -= 1).

The guard is pure Python (no torch, no megatron): every rank feeds it the same all-reduced
numbers and reaches the same verdict.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Mapping
from typing import Any

from armor_megatron.config.schema import StabilityConfig

INTERVENTIONS = ("skip", "reduce", "rebaseline", "relax", "rollback", "exhausted")
GAP_KEY = "rollout/logprob_abs_diff"


@dataclasses.dataclass(frozen=True)
class GuardDecision:
    """The verdict on one step.

    Skip it or not, why (``reasons``: every signal that fired), what the guard did
    (``interventions``, a subset of INTERVENTIONS) and the scales after it: this step's update (if
    any) is taken at ``lr_scale``, the next step's loss clips at ``clip_scale``.
    """

    skip: bool
    reasons: tuple[str, ...]
    interventions: tuple[str, ...]
    lr_scale: float
    clip_scale: float
    level: int
    skipped_total: int

    def metrics(self) -> dict[str, float]:
        """The verdict as metrics (skipped, totals, LR and clip scales, level)."""
        out = {
            "skipped": float(self.skip),
            "skipped_total": float(self.skipped_total),
            "lr_scale": self.lr_scale,
            "clip_scale": self.clip_scale,
            "guard_level": float(self.level),
            "guard_unhealthy": float(bool(self.reasons)),
        }
        out.update({f"guard_{kind}": float(kind in self.interventions) for kind in INTERVENTIONS if kind != "skip"})
        return out

    def log_line(self) -> str | None:
        """One line naming the interventions and their causes; None when the guard did nothing."""
        if not self.interventions:
            return None
        return (
            f"stability guard: {', '.join(self.interventions)} ({'; '.join(self.reasons) or 'healthy'}); "
            f"lr scale {self.lr_scale:g}, clip scale {self.clip_scale:g}, {self.skipped_total} steps skipped so far"
        )


class StabilityGuard:
    """Skips unstable optimizer steps and lowers LR and clipping after repeated ones (module docstring)."""

    def __init__(self, max_ratio: float = 10.0, config: StabilityConfig | None = None, **overrides: Any) -> None:
        if not max_ratio > 1.0:
            raise ValueError(f"max_ratio must be > 1, got {max_ratio!r}")
        config = dataclasses.replace(config or StabilityConfig(), **overrides)
        _check_config(config)
        self.max_ratio, self.config = float(max_ratio), config
        self.history: collections.deque[float] = collections.deque(maxlen=config.window)
        self.skipped_norms: list[float] = []  # finite grad norms of the current run's skipped steps
        self.level = 0  # reductions in force
        self.strikes = 0  # unhealthy steps in a row since the last escalation
        self.healthy_steps = 0  # healthy steps in a row since the last change of level
        self.skipped_total = 0
        self.rollbacks_requested = 0
        self.rollback_pending = False
        self.logprob_gap: float | None = None

    # ------------------------------------------------------------------ scales
    @property
    def lr_scale(self) -> float:
        """The factor on the learning rate at the current level."""
        return self.config.lr_factor**self.level

    @property
    def clip_scale(self) -> float:
        """The factor on the gradient-clip threshold at the current level."""
        return self.config.clip_factor**self.level

    @property
    def healthy(self) -> bool:
        """Whether the guard is at level 0 with no strikes and no rollback pending."""
        return self.level == 0 and self.strikes == 0 and not self.rollback_pending

    def threshold(self) -> float | None:
        """The largest grad norm the spike rule lets through now (None: rule not active yet)."""
        if not self.config.enabled or len(self.history) < self.config.min_history:
            return None
        return self.max_ratio * statistics.median(self.history)

    # ------------------------------------------------------------------ judging
    def check(self, metrics: Mapping[str, float]) -> GuardDecision:
        """Judge one optimizer step from its all-reduced metrics.

        ``metrics`` must hold ``loss`` and ``grad_norm``; updates the guard's state (module docstring).
        """
        loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
        vetoes = self._vetoes(loss, norm)
        drifts = self._drifts(metrics) if self.config.enabled else []
        interventions = []
        if vetoes:
            interventions.append("skip")
            self.skipped_total += 1
            if math.isfinite(norm):
                self.skipped_norms.append(norm)
        else:
            self.history.append(norm)
        if not self.config.enabled:
            pass
        elif vetoes or drifts:
            self.healthy_steps = 0
            self.strikes += 1
            if self.strikes >= self.config.max_consecutive_skips:
                interventions += self._escalate()
        else:
            self.strikes, self.skipped_norms = 0, []
            self.healthy_steps += 1
            if self.level > 0 and self.healthy_steps >= self.config.recover_after:
                self.level -= 1
                self.healthy_steps = 0
                interventions.append("relax")
        return GuardDecision(
            skip=bool(vetoes),
            reasons=tuple(vetoes + drifts),
            interventions=tuple(interventions),
            lr_scale=self.lr_scale,
            clip_scale=self.clip_scale,
            level=self.level,
            skipped_total=self.skipped_total,
        )

    def _vetoes(self, loss: float, norm: float) -> list[str]:
        if not math.isfinite(loss):
            return [f"non-finite loss {loss}"]
        if not math.isfinite(norm):
            return [f"non-finite grad norm {norm}"]
        limit = self.threshold()
        if limit is not None and norm > limit:
            return [f"grad norm {norm:.4g} > {self.max_ratio:g} x running median {limit / self.max_ratio:.4g}"]
        return []

    def _drifts(self, metrics: Mapping[str, float]) -> list[str]:
        cfg, found = self.config, []

        def judge(name: str, value: float | None, limit: float | None, above: bool = True) -> None:
            if value is None or limit is None:
                return
            if not math.isfinite(value):
                found.append(f"non-finite {name} {value}")
            elif (value > limit) if above else (value < limit):
                found.append(f"{name} {value:.4g} {'>' if above else '<'} {limit:g}")

        if "clip_frac_low" in metrics and "clip_frac_high" in metrics:
            judge(
                "clip fraction", float(metrics["clip_frac_low"]) + float(metrics["clip_frac_high"]), cfg.max_clip_frac
            )
        lo, hi = metrics.get("ratio_min"), metrics.get("ratio_max")
        if lo is not None and hi is not None and lo > 0 and hi > 0:  # both 0: the step had no tokens
            judge("max |log r|", max(abs(math.log(hi)), abs(math.log(lo))), cfg.max_abs_log_ratio)
        judge("KL to the reference", _maybe_float(metrics.get("approx_kl_ref")), cfg.max_kl_ref)
        judge("entropy", _maybe_float(metrics.get("entropy")), cfg.min_entropy, above=False)
        judge("engine-trainer log-prob gap", self.logprob_gap, cfg.max_logprob_gap)
        return found

    def _escalate(self) -> list[str]:
        """K unhealthy steps in a row.

        Lower LR and clip range, or ask for a rollback, and re-baseline the spike reference on the
        grad norms just skipped.
        """
        cfg, done = self.config, []
        if self.level < cfg.max_reductions:
            self.level += 1
            done.append("reduce")
        elif self.rollbacks_requested < cfg.max_rollbacks:
            self.rollbacks_requested += 1
            self.rollback_pending = True
            done.append("rollback")
        else:
            done.append("exhausted")
        if self.skipped_norms:
            self.history = collections.deque(self.skipped_norms, maxlen=cfg.window)
            done.append("rebaseline")
        self.strikes, self.skipped_norms, self.healthy_steps = 0, [], 0
        return done

    # ------------------------------------------------------------------ the trainer's side
    def observe_step(self, metrics: Mapping[str, float]) -> str | None:
        """Once per RL step, after it, with the step's metrics (identical on every rank).

        Records the engine-vs-trainer gap ``rollout/logprob_abs_diff`` that the following optimizer
        steps are judged with, and returns ``"rollback"`` once when the guard asks for one (else
        None).
        """
        if GAP_KEY in metrics:
            self.logprob_gap = float(metrics[GAP_KEY])
        if self.rollback_pending:
            self.rollback_pending = False
            return "rollback"
        return None

    def rolled_back(self) -> None:
        """The trainer restored the last good checkpoint (and then this guard's state from before the load).

        The reductions stay in force, the spike reference and the gap start afresh.
        """
        self.history.clear()
        self.skipped_norms, self.strikes, self.healthy_steps = [], 0, 0
        self.rollback_pending, self.logprob_gap = False, None

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The guard's state, for checkpoints."""
        return {
            "history": list(self.history),
            "skipped_total": self.skipped_total,
            "skipped_norms": list(self.skipped_norms),
            "level": self.level,
            "strikes": self.strikes,
            "healthy_steps": self.healthy_steps,
            "rollbacks_requested": self.rollbacks_requested,
            "rollback_pending": self.rollback_pending,
            "logprob_gap": self.logprob_gap,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`.

        The keys missing from a checkpoint of the old skip-only guard ({history, skipped_total})
        take their fresh values.
        """
        self.history = collections.deque((float(x) for x in state["history"]), maxlen=self.config.window)
        self.skipped_total = int(state["skipped_total"])
        self.skipped_norms = [float(x) for x in state.get("skipped_norms", [])]
        self.level = min(int(state.get("level", 0)), self.config.max_reductions)
        self.strikes = int(state.get("strikes", 0))
        self.healthy_steps = int(state.get("healthy_steps", 0))
        self.rollbacks_requested = int(state.get("rollbacks_requested", 0))
        self.rollback_pending = bool(state.get("rollback_pending", False))
        self.logprob_gap = _maybe_float(state.get("logprob_gap"))


def _maybe_float(x: Any) -> float | None:
    return None if x is None else float(x)


def _check_config(config: StabilityConfig) -> None:
    """The field checks declared in the schema (also for configs built in code), and min_history <= window."""
    for field in dataclasses.fields(config):
        check = field.metadata.get("check")
        problem = check(getattr(config, field.name)) if check else None
        if problem:
            raise ValueError(f"stability.{field.name}: {problem}")
    if config.min_history > config.window:
        raise ValueError(f"stability.min_history ({config.min_history}) must be <= window ({config.window})")
