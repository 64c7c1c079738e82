"""A study's figure: validation accuracy and training reward per variant, over seeds."""

from __future__ import annotations

import math
from collections.abc import Mapping

from armor_megatron.tasks.study_stats import VariantCurves
from armor_megatron.trainer.plotting import legend, save_png


def plot_study(curves: Mapping[str, VariantCurves], labels: Mapping[str, str], out: str, title: str = "") -> None:
    """A study's figure.

    Validation accuracy (top) and on-policy training reward (bottom) per variant, seed mean as a
    line and ± one sd over seeds as a band; reference resets as thin vertical lines in the variant's
    colour. Written to ``out`` (PNG), atomically.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (val_ax, train_ax) = plt.subplots(2, 1, figsize=(12, 8), sharex=True)
    for i, (name, c) in enumerate(curves.items()):
        colour = f"C{i % 10}"
        for ax, mean, sd in ((val_ax, c.val_mean, c.val_sd), (train_ax, c.train_mean, c.train_sd)):
            ax.plot(c.steps, mean, color=colour, marker="." if ax is val_ax else None, label=labels.get(name, name))
            lo = [m - (s if math.isfinite(s) else 0.0) for m, s in zip(mean, sd)]
            hi = [m + (s if math.isfinite(s) else 0.0) for m, s in zip(mean, sd)]
            ax.fill_between(c.steps, lo, hi, color=colour, alpha=0.15, linewidth=0)
            for step in c.resets:
                ax.axvline(step, color=colour, linewidth=0.6, alpha=0.35)
    val_ax.set_ylabel("validation accuracy (greedy)")
    val_ax.set_title(title or "validation accuracy")
    train_ax.set_ylabel("training reward (on-policy samples)")
    train_ax.set_xlabel("step (thin vertical lines: reference resets)")
    for ax in (val_ax, train_ax):
        ax.grid(alpha=0.3)
        legend(ax)
    fig.tight_layout()
    try:
        save_png(fig, out)
    finally:
        plt.close(fig)
