import math

import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig, policy_loss
from armor_megatron.algo.tis import truncated_is_weights


def _reference(old, engine, mask, is_anchor, cap):
    """float64, element by element: min(π_old/π_engine, C) on on-policy tokens, 1 on anchors, 0 on padding."""
    out = []
    for i, (row_old, row_engine, row_mask) in enumerate(zip(old, engine, mask)):
        row = []
        for lo, le, m in zip(row_old, row_engine, row_mask):
            if not m:
                row.append(0.0)
            elif is_anchor[i]:
                row.append(1.0)
            else:
                row.append(min(math.exp(lo) / math.exp(le), cap))
        out.append(row)
    return out


def test_weights_and_metrics_match_a_float64_hand_computation():
    g = torch.Generator().manual_seed(11)
    old = -3 * torch.rand(4, 6, generator=g)
    engine = old + 0.8 * torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    is_anchor = torch.tensor([False, False, True, False])
    cap = 1.5
    weights, m = truncated_is_weights(old, engine, mask, is_anchor, cap=cap)
    expected = _reference(old.double().tolist(), engine.double().tolist(), mask.tolist(), is_anchor.tolist(), cap)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)

    on_policy = [w for i, row in enumerate(expected) for w, m_ in zip(row, mask[i].tolist()) if m_ and not is_anchor[i]]
    raw = [
        math.exp(lo - le)
        for i in range(4)
        for lo, le, m_ in zip(old[i].double().tolist(), engine[i].double().tolist(), mask[i].tolist())
        if m_ and not is_anchor[i]
    ]
    assert len(on_policy) == 6 + 4 + 2
    torch.testing.assert_close(m["tis_weight_mean"].double(), torch.tensor(math.fsum(on_policy) / 12).double())
    torch.testing.assert_close(m["tis_weight_max"].double(), torch.tensor(max(on_policy)).double())
    assert 0 < sum(r > cap for r in raw) < 12
    torch.testing.assert_close(m["tis_capped_frac"], torch.tensor(sum(r > cap for r in raw) / 12))
    assert m["tis_num_tokens"] == 12


def test_no_gradient_through_the_weights_and_extreme_log_probs_stay_finite():
    old = torch.tensor([[0.0, -200.0, -1.0, float("nan")]], requires_grad=True)
    engine = torch.tensor([[-200.0, 0.0, -float("inf"), 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, _ = truncated_is_weights(old, engine, mask, torch.tensor([False]), cap=2.0)
    assert not weights.requires_grad
    # e^200 capped at 2, e^-200 underflows to 0, π_engine = 0 -> capped, padding NaN ignored
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0, 2.0, 0.0]]))


def test_anchor_rows_and_no_on_policy_tokens():
    old, engine = torch.zeros(2, 3), torch.full((2, 3), -5.0)
    weights, m = truncated_is_weights(old, engine, torch.ones(2, 3), torch.tensor([True, True]), cap=2.0)
    assert torch.equal(weights, torch.ones(2, 3))
    assert m["tis_weight_mean"] == 0 and m["tis_num_tokens"] == 0 and m["tis_capped_frac"] == 0


def test_weights_plug_into_the_policy_loss():
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    engine = torch.log(torch.tensor([[0.25, 0.5]]))  # ratios 2 (capped to 1.5) and 0.5
    weights, _ = truncated_is_weights(old, engine, torch.ones(1, 2), torch.tensor([False]), cap=1.5)
    logp = old.clone().requires_grad_(True)  # r = 1: ℓ = −A·w
    loss, _ = policy_loss(
        logp, old, None, torch.tensor([2.0]), torch.ones(1, 2), PolicyLossConfig(), token_weights=weights
    )
    torch.testing.assert_close(loss, torch.tensor(-(2.0 * 1.5 + 2.0 * 0.5) / 2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cap": 0.0}, "TIS cap must be a finite number > 0, got 0.0"),
        ({"cap": float("inf")}, "TIS cap must be a finite number > 0"),
        ({"is_anchor": torch.zeros(3, dtype=torch.bool)}, r"is_anchor must be \[B\]=\(2,\), got \(3,\)"),
        ({"engine_logp": torch.zeros(2, 4)}, "must share one"),
        ({"engine_logp": torch.full((2, 3), float("nan"))}, "NaN log-probs on 6 on-policy response token"),
    ],
)
def test_bad_inputs_are_one_line_errors(kwargs, match):
    args = {
        "old_logp": torch.zeros(2, 3),
        "engine_logp": torch.zeros(2, 3),
        "mask": torch.ones(2, 3),
        "is_anchor": torch.zeros(2, dtype=torch.bool),
        "cap": 2.0,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        truncated_is_weights(**args)
