"""DAPO dynamic sampling: train only on groups whose rewards are not all equal.

A group whose G rewards are identical (all correct or all wrong) has zero advantage under
group normalisation and contributes no gradient, yet dilutes the token-mean. DAPO keeps
sampling until the batch holds ``target_groups`` groups with 0 < accuracy < 1:

    keep_g = max_j r_gj > min_j r_gj      (equivalently std_g > 0)

With ARMOR the anchor counts as a group member: a prompt whose on-policy samples all fail
but whose anchor passes is kept, which is where anchors teach the most.
"""

from __future__ import annotations

import torch

from armor_megatron.data.batch import RolloutBatch


def dynamic_sampling_keep(rewards: torch.Tensor) -> torch.Tensor:
    """[num_groups] bool: True for groups (rows of ``rewards`` [num_groups, G]) with mixed rewards."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, G], got shape {tuple(rewards.shape)}")
    return rewards.amax(dim=1) > rewards.amin(dim=1)


class DynamicSampler:
    """Collects kept groups over generation rounds until ``target_groups`` are there.

    Each ``add`` takes a group-major batch of num_groups·G rows (group g = rows g·G … g·G+G−1)
    and the [num_groups, G] rewards to filter on (DAPO filters on the verifier accuracy).
    ``take`` returns the first ``target_groups`` kept groups; a round beyond ``max_rounds``
    raises (DAPO's max_num_gen_batches) unless the caller stops adding and takes a partial batch.
    """

    def __init__(
        self, target_groups: int, max_rounds: int | None = None, pad_values: dict[str, float | int] | None = None
    ):
        if target_groups < 1:
            raise ValueError(f"dynamic sampling target_groups must be >= 1, got {target_groups!r}")
        if max_rounds is not None and max_rounds < 1:
            raise ValueError(f"dynamic sampling max_rounds must be >= 1 or None, got {max_rounds!r}")
        self.target_groups, self.max_rounds, self.pad_values = target_groups, max_rounds, pad_values
        self.rounds = self.groups_seen = self.groups_kept = 0
        self.group_size: int | None = None
        self._kept: list[RolloutBatch] = []

    @property
    def done(self) -> bool:
        """Whether ``target_groups`` groups have been kept."""
        return self.groups_kept >= self.target_groups

    def add(self, batch: RolloutBatch, rewards: torch.Tensor) -> int:
        """Filter one round's groups into the buffer; returns how many were kept."""
        if self.max_rounds is not None and self.rounds >= self.max_rounds:
            raise RuntimeError(
                f"dynamic sampling: {self.groups_kept} of {self.target_groups} groups with mixed "
                f"rewards after max_rounds={self.max_rounds} rounds; raise max_rounds or "
                f"the rollout batch size"
            )
        keep = dynamic_sampling_keep(rewards)
        num_groups, g = rewards.shape
        if len(batch) != num_groups * g or (self.group_size is not None and g != self.group_size):
            raise ValueError(
                f"dynamic sampling: batch has {len(batch)} rows, rewards {tuple(rewards.shape)} "
                f"(group size so far {self.group_size})"
            )
        self.group_size = g
        self.rounds += 1
        self.groups_seen += num_groups
        kept = int(keep.sum())
        self.groups_kept += kept
        if kept:
            self._kept.append(batch.select(keep.cpu().repeat_interleave(g)))
        return kept

    def take(self, allow_partial: bool = False) -> RolloutBatch | None:
        """The first ``target_groups`` kept groups (target_groups·G rows).

        Before ``done`` it raises, unless ``allow_partial``: then it returns what was kept (None if
        nothing).
        """
        if not self.done and not allow_partial:
            raise RuntimeError(
                f"dynamic sampling: only {self.groups_kept} of {self.target_groups} groups kept "
                f"so far; keep calling add()"
            )
        if not self._kept:
            return None
        assert self.group_size is not None  # set by the first add(), which _kept implies
        return RolloutBatch.concat(self._kept, self.pad_values).slice(0, self.target_groups * self.group_size)

    def stats(self) -> dict[str, float]:
        """rounds, groups seen, and the kept share (1 − share of all-equal groups)."""
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/groups_seen": float(self.groups_seen),
            "dynamic_sampling/keep_rate": self.groups_kept / max(self.groups_seen, 1),
        }
