"""Per-step metrics to JSONL (always), TensorBoard and Weights & Biases (when configured).

Every record is one JSON line ``{"step": int, "time": float, <name>: float | null, ...}`` (NaN
is ``null``, ±inf the strings "inf"/"-inf"), flushed per step so a killed run keeps every
completed step. Backends that are not installed fail at construction with one line naming the
package, never mid-run. W&B keeps one run across requeues: its id is kept in ``wandb_run_id``
beside the JSONL.

`StepReporter` (the driver's view of each step): the logging policy (every ``every_steps``
steps, and every step that evaluated, so no evaluation is dropped), one plain text line per
step on stdout (what a SLURM ``.out`` file needs), and a tqdm bar instead only on a terminal.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections.abc import Mapping
from typing import Any, TextIO


class MetricsLogger:
    """Writes each step's scalar metrics to ``metrics.jsonl``, and to TensorBoard and W&B when enabled."""

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
        fresh_start: bool = False,
    ):
        """Open the run's metrics log in ``log_dir``.

        ``resume_step``: a resumed run drops the records after it; ``fresh_start``: a run that
        starts from step 0 moves an earlier run's ``metrics.jsonl`` aside (``self.set_aside``:
        where to) instead of appending to it.
        """
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.path = os.path.join(log_dir, "metrics.jsonl")
        self.set_aside = None
        self._jsonl = None
        self._last_step: int | None = None  # of the JSONL's records, once a resumed run truncated them
        if jsonl:
            if resume_step is not None:
                self._last_step = truncate_after_step(self.path, resume_step)
            elif fresh_start and os.path.isfile(self.path) and os.path.getsize(self.path) > 0:
                self.set_aside = f"{self.path}.{time.strftime('%Y%m%d-%H%M%S')}.{uuid.uuid4().hex[:6]}.old"
                os.replace(self.path, self.set_aside)
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
                id=wandb_run_id(log_dir),
                resume="allow",
            )

    def lacks(self, step: int) -> bool:
        """Whether the JSONL a resumed run kept ends before ``step`` (False without a JSONL to tell)."""
        return self._jsonl is not None and (self._last_step is None or self._last_step < step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write the scalar metrics of ``step`` to every enabled sink."""
        scalars = scalar_metrics(metrics)
        if self._jsonl is not None:
            self._last_step = step
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
        """Close every sink."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_run_id(log_dir: str) -> str:
    """The W&B run id of this run directory.

    Made once, then read back (a requeued job continues the same W&B run instead of starting a new
    one).
    """
    path = os.path.join(log_dir, "wandb_run_id")
    if os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    run_id = uuid.uuid4().hex[:16]
    with open(path, "w") as f:
        f.write(run_id + "\n")
    return run_id


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a ``metrics.jsonl``.

    A torn last line (killed writer) is ignored, and so is everything after a line that is not JSON
    (bytes that are not UTF-8 read as U+FFFD).
    """
    records = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return records


def truncate_after_step(path: str, step: int) -> int | None:
    """Drop records of steps > ``step`` (a resumed run rewrites them), atomically.

    Returns the step of the last record kept (None: none).
    """
    if not os.path.exists(path):
        return None
    kept = [r for r in read_metrics(path) if r.get("step", -1) <= step]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for record in kept:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return max((int(r["step"]) for r in kept if "step" in r), default=None)


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The scalar entries of ``metrics`` as floats (tensors of one element included)."""
    return {k: float(v) for k, v in metrics.items() if _is_scalar(v)}


def _is_scalar(v: Any) -> bool:
    if isinstance(v, bool):
        return True
    if isinstance(v, (int, float)):
        return True
    return hasattr(v, "item") and getattr(v, "numel", lambda: 0)() == 1


def _json_float(v: float) -> float | str | None:
    if math.isnan(v):
        return None
    return v if math.isfinite(v) else str(v)


# ----------------------------------------------------------------------------- the step report
# short name in the text line -> metric key, in the order shown
LINE_FIELDS = (
    ("reward", "rollout/reward"),
    ("acc", "rollout/accuracy"),
    ("len", "rollout/response_len"),
    ("len_max", "rollout/response_len_max"),
    ("trunc", "rollout/truncated_rate"),
    ("val", "eval/mean/pass@1"),
)
PHASES = ("rollout", "logprobs", "values", "update", "weight_sync", "eval", "reference_reset", "checkpoint")
SKIPPED = "train/skipped_no_signal"  # the loop's mark of a step that trained nothing: every group scored alike
SKIPPED_NOTE = "skipped: every group scored alike"
SKIPPED_IN_A_ROW_WARNING = 5  # this many skipped steps in a row print one warning (again after a step trains)
BAR_KEYS = ("rollout/on_policy_accuracy", "eval/mean/pass@1", "anchor/found_rate", "train/grad_norm")


def step_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """One plain text line summarising a step.

    One plain line: ``step 3/20 | reward 0.500 | acc 0.500 | len 6.2 | len_max 8 | val 0.438 |
    rollout 1.20s update 0.80s ... | 123 tok/s | 2.40 s/step`` (fields the step lacks are left out).
    A step that trained nothing says ``skipped: every group scored alike`` in place of its
    throughput (no advantage anywhere: each group's responses got equal rewards).
    """
    parts = [f"step {step}/{total}"]
    for short, key in LINE_FIELDS:
        if key in metrics:
            parts.append(f"{short} {_fmt(metrics[key])}")
    skipped = bool(metrics.get(SKIPPED))
    if skipped:
        parts.append(SKIPPED_NOTE)
    phases = [f"{p} {float(metrics[f'time/{p}']):.2f}s" for p in PHASES if f"time/{p}" in metrics]
    if phases:
        parts.append(" ".join(phases))
    if "perf/tokens_per_s" in metrics and not skipped:
        parts.append(f"{float(metrics['perf/tokens_per_s']):.0f} tok/s")
    if "time/step" in metrics:
        parts.append(f"{float(metrics['time/step']):.2f} s/step")
    return " | ".join(parts)


def _fmt(value: Any) -> str:
    v = float(value)
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"


class StepReporter:
    """Reports each completed step on the driver.

    To ``logger`` by the policy below, and as one text line on ``stream``, or, when ``progress_bar``
    and ``stream`` is a terminal, as a tqdm bar.

    Logging policy: a step is logged when ``step % every_steps == 0`` or when it carries an
    evaluation (``eval/`` keys): evaluations are never dropped.

    After `SKIPPED_IN_A_ROW_WARNING` steps in a row that trained nothing (every group scored alike),
    one warning line on ``stream`` says so and what to look at; a step that trains starts the count
    again.
    """

    def __init__(
        self,
        logger: MetricsLogger | None,
        *,
        every_steps: int,
        total_steps: int,
        initial_step: int = 0,
        name: str = "",
        progress_bar: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.logger, self.every_steps, self.total_steps = logger, every_steps, total_steps
        self.prefix = f"[{name or 'armor'}]"  # the run's name starts each text line
        self.stream = sys.stdout if stream is None else stream
        self.skipped_in_a_row = 0
        self.bar = None
        if progress_bar and _is_tty(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=initial_step, desc=name, unit="step", dynamic_ncols=True, file=self.stream
            )

    def should_log(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Whether ``step`` is shown: every ``every_steps`` steps and at evaluations."""
        return step % self.every_steps == 0 or any(k.startswith("eval/") for k in metrics)

    def report(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Log and show one step; returns the metrics as logged."""
        metrics = dict(metrics)
        if self.logger is not None and self.should_log(step, metrics):
            self.logger.log(step, metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k.split("/")[-1]: f"{float(metrics[k]):.3f}" for k in BAR_KEYS if k in metrics})
        else:
            print(f"{self.prefix} {step_line(step, self.total_steps, metrics)}", file=self.stream, flush=True)
        self._count_skipped(metrics)
        return metrics

    def _count_skipped(self, metrics: Mapping[str, Any]) -> None:
        """Count the skipped steps in a row; warn once when the count reaches `SKIPPED_IN_A_ROW_WARNING`."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if metrics.get(SKIPPED) else 0
        if self.skipped_in_a_row != SKIPPED_IN_A_ROW_WARNING:
            return
        accuracy = metrics.get("rollout/accuracy")
        share = "" if accuracy is None else f" (rollout/accuracy {float(accuracy):.3f})"
        line = (
            f"{self.prefix} warning: {self.skipped_in_a_row} steps in a row skipped, every group scored alike"
            f"{share}, so nothing trains. Accuracy near 0: the prompts are too hard for the model, or the "
            "verifier misreads the answers (data.answer_key; armor-train --check probes it); near 1: too easy; "
            "more refill rounds: algorithm.dynamic_sampling.max_oversample_rounds"
        )
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """Close the progress bar, if any."""
        if self.bar is not None:
            self.bar.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
