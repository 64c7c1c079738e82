import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig, policy_loss
from armor_megatron.algo.metrics import reduce_loss_metrics


def test_reduced_micro_batch_metrics_equal_whole_batch_metrics():
    g = torch.Generator().manual_seed(0)
    old, ref = -torch.rand(5, 6, generator=g), -torch.rand(5, 6, generator=g)
    logp = old + 0.5 * torch.randn(5, 6, generator=g)
    adv, entropy = torch.randn(5, generator=g), torch.rand(5, 6, generator=g)
    mask = torch.arange(6)[None] < torch.tensor([6, 2, 0, 4, 1])[:, None]
    cfg = PolicyLossConfig(alpha=0.875, dual_clip_c=3.0)
    _, whole = policy_loss(logp, old, ref, adv, mask, cfg, entropy=entropy)
    parts = [
        policy_loss(logp[s], old[s], ref[s], adv[s], mask[s], cfg, entropy=entropy[s])[1]
        for s in (slice(0, 2), slice(2, 3), slice(3, 5))
    ]  # the middle part has no valid token
    reduced = reduce_loss_metrics(parts)
    assert reduced.keys() == whole.keys()
    for key, value in whole.items():
        assert reduced[key] == pytest.approx(float(value), rel=1e-5, abs=1e-7), key


def test_empty_and_no_tokens():
    with pytest.raises(ValueError, match="at least one"):
        reduce_loss_metrics([])
    zero = {"num_tokens": torch.tensor(0.0), "ratio_min": torch.tensor(0.0), "entropy": torch.tensor(0.0)}
    assert reduce_loss_metrics([zero]) == {"num_tokens": 0.0, "ratio_min": 0.0, "entropy": 0.0}
