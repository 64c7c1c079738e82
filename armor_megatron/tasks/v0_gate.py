"""The V0 gate: a probe of π_ref on the RL training prompts, before any RL.

A design of the over-optimisation study is worth an RL pilot only when the reference has the
dynamics the study needs (``examples/overopt_pilots.md``, third design). From k samples per
training prompt at the RL temperature and k more with the shortcut's first token forced:

* s    = share of the shortcut mode among the samples (target ``SHARE``: rare, so that DAPO first
         improves the generalising mode, but present, so that it can be learnt);
* a_S  = the shortcut's forced accuracy (forced samples that are correct);
* a_G  = the generalising mode's accuracy among its own samples (target ``GENERAL_ACC``: room to
         improve);
* Δ    = a_S − a_G, the shortcut's advantage on training rows: it spreads only when Δ > 0
         (ds/dt ∝ s(1 − s)·Δ);
* the anchors' shortcut share, predicted  s·a_S / (s·a_S + (1 − s)·a_G)  and measured: per prompt
  the first correct of its k samples, which is what the anchor sampler keeps with max_tries = k
  (also the share of prompts that get an anchor).

The gate passes when s ∈ ``SHARE``, a_G ∈ ``GENERAL_ACC``, Δ > 0 and the predicted anchor shortcut
share ≤ ``MAX_ANCHOR_SHORT``. :func:`v0_statistics` is the arithmetic on scored samples;
``armor_megatron.study.noisy.probe_reference`` draws and scores them from an HF model directory
with the local engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

SHARE = (0.02, 0.10)
GENERAL_ACC = (0.5, 0.75)
MAX_ANCHOR_SHORT = 0.15
MIN_PROMPTS = 512  # the probe's least number of training prompts


@dataclasses.dataclass(frozen=True)
class V0Result:
    """The probe's numbers (module docstring) and the gate's verdict."""

    prompts: int
    samples_per_prompt: int
    short_share: float  # s
    short_forced_acc: float  # a_S
    general_share: float
    general_acc: float  # a_G (NaN without a generalising sample)
    anchor_short_predicted: float
    anchor_short_measured: float  # NaN when no prompt got an anchor
    anchor_found: float

    @property
    def advantage(self) -> float:
        """Δ = a_S − a_G."""
        return self.short_forced_acc - self.general_acc

    @property
    def failures(self) -> list[str]:
        """What fails the gate, one phrase each; empty when it passes."""
        out = []
        if not SHARE[0] <= self.short_share <= SHARE[1]:
            out.append(f"shortcut share {self.short_share:.3f} outside [{SHARE[0]}, {SHARE[1]}]")
        if not GENERAL_ACC[0] <= self.general_acc <= GENERAL_ACC[1]:
            out.append(f"generalising accuracy {self.general_acc:.3f} outside [{GENERAL_ACC[0]}, {GENERAL_ACC[1]}]")
        if not self.advantage > 0:
            out.append(f"the shortcut does not pay on training rows (Δ = {self.advantage:+.3f})")
        if not self.anchor_short_predicted <= MAX_ANCHOR_SHORT:
            out.append(f"predicted anchor shortcut share {self.anchor_short_predicted:.3f} > {MAX_ANCHOR_SHORT}")
        return out

    @property
    def passed(self) -> bool:
        """Every criterion holds."""
        return not self.failures

    def line(self) -> str:
        """One printable line: every number and the verdict."""
        return (
            f"V0 prompts={self.prompts}x{self.samples_per_prompt} short_share={self.short_share:.3f} "
            f"short_forced_acc={self.short_forced_acc:.3f} general_share={self.general_share:.3f} "
            f"general_acc={self.general_acc:.3f} delta={self.advantage:+.3f} "
            f"anchor_short_pred={self.anchor_short_predicted:.3f} anchor_short_meas={self.anchor_short_measured:.3f} "
            f"anchor_found={self.anchor_found:.3f} -> {'PASS' if self.passed else 'FAIL: ' + '; '.join(self.failures)}"
        )


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs) if xs else math.nan


def v0_statistics(
    samples: Sequence[Sequence[tuple[str, float]]],
    forced: Sequence[Sequence[tuple[str, float]]],
    mode: Callable[[str], str],
    *,
    shortcut: str,
    general: str,
) -> V0Result:
    """The gate's numbers from scored samples.

    Args:
        samples: per prompt, its k free samples as (response, score), in the order drawn.
        forced: per prompt, samples whose response was forced to open the shortcut mode.
        mode: a response's mode name.
        shortcut: the shortcut mode's name.
        general: the generalising mode's name.
    """
    if not samples or len(forced) != len(samples):
        raise ValueError(f"need free and forced samples for the same prompts, got {len(samples)} and {len(forced)}")
    flat = [(mode(r), float(score)) for group in samples for r, score in group]
    s = _mean([m == shortcut for m, _ in flat])
    a_s = _mean([float(score) for group in forced for _, score in group])
    general_scores = [score for m, score in flat if m == general]
    a_g = _mean(general_scores)
    anchors = []
    for group in samples:
        first = next((mode(r) for r, score in group if score >= 1.0), None)
        if first is not None:
            anchors.append(first == shortcut)
    pred = s * a_s / (s * a_s + (1 - s) * a_g) if s * a_s + (1 - s) * a_g > 0 else math.nan
    return V0Result(
        prompts=len(samples),
        samples_per_prompt=max(len(g) for g in samples),
        short_share=s,
        short_forced_acc=a_s,
        general_share=len(general_scores) / len(flat),
        general_acc=a_g,
        anchor_short_predicted=pred,
        anchor_short_measured=_mean([float(a) for a in anchors]),
        anchor_found=len(anchors) / len(samples),
    )
