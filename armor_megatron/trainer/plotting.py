"""Figures of training runs from their ``metrics.jsonl``: accuracy curves and per-phase timings.

The data side (``load_run``, ``series``, ``reset_steps``, ``phase_timings``) is plain Python and
is what the tests check by value; ``plot_runs`` draws it with matplotlib, imported only when called
(it is the optional extra ``plot``), on the Agg backend, and writes the PNG atomically.

Figure layout, top to bottom, all sharing the step axis:

1. accuracy: per run (one colour each) training accuracy ``rollout/accuracy`` (solid), training
   reward ``rollout/reward`` (dotted, only when it differs from the accuracy, e.g. a ±1 reward)
   and validation accuracy ``eval/mean/pass@1`` (dashed, markers); reference resets
   (``reference/reset`` = 1) as thin vertical lines in the run's colour;
2. one panel per extra ``--metric`` key, every run overlaid;
3. one panel per run: seconds per step stacked by phase (``time/<phase>``), the remainder of
   ``time/step`` not covered by a named phase stacked on top as ``other``;
4. one panel per run that logged a timeline (``timeline/*``), on its own axis of seconds since the
   run started: per step, the generation of the batch it trained and its update as bars, so that
   with ``rollout.overlap: one_step`` step t+1's rollout bar sits under step t's update bar.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from armor_megatron.errors import MetricsLogError, MissingInputError
from armor_megatron.trainer.metrics_log import read_metrics

TRAIN_ACCURACY, TRAIN_REWARD, VAL_ACCURACY = "rollout/on_policy_accuracy", "rollout/reward", "eval/mean/pass@1"
RESET = "reference/reset"
STEP_TIME = "time/step"
PHASES = ("rollout", "logprobs", "update", "weight_sync", "eval", "checkpoint", "reference_reset")
OTHER = "other"
TIMELINE_BARS = ("rollout", "update")  # timeline/<bar>_begin, timeline/<bar>_end


@dataclass
class Run:
    """One run's records (``{"step": int, "time": float, <metric>: float | "nan" | "inf"}``)."""

    label: str
    path: str
    records: list[dict[str, Any]]

    def keys(self) -> set[str]:
        """The metric names the run logged."""
        return {k for r in self.records for k in r} - {"step", "time"}


def metrics_path(run: str) -> str:
    """``RUN_DIR`` -> ``RUN_DIR/metrics.jsonl``; a file path is returned as is."""
    return os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run


def load_run(run: str) -> Run:
    """Read a run directory or ``metrics.jsonl``.

    Raises `MissingInputError` when the path or its metrics file is absent, `MetricsLogError`
    when the file cannot be read or holds no step's record; each names the path.
    """
    if not os.path.exists(run):
        raise MissingInputError(f"no such run directory or metrics file: {run}")
    path = metrics_path(run)
    if not os.path.isfile(path):
        raise MissingInputError(f"no metrics file: {path}")
    try:
        logged = read_metrics(path)
    except OSError as err:
        raise MetricsLogError(f"cannot read {path}: {err.strerror or err}") from err
    records = [r for r in logged if isinstance(r, dict) and isinstance(r.get("step"), int)]
    if not records:
        raise MetricsLogError(f"no metrics in {path}")
    label = os.path.basename(os.path.dirname(os.path.abspath(path)))
    return Run(label=label, path=path, records=records)


