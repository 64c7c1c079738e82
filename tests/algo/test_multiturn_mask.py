"""A multi-turn response's loss mask (model tokens 1, environment tokens 0) in the ARMOR math.

Row 0 is a multi-turn response: model tokens at t = 0..2 and 5..6, an observation at t = 3..4;
row 1 a single-turn one of 4 tokens. The environment tokens carry garbage (NaN, inf, huge values:
what a tool result's positions hold is no log-probability of the policy). The mixed ratio, TIS
weights, token losses and the token-mean loss must equal a float64 hand computation over the model
tokens alone, the environment tokens get no loss and no gradient, and the loss equals that of the
same batch with the environment tokens cut out.
"""

import math

import torch

from armor_megatron.algo.loss import PolicyLossConfig, loss_normalizer, policy_loss
from armor_megatron.algo.tis import truncated_is_weights

ALPHA, EPS_LOW, EPS_HIGH, CAP = 0.9, 0.2, 0.28, 2.0
MASK = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.float32)
ENV = [(0, 3), (0, 4)]  # the observation's positions
ADV = torch.tensor([0.7, -1.3])
IS_ANCHOR = torch.tensor([False, False])


def _inputs():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(2, 7, generator=g) * 3
    old = lp + (torch.rand(2, 7, generator=g) - 0.5) * 0.8  # ratios on both sides of the clip range
    ref = lp + (torch.rand(2, 7, generator=g) - 0.5) * 2.0
    engine = old + (torch.rand(2, 7, generator=g) - 0.5) * 1.6  # some TIS weights capped
    for r, t in ENV:
        lp[r, t], old[r, t], ref[r, t], engine[r, t] = float("nan"), float("inf"), 50.0, 0.0
    return lp, old, ref, engine


def _hand(lp, old, ref, engine):
    """Per model token in float64: r_mix, the TIS weight, ℓ = w·max(−A·r, −A·clip(r)); and L = Σℓ / #tokens."""
    rows = []
    for i in range(2):
        for t in range(7):
            if not MASK[i, t]:
                continue
            a, b, c = (float(x[i, t]) for x in (lp, old, ref))
            r = (ALPHA * math.exp(a) + (1 - ALPHA) * math.exp(c)) / (ALPHA * math.exp(b) + (1 - ALPHA) * math.exp(c))
            w = min(math.exp(b - float(engine[i, t])), CAP)
            A = float(ADV[i])
            ell = w * max(-A * r, -A * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH))
            rows.append((i, t, r, w, ell))
    return rows, sum(e for *_, e in rows) / len(rows)


def test_environment_tokens_leave_ratio_tis_and_loss_to_the_model_tokens():
    lp, old, ref, engine = _inputs()
    weights, tis = truncated_is_weights(old, engine, MASK, IS_ANCHOR, cap=CAP)
    rows, expected = _hand(lp, old, ref, engine)
    assert tis["tis_num_tokens"] == 9 and 0 < tis["tis_capped_frac"] < 1
    for i, t, _, w, _ in rows:
        assert abs(float(weights[i, t]) - w) < 1e-6
    for i, t in ENV:
        assert weights[i, t] == 0.0

    cfg = PolicyLossConfig(alpha=ALPHA, eps_low=EPS_LOW, eps_high=EPS_HIGH)
    theta = lp.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        theta, old, ref, ADV, MASK, cfg, normalizer=loss_normalizer(MASK, "token-mean"), token_weights=weights
    )
    assert abs(loss.item() - expected) < 1e-6 and metrics["num_tokens"] == 9
    hand_ratios = [r for *_, r, _, _ in rows]
    assert abs(float(metrics["ratio_mean"]) - sum(hand_ratios) / 9) < 1e-6
    assert abs(float(metrics["ratio_max"]) - max(hand_ratios)) < 1e-6
    assert 0 < float(metrics["clip_frac_low"]) + float(metrics["clip_frac_high"]) < 1  # some clipped, some not
    loss.backward()
    grad = theta.grad
    assert grad is not None and torch.isfinite(grad).all()
    for i, t in ENV:
        assert grad[i, t] == 0.0
    # d loss / d lp_θ at a model token, by hand: unclipped tokens w·(−A)·∂r/∂lp_θ / 9, clipped ones 0
    for i, t, r, w, _ in rows:
        a, c, A = float(lp[i, t]), float(ref[i, t]), float(ADV[i])
        dr = ALPHA * math.exp(a) / (ALPHA * math.exp(float(old[i, t])) + (1 - ALPHA) * math.exp(c))
        clipped = (A > 0 and r > 1 + EPS_HIGH) or (A < 0 and r < 1 - EPS_LOW)
        assert abs(float(grad[i, t]) - (0.0 if clipped else -A * w * dr / 9)) < 1e-6

    # the same batch with the observation cut out: the same loss, up to fp32 summation order
    keep = MASK.bool()
    row0 = [t for t in range(7) if keep[0, t]]
    compact = [torch.stack([x[0, row0], x[1, :5]]) for x in (lp, old, ref, engine)]
    cmask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.float32)
    cweights, _ = truncated_is_weights(compact[1], compact[3], cmask, IS_ANCHOR, cap=CAP)
    closs, _ = policy_loss(compact[0], compact[1], compact[2], ADV, cmask, cfg, token_weights=cweights)
    assert abs(closs.item() - loss.item()) < 1e-6
