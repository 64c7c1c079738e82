"""The pre-registered analysis of the visible-shortcut study (``examples/overopt_preregistration.md``).

Per-run summaries from ``metrics.jsonl`` records, the validity checks M1–M5, the paired test of the
endpoint and the verdict. Pure Python; no plotting, no processes.

Definitions:

* validation accuracy at an evaluation = ``eval/mean/pass@1`` (avg@4 at T = 1 on 256 held-out
  problems); a variant's **mean curve** is its mean over seeds at each evaluation step;
* **endpoint** E of a run = the mean of its validation accuracies at the evaluations of the last
  ``WINDOW`` steps (steps s with T − WINDOW < s ≤ T, T the last step);
* **final D-share** of a run = the mean share of direct responses among its validation responses
  over the same evaluations; W-mode accuracy likewise (``acc_w``), compared with step 0;
* anchor statistics of a run = means over its steps of ``anchor/found_rate`` (groups that got an
  anchor) and ``rollout/anchor_w_share`` (anchors in the worked mode).

Checks (all must hold, or no claim is made either way):

M1  DAPO's mean curve peaks at step ≥ 40 and ≥ 0.03 above its start;
M2  DAPO's peak − mean E ≥ 0.10;
M3  the ρ = 0 control's peak − mean E < 0.05, and DAPO's mean final D-share ≥ 0.7;
M4  ARMOR: ≥ 50 % of groups get an anchor and ≥ 70 % of anchors are W;
M5  DAPO's W-mode validation accuracy ends ≤ 0.05 below its start (mean over seeds).

Decision (paired two-sided t test of E_ARMOR − E_DAPO over seeds, 0.05): "ARMOR mitigates" when
every check holds, p < 0.05 and the mean difference > 0; "null" when every check holds and the
95 % CI's upper bound is below 0.05; "inconclusive" otherwise with the checks met; "no claim"
when a check fails.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

from armor_megatron.tasks.paired_test import PairedTest, paired_t_test

VAL = "eval/mean/pass@1"
ANCHOR_W, ANCHOR_FOUND = "rollout/anchor_w_share", "anchor/found_rate"
WINDOW = 40  # steps averaged into the endpoint
EFFECT = 0.05  # the smallest effect the study is powered for


def _eval_metric(record: Mapping, name: str) -> float | None:
    """``eval/<dataset>/<name>`` of the (single) evaluation set in ``record``."""
    for key, value in record.items():
        if key.startswith("eval/") and key.endswith(f"/{name}") and not key.startswith("eval/mean/"):
            return float(value)
    return None


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else math.nan


@dataclasses.dataclass
class RunSummary:
    """One run's validation curves: accuracy, share of direct responses, accuracy of worked ones."""

    steps: list[int]  # evaluation steps
    val: list[float]
    val_d_share: list[float]  # NaN where not logged
    val_acc_w: list[float]  # NaN where no W response
    last_step: int
    anchor_found: float  # mean over steps; NaN without anchors
    anchor_w_share: float
    rollout_d_share: list[tuple[int, float]]  # (step, on-policy D-share)

    @property
    def start(self) -> float:
        """Validation accuracy at the first evaluation."""
        return self.val[0]

    def _window(self, values: Sequence[float]) -> list[float]:
        return [v for s, v in zip(self.steps, values) if s > self.last_step - WINDOW and not math.isnan(v)]

    @property
    def endpoint(self) -> float:
        """Mean validation accuracy over the final window."""
        return _mean(self._window(self.val))

    @property
    def final_d_share(self) -> float:
        """Mean share of direct responses over the final window."""
        return _mean(self._window(self.val_d_share))

    @property
    def acc_w_start(self) -> float:
        """Accuracy of worked responses at the first evaluation."""
        return self.val_acc_w[0]

    @property
    def acc_w_end(self) -> float:
        """Mean accuracy of worked responses over the final window."""
        return _mean(self._window(self.val_acc_w))


def summarize_run(records: Sequence[Mapping], *, shortcut_share: str = "d_share") -> RunSummary:
    """A run's summary from its ``metrics.jsonl`` records (one dict per logged step).

    ``shortcut_share`` names the task's metric of the shortcut mode's share (``d_share`` for worked
    addition, ``short_share`` for the noisy cue); the summary's ``val_d_share`` and
    ``rollout_d_share`` hold it.
    """
    rollout_share = f"rollout/{shortcut_share}"
    evals = [r for r in records if r.get(VAL) is not None]
    if not evals:
        raise ValueError("the run logged no evaluation")
    nan = math.nan

    def get(r, name):
        v = _eval_metric(r, name)
        return nan if v is None else v

    steps = [int(r["step"]) for r in records if "step" in r]
    found = [float(r[ANCHOR_FOUND]) for r in records if r.get(ANCHOR_FOUND) is not None]
    w_share = [float(r[ANCHOR_W]) for r in records if r.get(ANCHOR_W) is not None]
    return RunSummary(
        steps=[int(r["step"]) for r in evals],
        val=[float(r[VAL]) for r in evals],
        val_d_share=[get(r, shortcut_share) for r in evals],
        val_acc_w=[get(r, "acc_w") for r in evals],
        last_step=max(steps),
        anchor_found=_mean(found),
        anchor_w_share=_mean(w_share),
        rollout_d_share=[
            (int(r["step"]), float(r[rollout_share])) for r in records if r.get(rollout_share) is not None
        ],
    )


