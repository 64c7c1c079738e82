"""Rejection sampling of one verified anchor per prompt from π_ref.

For each prompt draw up to ``max_tries`` responses from the reference, ``tries_per_request`` at
once (one request with ``n = tries_per_request``), and keep the first whose reward reaches
``success_reward`` (positive anchors only). A prompt whose tries all fail gets no anchor;
the trainer fills that group slot with one more on-policy sample.

Each anchor is verified once, here: its reward travels with it (``AnchorResult.reward``, and
into the anchor cache) and is the reward its group is trained with; nothing scores it again.

``reward_fn(response_text, ground_truth) -> float`` is any verifier (a multi-turn sample's
trajectory is passed as a third argument), e.g.
``lambda text, gt: compute_score(text, gt, verifier).score`` from the rewards package.

``rollout``: how responses are drawn from the source, by default ``source.generate``; a multi-turn
task passes `armor_megatron.rollout.multiturn.MultiTurnRollout.anchor_rollout`, so π_ref runs the
same environment loop as the policy and an anchor is kept when its whole trajectory verifies.

Every generated token counts in the cost, also those of failed tries and of the other
samples of a round after the first correct one (they were paid for; an anchor cache can
keep the correct ones, see :mod:`armor_megatron.rollout.anchor.cache`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from armor_megatron.config.schema import AnchorConfig
from armor_megatron.rollout.anchor.source import AnchorSource
from armor_megatron.rollout.engine import Sample, SamplingParams

RewardFn = Callable[..., float]
# (generate, prompts_token_ids, ground_truths, n, sampling, timeout) -> per prompt, n samples;
# generate(prompts_token_ids, n, sampling, timeout=...) is the source's
AnchorRollout = Callable[..., list[list[Sample]]]


def single_turn(
    generate: Callable[..., list[list[Sample]]],
    prompts_token_ids: Sequence[Sequence[int]],
    ground_truths: Sequence[Any],
    n: int,
    sampling: SamplingParams,
    timeout: float | None = None,
) -> list[list[Sample]]:
    """The default anchor rollout: one request to the source (the ground truths are not needed)."""
    samples: list[list[Sample]] = generate(prompts_token_ids, n, sampling, timeout=timeout)
    return samples


@dataclasses.dataclass(frozen=True)
class AnchorSamplingConfig:
    """The rejection sampler's knobs; the run config's ``anchor`` section names them the same."""

    max_tries: int = 4
    tries_per_request: int = 4
    success_reward: float = 1.0
    sampling: SamplingParams = SamplingParams()

    def __post_init__(self) -> None:
        if self.max_tries < 1 or self.tries_per_request < 1:
            raise ValueError(
                f"max_tries and tries_per_request must be >= 1, got {self.max_tries} and {self.tries_per_request}"
            )

    @classmethod
    def from_run_config(cls, anchor_section: AnchorConfig, sampling: SamplingParams) -> AnchorSamplingConfig:
        """A sampler from a run config's ``anchor`` section.

        ``sampling`` is the rollout's; anchors use it at ``anchor.temperature`` when that is set.
        """
        if anchor_section.temperature is not None:
            sampling = dataclasses.replace(sampling, temperature=anchor_section.temperature)
        return cls(
            max_tries=anchor_section.max_tries,
            tries_per_request=anchor_section.tries_per_request,
            success_reward=anchor_section.success_reward,
            sampling=sampling,
        )


@dataclasses.dataclass(frozen=True)
class VerifiedSample:
    """A reference sample and the reward its verifier gave it."""

    sample: Sample
    reward: float


@dataclasses.dataclass
class AnchorResult:
    """The outcome for one prompt: ``anchor`` (or None) with its verified ``reward``, the tries and tokens it cost.

    ``extra``: further verified samples from the same rounds (candidates for a cache).
    ``cached``: the anchor came from an anchor cache at no generation cost.
    """

    prompt_index: int
    anchor: Sample | None
    tries: int
    generated_tokens: int
    extra: list[VerifiedSample] = dataclasses.field(default_factory=list)
    cached: bool = False
    reward: float | None = None

    @property
    def found(self) -> bool:
        """Whether an anchor was found."""
        return self.anchor is not None

    def to_state(self) -> dict[str, Any]:
        """Plain data for a checkpoint; ``extra`` is left out (an anchor cache pooled it when it was sampled)."""
        state = dataclasses.asdict(self)
        del state["extra"]
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AnchorResult:
        """The inverse of :meth:`to_state` (``extra`` empty)."""
        anchor = state["anchor"]
        return cls(
            int(state["prompt_index"]),
            None if anchor is None else sample_from_state(anchor),
            int(state["tries"]),
            int(state["generated_tokens"]),
            cached=bool(state["cached"]),
            reward=None if state["reward"] is None else float(state["reward"]),
        )


def sample_from_state(state: dict[str, Any]) -> Sample:
    """A `Sample` from its ``dataclasses.asdict`` (token ids and log-probs as lists)."""
    lps = state["logprobs"]
    state = dict(state, token_ids=tuple(state["token_ids"]), logprobs=None if lps is None else tuple(lps))
    return Sample(**state)  # Sample makes a multi-turn anchor's loss_mask and trajectory tuples again


@dataclasses.dataclass
class AnchorStats:
    """Running totals of anchor sampling."""

    prompts: int = 0
    found: int = 0
    tries: int = 0
    generated_tokens: int = 0

    def add(self, results: Sequence[AnchorResult]) -> None:
        """Add one step's results."""
        self.prompts += len(results)
        self.found += sum(r.found for r in results)
        self.tries += sum(r.tries for r in results)
        self.generated_tokens += sum(r.generated_tokens for r in results)

    @property
    def found_rate(self) -> float:
        """Share of prompts that got an anchor."""
        return self.found / self.prompts if self.prompts else 0.0

    @property
    def tries_per_prompt(self) -> float:
        """Reference tries per prompt."""
        return self.tries / self.prompts if self.prompts else 0.0

    def as_dict(self, prefix: str = "anchor/") -> dict[str, float]:
        """The totals as metrics, keys prefixed ``prefix``."""
        return {
            f"{prefix}found_rate": self.found_rate,
            f"{prefix}tries_per_prompt": self.tries_per_prompt,
            f"{prefix}generated_tokens": self.generated_tokens,
            f"{prefix}prompts": self.prompts,
        }