def unique_labels(runs: Sequence[Run]) -> None:
    """Runs whose directory names collide (``a/armor``, ``b/armor``) are labelled ``a/armor``, ``b/armor``."""
    labels = [run.label for run in runs]
    for run in runs:
        if labels.count(run.label) > 1:
            parent = os.path.dirname(os.path.abspath(run.path))
            run.label = os.path.join(os.path.basename(os.path.dirname(parent)), os.path.basename(parent))


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have ``key``, in step order; null and "nan"/"inf" -> floats."""
    points = sorted((r["step"], _float(r[key])) for r in records if key in r)
    return [s for s, _ in points], [v for _, v in points]


def reset_steps(records: Sequence[dict[str, Any]]) -> list[int]:
    """Steps after which the reference was reset to the actor."""
    steps, values = series(records, RESET)
    return [s for s, v in zip(steps, values) if v == 1.0]


def phase_timings(records: Sequence[dict[str, Any]]) -> tuple[list[int], dict[str, list[float]]]:
    """Seconds per phase for every record with ``time/step``: (steps, {phase: [seconds per step]}).

    Phases absent from every record are left out; absent in one record they count 0 there.
    ``other`` = max(0, time/step − Σ phases) covers the un-timed remainder (metrics, broadcast).
    """
    timed = sorted((r for r in records if STEP_TIME in r), key=lambda r: r["step"])
    present = [p for p in PHASES if any(f"time/{p}" in r for r in timed)]
    out = {p: [_finite(r.get(f"time/{p}", 0.0)) for r in timed] for p in present}
    covered = [sum(out[p][i] for p in present) for i in range(len(timed))]
    out[OTHER] = [max(0.0, _finite(r[STEP_TIME]) - c) for r, c in zip(timed, covered)]
    return [r["step"] for r in timed], out


def step_timeline(records: Sequence[dict[str, Any]]) -> list[tuple[int, dict[str, tuple[float, float]]]]:
    """Each step's timeline bars, ``(step, {bar: (begin, end)})``, since the run started.

    Per step that logged one, ``(step, {bar: (begin, end)})`` in seconds since the run started
    (a resumed run's clock restarts: only records after the last restart are kept).
    """
    out: list[tuple[int, dict[str, tuple[float, float]]]] = []
    for r in sorted(records, key=lambda r: r["step"]):
        bars = {}
        for bar in TIMELINE_BARS:
            begin, end = r.get(f"timeline/{bar}_begin"), r.get(f"timeline/{bar}_end")
            if begin is not None and end is not None and math.isfinite(_float(begin)) and math.isfinite(_float(end)):
                bars[bar] = (_float(begin), _float(end))
        if bars:
            if out and "update" in bars and "update" in out[-1][1] and bars["update"][0] < out[-1][1]["update"][0]:
                out = []  # the clock went back: a resumed run
            out.append((r["step"], bars))
    return out


def _float(value: Any) -> float:
    """A logged value as a float: null (NaN in the JSONL) and "nan"/"inf" strings included."""
    return math.nan if value is None else float(value)


def _finite(value: Any) -> float:
    v = _float(value)
    return v if math.isfinite(v) else 0.0


def plot_runs(runs: Sequence[Run], out: str, extra_metrics: Sequence[str] = ()) -> None:
    """Draw the figure described in the module docstring and write it to ``out`` (PNG), atomically."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    timelines = [(run, step_timeline(run.records)) for run in runs]
    timelines = [(run, t) for run, t in timelines if t]
    per_step = 1 + len(extra_metrics) + len(runs)
    rows = per_step + len(timelines)
    fig, axes = plt.subplots(rows, 1, figsize=(12, 3.2 * rows), squeeze=False)
    axes, timeline_axes = axes[:per_step, 0], axes[per_step:, 0]
    for ax in axes[1:]:
        ax.sharex(axes[0])
    colours = [f"C{i % 10}" for i in range(len(runs))]
    _accuracy_panel(axes[0], runs, colours)
    for ax, key in zip(axes[1:], extra_metrics):
        for run, colour in zip(runs, colours):
            points = series(run.records, key)
            _line(ax, points, color=colour, marker="." if len(points[0]) < 50 else None, label=run.label)
        ax.set_ylabel(key)
        legend(ax)
    for ax, run in zip(axes[1 + len(extra_metrics) :], runs):
        _timing_panel(ax, run)
    axes[-1].set_xlabel("step")
    for ax, (run, timeline) in zip(timeline_axes, timelines):
        _timeline_panel(ax, run, timeline)
    for ax in (*axes, *timeline_axes):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        save_png(fig, out)
    finally:
        plt.close(fig)


def _accuracy_panel(ax: Any, runs: Sequence[Run], colours: Sequence[str]) -> None:
    for run, colour in zip(runs, colours):
        accuracy = series(run.records, TRAIN_ACCURACY)
        reward = series(run.records, TRAIN_REWARD)
        _line(ax, accuracy, color=colour, label=f"{run.label} on-policy train acc")
        if reward != accuracy:
            _line(ax, reward, color=colour, linestyle=":", label=f"{run.label} train reward")
        _line(
            ax,
            series(run.records, VAL_ACCURACY),
            color=colour,
            linestyle="--",
            marker="o",
            markersize=4,
            label=f"{run.label} val acc",
        )
        for i, step in enumerate(reset_steps(run.records)):
            ax.axvline(step, color=colour, linewidth=0.8, alpha=0.5, label=f"{run.label} ref reset" if i == 0 else None)
    ax.set_ylabel("accuracy")
    ax.set_title("training vs validation accuracy")
    legend(ax)


def _line(ax: Any, points: tuple[list[int], list[float]], **style: Any) -> None:
    if points[0]:
        ax.plot(*points, **style)


def legend(ax: Any, **kwargs: Any) -> None:
    """A legend right of ``ax``, when it has labelled artists."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), **kwargs)


def _timing_panel(ax: Any, run: Run) -> None:
    steps, phases = phase_timings(run.records)
    ax.set_title(f"{run.label}: seconds per step by phase")
    ax.set_ylabel("seconds")
    if not steps:
        ax.text(0.5, 0.5, f"no {STEP_TIME} in {run.path}", ha="center", va="center", transform=ax.transAxes)
        return
    bottom = [0.0] * len(steps)
    width = 0.8 * min((b - a for a, b in zip(steps, steps[1:]) if b > a), default=1)
    for name, seconds in phases.items():  # a phase keeps its colour in every run's panel
        ax.bar(steps, seconds, width=width, bottom=bottom, color=f"C{(PHASES + (OTHER,)).index(name)}", label=name)
        bottom = [b + s for b, s in zip(bottom, seconds)]
    legend(ax)


def _timeline_panel(ax: Any, run: Run, timeline: list[tuple[int, dict[str, tuple[float, float]]]]) -> None:
    """Per step (y), the rollout bar above the update bar (x: seconds since the run started)."""
    for bar, (offset, colour) in zip(TIMELINE_BARS, ((0.05, "C0"), (-0.45, "C2"))):
        spans = [(step, bars[bar]) for step, bars in timeline if bar in bars]
        for i, (step, (begin, end)) in enumerate(spans):
            ax.broken_barh(
                [(begin, max(end - begin, 0.0))], (step + offset, 0.4), color=colour, label=bar if i == 0 else None
            )
    ax.set_title(f"{run.label}: step timeline (the batch's rollout, then its update)")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("step")
    ax.invert_yaxis()
    legend(ax)


def save_png(fig: Any, out: str) -> None:
    """Write ``fig`` to ``out`` as a PNG, atomically (a temporary file beside it, then renamed)."""
    directory = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(out)}.", suffix=".tmp")
    try:
        mask = os.umask(0o077)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp makes it 0600; the plot is a plain new file
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=100)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        os.unlink(tmp)
        raise
