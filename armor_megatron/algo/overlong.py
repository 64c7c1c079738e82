"""DAPO soft overlong punishment (reward shaping by response length).

With maximum response length L_max and a buffer of L_cache tokens before it:

    R_length(|y|) = 0                                  if |y| ≤ L_max − L_cache
                  = ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
                  = −1                                 if |y| > L_max

(times ``penalty_factor``), added to the verifiable reward. DAPO: L_max 20480, L_cache 4096.
"""

from __future__ import annotations

import torch


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """R_length per response; ``lengths``: response lengths in tokens, any shape. fp32, ≤ 0."""
    if not 0 < buffer_length <= max_length:
        raise ValueError(f"overlong buffer_length must be in (0, max_length={max_length}], got {buffer_length!r}")
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor must be >= 0, got {penalty_factor!r}")
    excess = (lengths.float() - (max_length - buffer_length)).clamp(min=0.0) / buffer_length
    return -penalty_factor * excess.clamp(max=1.0)


def apply_overlong_shaping(
    rewards: torch.Tensor, lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Shaped rewards: rewards + R_length(lengths), same shape."""
    if rewards.shape != lengths.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and lengths {tuple(lengths.shape)} differ in shape")
    return rewards.float() + overlong_penalty(lengths, max_length, buffer_length, penalty_factor)