class AnchorSampler:
    """Rejection sampling from ``source`` (a reference policy with ``generate`` and ``version``)."""

    def __init__(
        self,
        source: AnchorSource,
        reward_fn: RewardFn,
        config: AnchorSamplingConfig = AnchorSamplingConfig(),
        rollout: AnchorRollout = single_turn,
    ) -> None:
        self.source = source
        self.reward_fn = reward_fn
        self.config = config
        self.rollout = rollout
        self.stats = AnchorStats()
        self._stats_lock = threading.Lock()

    @property
    def version(self) -> str:
        """The version of the reference weights anchors are sampled from."""
        return self.source.version

    def verify(self, sample: Sample, ground_truth: Any) -> VerifiedSample:
        """``sample`` with its reward against ``ground_truth`` (a multi-turn sample's trajectory too)."""
        if sample.trajectory is None:
            return VerifiedSample(sample, float(self.reward_fn(sample.text, ground_truth)))
        return VerifiedSample(sample, float(self.reward_fn(sample.text, ground_truth, sample.trajectory)))

    def sample(
        self, prompts_token_ids: Sequence[Sequence[int]], ground_truths: Sequence[Any], timeout: float | None = None
    ) -> list[AnchorResult]:
        """One :class:`AnchorResult` per prompt, in order."""
        if len(prompts_token_ids) != len(ground_truths):
            raise ValueError(f"{len(prompts_token_ids)} prompts but {len(ground_truths)} ground truths")
        cfg = self.config
        results = [AnchorResult(i, None, 0, 0) for i in range(len(prompts_token_ids))]
        pending = list(range(len(prompts_token_ids)))
        tries_done = 0
        while pending and tries_done < cfg.max_tries:
            k = min(cfg.tries_per_request, cfg.max_tries - tries_done)
            groups = self.rollout(
                self.source.generate,
                [prompts_token_ids[i] for i in pending],
                [ground_truths[i] for i in pending],
                k,
                cfg.sampling,
                timeout=timeout,
            )
            still = []
            for i, group in zip(pending, groups):
                r = results[i]
                r.tries += k
                r.generated_tokens += sum(s.model_tokens for s in group)
                verified = [self.verify(dataclasses.replace(s, prompt_index=i), ground_truths[i]) for s in group]
                correct = [v for v in verified if v.reward >= cfg.success_reward]
                if correct:
                    r.anchor, r.reward, r.extra = correct[0].sample, correct[0].reward, correct[1:]
                else:
                    still.append(i)
            pending, tries_done = still, tries_done + k
        with self._stats_lock:
            self.stats.add(results)
        return results
