"""Stability guard of the actor's optimizer step: skip a step instead of applying a bad update.

Public interface::

    guard = StabilityGuard(max_ratio=10.0, window=50, min_history=5)
    reason = guard.check(loss, grad_norm)   # None: apply the step; else why it is skipped
    guard.skipped_total                     # steps skipped so far
    guard.state_dict() / guard.load_state_dict(state)

A step is skipped when

* the loss or the (pre-clipping) gradient norm is NaN or ±inf, or
* ``grad_norm > max_ratio · median(H)`` where H holds the gradient norms of the last
  ``window`` accepted steps; the rule is active once H has ``min_history`` entries.

Only accepted steps enter H, so a run of spikes cannot drag the median up and let itself
through. The guard is pure Python (no torch, no megatron): every rank feeds it the same
all-reduced numbers and reaches the same verdict.
"""

from __future__ import annotations

import collections
import math
import statistics


class StabilityGuard:
    def __init__(self, max_ratio: float = 10.0, *, window: int = 50, min_history: int = 5):
        if not max_ratio > 1.0:
            raise ValueError(f"max_ratio must be > 1, got {max_ratio!r}")
        if window < 1 or not 1 <= min_history <= window:
            raise ValueError(
                f"need window >= 1 and 1 <= min_history <= window; got window={window}, min_history={min_history}"
            )
        self.max_ratio = float(max_ratio)
        self.window = window
        self.min_history = min_history
        self.history: collections.deque[float] = collections.deque(maxlen=window)
        self.skipped_total = 0

    def threshold(self) -> float | None:
        """The largest grad norm the spike rule lets through now (None: rule not active yet)."""
        if len(self.history) < self.min_history:
            return None
        return self.max_ratio * statistics.median(self.history)

    def check(self, loss: float, grad_norm: float) -> str | None:
        """Judge one step; records an accepted grad norm or counts a skip. Returns the skip reason."""
        if not math.isfinite(loss):
            reason = f"non-finite loss {loss}"
        elif not math.isfinite(grad_norm):
            reason = f"non-finite grad norm {grad_norm}"
        else:
            limit = self.threshold()
            reason = (
                None
                if limit is None or grad_norm <= limit
                else (f"grad norm {grad_norm:.4g} > {self.max_ratio:g} x running median {limit / self.max_ratio:.4g}")
            )
        if reason is None:
            self.history.append(float(grad_norm))
        else:
            self.skipped_total += 1
        return reason

    def state_dict(self) -> dict:
        return {"history": list(self.history), "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict) -> None:
        self.history = collections.deque((float(x) for x in state["history"]), maxlen=self.window)
        self.skipped_total = int(state["skipped_total"])
