"""Watch for over-optimisation: training reward rising while validation accuracy falls.

ARMOR's motivation (paper §1) is that training reward keeps climbing while validation
accuracy decouples and drops. ``OverOptimizationMonitor.update`` returns the train–val gap
and a warning text when, over the last ``window`` evaluations, the least-squares slope of the
training reward is positive and that of validation accuracy is negative by more than ``tol``.
"""

from __future__ import annotations

from collections import deque
from typing import Any


def _slope(values: list[float]) -> float:
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    num = sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values))
    den = sum((i - mean_x) ** 2 for i in range(n))
    return num / den if den else 0.0


class OverOptimizationMonitor:
    """Warns when training reward rises while validation accuracy falls over the last ``window`` evaluations."""

    def __init__(self, window: int = 3, tol: float = 1e-3):
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.window, self.tol = window, tol
        self.train: deque[float] = deque(maxlen=window)
        self.val: deque[float] = deque(maxlen=window)

    def update(self, train_reward: float, val_accuracy: float) -> tuple[dict[str, float], str | None]:
        """Record one evaluation; returns (metrics, warning or None)."""
        self.train.append(train_reward)
        self.val.append(val_accuracy)
        metrics = {"overopt/train_val_gap": train_reward - val_accuracy}
        if len(self.val) < self.window:
            return metrics, None
        train_slope, val_slope = _slope(list(self.train)), _slope(list(self.val))
        metrics.update({"overopt/train_reward_slope": train_slope, "overopt/val_acc_slope": val_slope})
        if train_slope > self.tol and val_slope < -self.tol:
            return metrics, (
                f"over-optimisation: training reward rising ({train_slope:+.4f}/eval) while validation accuracy "
                f"falls ({val_slope:+.4f}/eval) over the last {self.window} evaluations"
            )
        return metrics, None

    def state_dict(self) -> dict[str, Any]:
        """The recent rewards and accuracies, for checkpoints."""
        return {"train": list(self.train), "val": list(self.val)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.train.extend(state["train"])
        self.val.extend(state["val"])
