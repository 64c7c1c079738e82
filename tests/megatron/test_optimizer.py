"""LR schedule of the actor (megatron's OptimizerParamScheduler as configured by build_scheduler)."""

import math

import pytest
import torch

from armor_megatron.config.schema import OptimizerConfig
from armor_megatron.megatron.optimizer import build_scheduler, current_lr


def _lrs(cfg, total_steps, updates):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=123.0)
    scheduler = build_scheduler(optimizer, cfg, total_steps=total_steps)
    lrs = [current_lr(optimizer)]  # lr of update 0
    for _ in range(updates):
        scheduler.step(increment=1)
        lrs.append(current_lr(optimizer))
    return lrs


def test_warmup_then_cosine_to_min_lr_at_total_steps():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_schedule="cosine", warmup_steps=2, weight_decay=0.0)
    lrs = _lrs(cfg, total_steps=6, updates=7)
    # warmup 0 -> lr over 2 updates; then cosine over the 4 updates from k=2 to k=6:
    # lr(k) = 0.1 + 0.9 · (1 + cos(π (k-2)/4)) / 2; min_lr after the end
    expected = [0.0, 0.5, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * j / 4)) for j in (1, 2, 3, 4)] + [0.1]
    assert lrs == pytest.approx(expected)


def test_constant_and_linear_schedules():
    assert _lrs(OptimizerConfig(lr=0.5), total_steps=3, updates=4) == [0.5] * 5
    linear = OptimizerConfig(lr=1.0, min_lr=0.0, lr_schedule="linear")
    assert _lrs(linear, total_steps=4, updates=4) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])


def test_min_lr_above_lr_is_refused():
    with pytest.raises(ValueError, match="min_lr=0.2 exceeds lr=0.1"):
        _lrs(OptimizerConfig(lr=0.1, min_lr=0.2), total_steps=3, updates=0)
