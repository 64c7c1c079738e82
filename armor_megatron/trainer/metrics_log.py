"""Per-step metrics to JSONL (always), TensorBoard and Weights & Biases (when configured).

Every record is one JSON line ``{"step": int, "time": float, <name>: float, ...}``, flushed per
step so a killed run keeps every completed step. Backends that are not installed fail at
construction with one line naming the package, never mid-run.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from typing import Any


class MetricsLogger:
    def __init__(
        self,
        log_dir: str,
        *,
        jsonl: bool = True,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume_step: int | None = None,
    ):
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self._jsonl = None
        if jsonl:
            if resume_step is not None:
                truncate_after_step(self.path, resume_step)
            self._jsonl = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "logging.tensorboard needs the tensorboard package (pip install tensorboard)"
                ) from None
            self._tb = SummaryWriter(os.path.join(log_dir, "tensorboard"))
        self._wandb = None
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError(
                    "logging.wandb.project is set but wandb is not installed (pip install wandb)"
                ) from None
            self._wandb = wandb.init(
                project=wandb_project,
                entity=wandb_entity,
                name=run_name,
                config=dict(config or {}),
                dir=log_dir,
                resume="allow",
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if _is_scalar(v)}
        if self._jsonl is not None:
            record = {"step": step, "time": time.time(), **{k: _json_float(v) for k, v in scalars.items()}}
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str) -> list[dict]:
    """All records of a ``metrics.jsonl``; a torn last line (killed writer) is ignored."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def truncate_after_step(path: str, step: int) -> None:
    """Drop records of steps > ``step`` (a resumed run rewrites them), atomically."""
    if not os.path.exists(path):
        return
    kept = [r for r in read_metrics(path) if r.get("step", -1) <= step]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for record in kept:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)


def _is_scalar(v: Any) -> bool:
    if isinstance(v, bool):
        return True
    if isinstance(v, (int, float)):
        return True
    return hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1


def _json_float(v: float):
    return v if math.isfinite(v) else str(v)
