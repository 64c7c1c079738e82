"""Anchor groups: training groups of G responses from on-policy samples and reference tries.

Anchor groups: assembling training groups of G responses from on-policy samples and
reference tries (the sampling side of anchors lives in `armor_megatron.rollout.anchor`).

For every prompt the rollout draws G−1 responses from π_old and up to ``max_tries`` responses
from the frozen reference π_ref (rejection sampling). The first reference try whose verifiable
reward reaches ``success_reward`` (1: verified correct; ARMOR uses positive anchors only)
becomes the group's anchor. Without one, the anchor slot is filled by one more on-policy
sample, so every group has exactly G rows and at most one anchor.

The functions here work on rewards and indices only; ``AnchorGroups.gather`` maps the chosen
indices back to whatever objects the rollout holds (token ids, texts, log-probs, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class RowSource:
    """Where one training row comes from: ``prompt``'s on-policy sample or reference try ``index``."""

    prompt: int
    source: Literal["policy", "reference"]
    index: int


@dataclass(frozen=True, eq=False)
class AnchorGroups:
    """num_groups = number of prompts; rows are prompt-major, G per prompt, the anchor last.

    rows: num_groups·G row sources.  rewards, is_anchor: [num_groups, G] (fp32, bool).
    tries_used: per prompt, the reference tries rejection sampling needed (position of the
    first success, or all tries examined when none passed).  found: per prompt, anchor or not.
    """

    rows: tuple[RowSource, ...]
    rewards: torch.Tensor
    is_anchor: torch.Tensor
    tries_used: tuple[int, ...]
    found: tuple[bool, ...]

    @property
    def group_size(self) -> int:
        """G, the number of rows per group."""
        return self.rewards.shape[1]

    def gather(
        self, policy_items: Sequence[Sequence[T]], reference_items: Sequence[Sequence[T]] | None = None
    ) -> list[T]:
        """Items in row order (num_groups·G), gathered from per-prompt policy and reference lists.

        The flat list (num_groups·G, row order) of items, given per-prompt lists shaped like
        the rewards passed to ``assemble_anchor_groups``.
        """

        def source(row: RowSource) -> Sequence[Sequence[T]]:
            if row.source == "policy":
                return policy_items
            if reference_items is None:
                raise ValueError("gather: the groups hold anchor rows but no reference_items were given")
            return reference_items

        return [source(row)[row.prompt][row.index] for row in self.rows]

    def stats(self) -> dict[str, float]:
        """Anchor statistics of this batch of groups.

        anchor_found_rate (groups with an anchor / groups), anchor_tries_mean (reference
        tries per prompt), anchor_tries_total, num_groups.
        """
        n = len(self.found)
        return {
            "anchor_found_rate": sum(self.found) / max(n, 1),
            "anchor_tries_mean": sum(self.tries_used) / max(n, 1),
            "anchor_tries_total": float(sum(self.tries_used)),
            "num_groups": float(n),
        }


def select_anchor(
    reference_rewards: Sequence[float], max_tries: int, success_reward: float = 1.0
) -> tuple[int | None, int]:
    """Rejection sampling over the tries in order.

    (index of the first try with reward ≥ ``success_reward`` among the first ``max_tries``, or None;
    tries used).
    """
    if max_tries < 1:
        raise ValueError(f"anchor max_tries must be >= 1, got {max_tries!r}")
    tries = list(reference_rewards)[:max_tries]
    for i, reward in enumerate(tries):
        if float(reward) >= success_reward:
            return i, i + 1
    return None, len(tries)


def assemble_anchor_groups(
    policy_rewards: Sequence[Sequence[float]],
    reference_rewards: Sequence[Sequence[float]] | None,
    group_size: int,
    max_tries: int = 4,
    success_reward: float = 1.0,
) -> AnchorGroups:
    """Build one group of ``group_size`` rows per prompt.

    Args:
        policy_rewards: per prompt, the rewards of its on-policy samples in sampling order; a
            prompt needs G−1 of them when an anchor is found and G otherwise (extra ones unused).
        reference_rewards: per prompt, the rewards of its reference tries in sampling order;
            None disables anchors (plain on-policy groups of G).
        group_size: G ≥ 2.
        max_tries: reference tries considered per prompt (paper: 4).
        success_reward: reward an anchor must reach (verified correct = 1).
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size!r}")
    if reference_rewards is not None and len(reference_rewards) != len(policy_rewards):
        raise ValueError(
            f"reference_rewards has {len(reference_rewards)} prompts, policy_rewards {len(policy_rewards)}"
        )
    rows: list[RowSource] = []
    rewards: list[list[float]] = []
    tries_used: list[int] = []
    found: list[bool] = []
    for p, pol in enumerate(policy_rewards):
        anchor, tries = (
            (None, 0) if reference_rewards is None else select_anchor(reference_rewards[p], max_tries, success_reward)
        )
        need = group_size - 1 if anchor is not None else group_size
        if len(pol) < need:
            why = "an anchor was found" if anchor is not None else "no anchor was found"
            raise ValueError(
                f"prompt {p}: {why}, so group size {group_size} needs {need} on-policy samples, got {len(pol)}"
            )
        rows += [RowSource(p, "policy", i) for i in range(need)]
        group = [float(r) for r in list(pol)[:need]]
        if anchor is not None and reference_rewards is not None:
            rows.append(RowSource(p, "reference", anchor))
            group.append(float(reference_rewards[p][anchor]))
        rewards.append(group)
        tries_used.append(tries)
        found.append(anchor is not None)
    reward_t = torch.tensor(rewards, dtype=torch.float32).reshape(len(rewards), group_size)
    is_anchor = torch.zeros(reward_t.shape, dtype=torch.bool)
    is_anchor[:, -1] = torch.tensor(found, dtype=torch.bool)
    return AnchorGroups(tuple(rows), reward_t, is_anchor, tuple(tries_used), tuple(found))


def anchor_zero_advantage_rate(advantages: torch.Tensor, is_anchor: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Share of anchor rows whose advantage is zero (|A| ≤ atol).

    Anchors that contribute no gradient, e.g. under QAE's quantile baseline on easy prompts. 0 when
    there are no anchors.

    advantages: [num_groups, G] (or any shape) sequence-level advantages; is_anchor: same shape.
    """
    if advantages.shape != is_anchor.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} and is_anchor {tuple(is_anchor.shape)} differ")
    anchors = is_anchor.bool()
    zero = (advantages.abs() <= atol) & anchors
    return zero.sum().float() / anchors.sum().clamp(min=1).float()
