"""The driver's report of each step: the anchor pool's statistics and cost, then the metrics log and the step line.

Added to the step's metrics before `metrics_log.StepReporter` logs them and prints the line:

    anchor/*                  the anchor cache's statistics (`AnchorCache.stats`)
    anchor/reference_tokens   tokens π_ref generated since the last step, pre-generation included
                              (``anchor/generated_tokens`` counts only this step's cache misses)
    anchor/generation_cost    (on-policy + π_ref tokens) / on-policy tokens: the step's generation
                              cost relative to on-policy sampling only (0 without on-policy tokens)
"""

from __future__ import annotations

from typing import Any

from armor_megatron.config.schema import RunConfig
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.trainer.metrics_log import MetricsLogger, StepReporter


class RunReport:
    """The driver's step reporter (a text line per step; a tqdm bar only on a terminal) and the anchors' cost.

    Args:
        cfg: the run's config (``logging``, ``train.steps``, ``name``).
        logger: the metrics log (None: the step line only).
        initial_step: the step the run starts from (after a resume).
    """

    def __init__(self, cfg: RunConfig, logger: MetricsLogger | None, initial_step: int) -> None:
        self.reporter = StepReporter(
            logger,
            every_steps=cfg.logging.every_steps,
            total_steps=cfg.train.steps,
            initial_step=initial_step,
            name=cfg.name,
            progress_bar=cfg.logging.progress_bar,
        )
        self._anchor_tokens_logged = 0  # π_ref tokens already reported (anchor/reference_tokens)

    def report(self, step: int, metrics: dict[str, Any], anchors: AnchorCache | None) -> dict[str, Any]:
        """Anchor statistics into the step's metrics, then the log and the step line; the metrics as logged."""
        if anchors is not None:
            metrics.update(anchors.stats.as_dict())
            metrics.update(self._anchor_cost(anchors, metrics))
        return self.reporter.report(step, metrics)

    def _anchor_cost(self, anchors: AnchorCache, metrics: dict[str, Any]) -> dict[str, Any]:
        """Tokens π_ref generated since the last step, and the step's relative generation cost."""
        total = anchors.sampler.stats.generated_tokens
        spent, self._anchor_tokens_logged = total - self._anchor_tokens_logged, total
        policy = metrics.get("rollout/generated_tokens", 0.0)
        return {
            "anchor/reference_tokens": float(spent),
            "anchor/generation_cost": (policy + spent) / policy if policy else 0.0,
        }

    def close(self) -> None:
        """End the step line (and the bar)."""
        self.reporter.close()