@dataclasses.dataclass
class MeanCurve:
    """A variant's validation curves averaged over seeds."""

    steps: list[int]
    val: list[float]
    d_share: list[float]

    @property
    def peak_index(self) -> int:
        """The index of the best mean accuracy (the earliest of equals)."""
        return max(range(len(self.val)), key=lambda i: (self.val[i], -i))

    @property
    def peak(self) -> float:
        """The best mean accuracy."""
        return self.val[self.peak_index]

    @property
    def peak_step(self) -> int:
        """The step of the best mean accuracy."""
        return self.steps[self.peak_index]


def mean_curve(runs: Sequence[RunSummary]) -> MeanCurve:
    """Mean over seeds at the evaluation steps every run logged."""
    steps = sorted(set.intersection(*(set(r.steps) for r in runs)))
    if not steps:
        raise ValueError("no evaluation step common to every seed")
    at = [dict(zip(r.steps, zip(r.val, r.val_d_share))) for r in runs]
    return MeanCurve(
        steps=steps,
        val=[_mean([a[s][0] for a in at]) for s in steps],
        d_share=[_mean([a[s][1] for a in at if not math.isnan(a[s][1])]) for s in steps],
    )


@dataclasses.dataclass
class Check:
    """One pre-registered check: its name, whether it passed, and why."""

    name: str
    passed: bool
    detail: str


def validity_checks(
    dapo: Sequence[RunSummary], control: Sequence[RunSummary] | None, armor: Sequence[RunSummary] | None
) -> list[Check]:
    """M1–M5 of the module docstring (a check whose runs are missing fails, saying so)."""
    curve = mean_curve(dapo)
    start, e = curve.val[0], _mean([r.endpoint for r in dapo])
    rise = curve.peak - start
    checks = [
        Check(
            "M1",
            curve.peak_step >= 40 and rise >= 0.03,
            f"DAPO peak {curve.peak:.3f} at step {curve.peak_step} (needs ≥ 40), {rise:+.3f} over the start "
            f"{start:.3f} (needs ≥ +0.03)",
        ),
        Check("M2", curve.peak - e >= 0.10, f"DAPO peak − E = {curve.peak - e:.3f} (needs ≥ 0.10; E = {e:.3f})"),
    ]
    d_end = _mean([r.final_d_share for r in dapo])
    if control:
        c_curve = mean_curve(control)
        c_drop = c_curve.peak - _mean([r.endpoint for r in control])
        checks.append(
            Check(
                "M3",
                c_drop < 0.05 and d_end >= 0.7,
                f"ρ = 0 control peak − E = {c_drop:.3f} (needs < 0.05); DAPO final D-share {d_end:.3f} (needs ≥ 0.7)",
            )
        )
    else:
        checks.append(Check("M3", False, f"the ρ = 0 control did not run; DAPO final D-share {d_end:.3f}"))
    if armor:
        found, w_share = _mean([r.anchor_found for r in armor]), _mean([r.anchor_w_share for r in armor])
        checks.append(
            Check(
                "M4",
                found >= 0.5 and w_share >= 0.7,
                f"ARMOR groups with an anchor {found:.3f} (needs ≥ 0.5), anchors in W {w_share:.3f} (needs ≥ 0.7)",
            )
        )
    else:
        checks.append(Check("M4", False, "ARMOR did not run"))
    drops = [r.acc_w_end - r.acc_w_start for r in dapo]
    if any(math.isnan(x) for x in drops):
        checks.append(Check("M5", False, "a DAPO seed gave no W response to score at the end: W accuracy unmeasured"))
    else:
        drop = _mean(drops)
        checks.append(
            Check(
                "M5",
                drop >= -0.05,
                f"DAPO W-mode validation accuracy {_mean([r.acc_w_start for r in dapo]):.3f} → "
                f"{_mean([r.acc_w_end for r in dapo]):.3f} ({drop:+.3f}; needs ≥ −0.05)",
            )
        )
    return checks


@dataclasses.dataclass
class Decision:
    """The study's decision: the checks, the paired test, the verdict and its reason."""

    checks: list[Check]
    test: PairedTest | None
    verdict: str  # "ARMOR mitigates", "null", "inconclusive", "no claim"
    reason: str


def decide(dapo: Sequence[RunSummary], armor: Sequence[RunSummary], control: Sequence[RunSummary] | None) -> Decision:
    """Checks, the paired test of E_ARMOR − E_DAPO (seeds in the same order) and the verdict."""
    checks = validity_checks(dapo, control, armor)
    paired = armor and len(armor) == len(dapo) >= 2
    test = paired_t_test([r.endpoint for r in armor], [r.endpoint for r in dapo]) if paired else None
    failed = [c.name for c in checks if not c.passed]
    if failed:
        return Decision(checks, test, "no claim", f"validity check(s) {', '.join(failed)} failed")
    if test is None:
        return Decision(checks, test, "no claim", "no paired seeds of DAPO and ARMOR: no test")
    if test.p < 0.05 and test.mean > 0:
        return Decision(checks, test, "ARMOR mitigates", f"p = {test.p:.4f} < 0.05 and mean difference > 0")
    if test.ci_high < EFFECT:
        return Decision(checks, test, "null", f"95 % CI upper bound {test.ci_high:.3f} < {EFFECT}")
    return Decision(checks, test, "inconclusive", f"p = {test.p:.4f}, 95 % CI upper bound {test.ci_high:.3f}")
