"""Anchor groups: training groups of G responses from on-policy samples and a verified anchor.

For every prompt the rollout draws G−1 responses from π_old, and the anchor sampler
(`armor_megatron.rollout.anchor`) draws up to ``anchor.max_tries`` responses from the frozen
reference π_ref (rejection sampling) and keeps the first whose verifiable reward reaches the
success reward (1: verified correct; ARMOR uses positive anchors only). That response becomes
the group's anchor, its last row. Without one, the anchor slot is filled by one more on-policy
sample, so every group has exactly G rows and at most one anchor.

The functions here work on rewards and indices only; ``AnchorGroups.gather`` maps the rows back
to whatever objects the rollout holds (token ids, texts, log-probs, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class RowSource:
    """Where one training row comes from: ``prompt``'s on-policy sample ``index``, or its anchor."""

    prompt: int
    source: Literal["policy", "anchor"]
    index: int  # the on-policy sample's position (0 for the anchor)


@dataclass(frozen=True, eq=False)
class AnchorGroups:
    """num_groups = number of prompts; rows are prompt-major, G per prompt, the anchor last.

    rows: num_groups·G row sources.  rewards, is_anchor: [num_groups, G] (fp32, bool).
    found: per prompt, anchor or not.
    """

    rows: tuple[RowSource, ...]
    rewards: torch.Tensor
    is_anchor: torch.Tensor
    found: tuple[bool, ...]

    @property
    def group_size(self) -> int:
        """G, the number of rows per group."""
        return self.rewards.shape[1]

    def gather(self, policy_items: Sequence[Sequence[T]], anchor_items: Sequence[T | None] | None = None) -> list[T]:
        """The items of the rows, in row order (num_groups·G).

        ``policy_items``: per prompt, its on-policy items in sampling order; ``anchor_items``: per
        prompt, its anchor's item (None without one), shaped like the rewards given to
        `assemble_anchor_groups`.
        """
        out: list[T] = []
        for row in self.rows:
            if row.source == "policy":
                out.append(policy_items[row.prompt][row.index])
                continue
            item = None if anchor_items is None else anchor_items[row.prompt]
            if item is None:
                raise ValueError(f"gather: prompt {row.prompt} has an anchor row but no anchor item")
            out.append(item)
        return out


def assemble_anchor_groups(
    policy_rewards: Sequence[Sequence[float]],
    anchor_rewards: Sequence[float | None] | None,
    group_size: int,
) -> AnchorGroups:
    """Build one group of ``group_size`` rows per prompt.

    Args:
        policy_rewards: per prompt, the rewards of its on-policy samples in sampling order; a
            prompt needs G−1 of them when it has an anchor and G otherwise (extra ones unused).
        anchor_rewards: per prompt, the reward of its verified anchor, or None without one;
            None disables anchors (plain on-policy groups of G).
        group_size: G ≥ 2.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size!r}")
    if anchor_rewards is not None and len(anchor_rewards) != len(policy_rewards):
        raise ValueError(f"anchor_rewards has {len(anchor_rewards)} prompts, policy_rewards {len(policy_rewards)}")
    rows: list[RowSource] = []
    rewards: list[list[float]] = []
    found: list[bool] = []
    for p, pol in enumerate(policy_rewards):
        anchor = None if anchor_rewards is None else anchor_rewards[p]
        need = group_size - 1 if anchor is not None else group_size
        if len(pol) < need:
            why = "it has an anchor" if anchor is not None else "it has no anchor"
            raise ValueError(
                f"prompt {p}: {why}, so group size {group_size} needs {need} on-policy samples, got {len(pol)}"
            )
        rows += [RowSource(p, "policy", i) for i in range(need)]
        group = [float(r) for r in list(pol)[:need]]
        if anchor is not None:
            rows.append(RowSource(p, "anchor", 0))
            group.append(float(anchor))
        rewards.append(group)
        found.append(anchor is not None)
    reward_t = torch.tensor(rewards, dtype=torch.float32).reshape(len(rewards), group_size)
    is_anchor = torch.zeros(reward_t.shape, dtype=torch.bool)
    is_anchor[:, -1] = torch.tensor(found, dtype=torch.bool)
    return AnchorGroups(tuple(rows), reward_t, is_anchor, tuple(found))


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
