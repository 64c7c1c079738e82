"""Seed statistics of a study.

Validation and training curves per variant, their peak and end, and the two tests that decide
whether over-optimisation and ARMOR's effect are seen.

Pure Python over the records of ``metrics.jsonl`` files; no plotting, no processes.

Definitions (fixed before any study was run):

* a variant's **validation curve** is, at each evaluation step every seed logged, the mean over
  seeds of ``eval/mean/pass@1``; its spread is the sample standard deviation over seeds;
* its **training curve** is, per seed, the mean of ``rollout/on_policy_accuracy`` (the reward of
  the on-policy samples, binary here, anchors excluded so variants compare) over the steps since
  the previous evaluation, then the mean over seeds;
* **peak** = the highest point of the mean validation curve, **end** = its last point;
* the **pooled standard error** of a difference of two seed means is
  sqrt((sd_a² + sd_b²) / n), n the number of seeds;
* **over-optimisation is seen** when DAPO's peak − end ≥ 2 pooled SE (sd at the peak step and
  at the end); **ARMOR beats DAPO** when ARMOR's end − DAPO's end ≥ 2 pooled SE.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

VAL, TRAIN, RESET = "eval/mean/pass@1", "rollout/on_policy_accuracy", "reference/reset"


@dataclasses.dataclass
class VariantCurves:
    """One variant's curves over seeds: mean validation accuracy (and sd) and training reward per evaluation step."""

    name: str
    seeds: int
    steps: list[int]  # evaluation steps every seed logged
    val_mean: list[float]
    val_sd: list[float]  # NaN with one seed
    train_mean: list[float]  # NaN where no step since the previous evaluation logged it
    train_sd: list[float]
    resets: list[int]  # steps at which any seed reset its reference

    @property
    def start(self) -> float:
        """Mean validation accuracy at the first evaluation."""
        return self.val_mean[0]

    @property
    def peak_index(self) -> int:
        """The index of the best mean validation accuracy (the earliest of equals)."""
        return max(range(len(self.val_mean)), key=lambda i: (self.val_mean[i], -i))

    @property
    def peak(self) -> float:
        """The best mean validation accuracy."""
        return self.val_mean[self.peak_index]

    @property
    def peak_step(self) -> int:
        """The step of the best mean validation accuracy."""
        return self.steps[self.peak_index]

    @property
    def end(self) -> float:
        """Mean validation accuracy at the last evaluation."""
        return self.val_mean[-1]

    @property
    def end_sd(self) -> float:
        """Its standard deviation over seeds at the last evaluation."""
        return self.val_sd[-1]

    @property
    def train_end(self) -> float:
        """Mean training reward at the last evaluation."""
        return self.train_mean[-1]


def _sd(values: Sequence[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else math.nan


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


def variant_curves(name: str, runs: Sequence[Sequence[Mapping]], step_offset: int = 0) -> VariantCurves:
    """Curves of one variant from its seeds' metric records (one list of step records per seed).

    ``step_offset`` shifts the steps (a run continuing another one's checkpoint).
    """
    if not runs:
        raise ValueError(f"{name}: no runs")
    evals = [{r["step"]: float(r[VAL]) for r in records if r.get(VAL) is not None} for records in runs]
    steps = sorted(set.intersection(*(set(e) for e in evals)))
    if not steps:
        raise ValueError(f"{name}: no evaluation step is common to all {len(runs)} seeds")
    train_per_seed = []
    for records in runs:
        points, previous = [], None
        for step in steps:
            window = [
                float(r[TRAIN])
                for r in records
                if r.get(TRAIN) is not None and (previous is None or previous < r["step"] <= step)
            ]
            points.append(_mean(window) if window and previous is not None else math.nan)
            previous = step
        train_per_seed.append(points)
    val_mean = [_mean([e[s] for e in evals]) for s in steps]
    val_sd = [_sd([e[s] for e in evals]) for s in steps]
    train_mean, train_sd = [], []
    for i in range(len(steps)):
        values = [p[i] for p in train_per_seed if not math.isnan(p[i])]
        train_mean.append(_mean(values))
        train_sd.append(_sd(values))
    resets = sorted({r["step"] + step_offset for records in runs for r in records if r.get(RESET)})
    return VariantCurves(
        name=name,
        seeds=len(runs),
        steps=[s + step_offset for s in steps],
        val_mean=val_mean,
        val_sd=val_sd,
        train_mean=train_mean,
        train_sd=train_sd,
        resets=resets,
    )


def pooled_se(sd_a: float, sd_b: float, n: int) -> float:
    """Standard error of the difference of two means of ``n`` seeds each."""
    return math.sqrt((sd_a**2 + sd_b**2) / n)


@dataclasses.dataclass
class Verdict:
    """What the study shows: DAPO's drop from its peak and ARMOR's gain over DAPO, each with its standard error."""

    dapo_drop: float  # DAPO peak − end
    dapo_drop_se: float
    armor_gain: float  # ARMOR end − DAPO end
    armor_gain_se: float

    @property
    def overoptimisation_seen(self) -> bool:
        """Whether DAPO's drop is at least two standard errors."""
        return self.dapo_drop_se > 0 and self.dapo_drop >= 2 * self.dapo_drop_se

    @property
    def armor_beats_dapo(self) -> bool:
        """Whether ARMOR's gain over DAPO is at least two standard errors."""
        return self.armor_gain_se > 0 and self.armor_gain >= 2 * self.armor_gain_se


def verdict(dapo: VariantCurves, armor: VariantCurves) -> Verdict:
    """The two tests of the module docstring (standard errors are NaN with one seed: no verdict)."""
    n = min(dapo.seeds, armor.seeds)
    return Verdict(
        dapo_drop=dapo.peak - dapo.end,
        dapo_drop_se=pooled_se(dapo.val_sd[dapo.peak_index], dapo.end_sd, n),
        armor_gain=armor.end - dapo.end,
        armor_gain_se=pooled_se(armor.end_sd, dapo.end_sd, n),
    )
