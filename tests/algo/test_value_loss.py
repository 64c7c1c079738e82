import math

import pytest
import torch

from armor_megatron.algo import reduce_loss_metrics
from armor_megatron.algo.value_loss import (
    ValueLossConfig,
    explained_variance,
    explained_variance_from_moments,
    value_loss,
)

CLIP = ValueLossConfig(clip_eps=0.2)


def test_hand_computed_clipped_value_loss_and_gradient():
    # V_old = 0 everywhere, R = 1, ε_v = 0.2:
    #   V = 0.5: V_clip = 0.2  -> max(0.25, 0.64) = 0.64 (clipped term larger: no gradient)
    #   V = 1.5: V_clip = 0.2  -> max(0.25, 0.64) = 0.64 (clipped term larger: no gradient)
    #   V = 0.1: V_clip = 0.1  -> max(0.81, 0.81) = 0.81 (inside the clip: gradient V − R = −0.9)
    #   V = 2.0 on a padding position: dropped
    # token-mean: 0.5 · (0.64 + 0.64 + 0.81) / 3 = 0.348333...
    values = torch.tensor([[0.5, 1.5], [0.1, 2.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = value_loss(values, torch.zeros(2, 2), torch.ones(2, 2), mask, CLIP)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.64 + 0.64 + 0.81) / 3))
    loss.backward()
    # ∂ℓ/∂V = (V − R) / N where the unclipped term is used, 0 where the clipped one is
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0], [-0.9 / 3, 0.0]]))
    torch.testing.assert_close(m["value_clip_frac"], torch.tensor(2 / 3))
    torch.testing.assert_close(m["value_mean"], torch.tensor((0.5 + 1.5 + 0.1) / 3))
    torch.testing.assert_close(m["return_mean"], torch.tensor(1.0))
    torch.testing.assert_close(m["value_error_sq_mean"], torch.tensor((0.25 + 0.25 + 0.81) / 3))
    assert m["num_tokens"] == 3


def test_unclipped_loss_is_half_the_squared_error():
    # ε_v = None: 0.5·(V − R)² = 0.5·(4 + 1) / 2 tokens = 1.25, gradient (V − R) / 2
    values = torch.tensor([[3.0, 0.0]], requires_grad=True)
    loss, m = value_loss(
        values, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), ValueLossConfig(clip_eps=None)
    )
    torch.testing.assert_close(loss, torch.tensor(1.25))
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[1.0, -0.5]]))
    assert m["value_clip_frac"] == 0


def test_global_normalizer_makes_micro_batch_losses_add_up():
    g = torch.Generator().manual_seed(0)
    v, v_old, r = (torch.randn(4, 6, generator=g) for _ in range(3))
    mask = torch.rand(4, 6, generator=g) > 0.3
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        cfg = ValueLossConfig(clip_eps=0.3, loss_agg=agg)
        whole, _ = value_loss(v, v_old, r, mask, cfg)
        from armor_megatron.algo import loss_normalizer

        n = loss_normalizer(mask, agg).float()
        parts = [
            value_loss(v[i : i + 2], v_old[i : i + 2], r[i : i + 2], mask[i : i + 2], cfg, normalizer=n)[0]
            for i in (0, 2)
        ]
        torch.testing.assert_close(sum(parts), whole)


def test_seq_mean_token_mean_weights_sequences_equally():
    # row 0: 2 tokens of loss 0.5·1 each -> mean 0.5; row 1: 1 token of 0.5·9 = 4.5; (0.5 + 4.5) / 2 = 2.5
    values = torch.tensor([[1.0, 1.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = value_loss(values, values, torch.zeros(2, 2), mask, ValueLossConfig(None, "seq-mean-token-mean"))
    torch.testing.assert_close(loss, torch.tensor(2.5))


def test_explained_variance_from_combined_moments_matches_the_whole_batch():
    # R = [1, 2, 3, 4], V = [1, 2, 2, 5]: R − V = [0, 0, 1, −1], Var = 0.5; Var(R) = 1.25; EV = 1 − 0.4 = 0.6
    values, returns = torch.tensor([[1.0, 2.0], [2.0, 5.0]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.ones(2, 2)
    assert explained_variance(values, returns, mask) == pytest.approx(0.6)
    calls = [
        value_loss(values[i : i + 1], values[i : i + 1], returns[i : i + 1], mask[i : i + 1], CLIP)[1] for i in (0, 1)
    ]
    assert explained_variance_from_moments(reduce_loss_metrics(calls)) == pytest.approx(0.6)
    assert math.isnan(explained_variance(values, torch.ones(2, 2), mask))  # constant returns: undefined


def test_bad_inputs_fail_with_one_clear_line():
    with pytest.raises(ValueError, match="clip_eps must be > 0"):
        ValueLossConfig(clip_eps=0.0)
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        ValueLossConfig(loss_agg="sum")
    with pytest.raises(ValueError, match=r"returns alike; got \(2, 3\) and \(2, 2\)"):
        value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3), CLIP)
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), CLIP, normalizer=0)
