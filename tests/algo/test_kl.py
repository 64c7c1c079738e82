import math

import pytest
import torch

from armor_megatron.algo.kl import kl_estimate
from armor_megatron.algo.loss import PolicyLossConfig, policy_loss

# lp_θ, lp_ref of four tokens: d = lp_θ − lp_ref = 0.5, −0.25, 0, 2
LOGP = [math.log(0.5), math.log(0.2), math.log(0.9), math.log(0.6)]
REF = [math.log(0.5) - 0.5, math.log(0.2) + 0.25, math.log(0.9), math.log(0.6) - 2.0]


def _by_hand(estimator: str, d: float) -> tuple[float, float]:
    """(k, ∂k/∂d) in float64 from the definitions, r = π_ref/π_θ = e^−d."""
    r = math.exp(-d)
    return {
        "k1": (d, 1.0),
        "k2": (0.5 * d * d, d),
        "k3": (r - 1.0 - math.log(r), 1.0 - r),
    }[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimates_and_gradients_match_float64_hand_computation(estimator):
    logp = torch.tensor(LOGP, requires_grad=True)
    k = kl_estimate(logp, torch.tensor(REF), estimator)
    k.sum().backward()
    expected = [_by_hand(estimator, d) for d in (0.5, -0.25, 0.0, 2.0)]
    assert k.dtype == torch.float32
    torch.testing.assert_close(
        k.double(), torch.tensor([e[0] for e in expected], dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        logp.grad.double(), torch.tensor([e[1] for e in expected], dtype=torch.float64), rtol=1e-6, atol=1e-6
    )


def test_k1_and_k3_are_unbiased_and_k2_k3_positive_unless_the_policies_agree():
    # Sampling y ~ π_θ over 3 outcomes: E[k1] = E[k3] = KL(π_θ‖π_ref) exactly; k2, k3 > 0 on every
    # token where the log-probs differ, and exactly 0 where they agree.
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    kl = float((p * (p / q).log()).sum())
    for est in ("k1", "k3"):
        assert float((p * kl_estimate(p.log(), q.log(), est).double()).sum()) == pytest.approx(kl, rel=1e-6)
    for est in ("k2", "k3"):
        assert (kl_estimate(p.log(), q.log(), est) > 0).all()
        assert kl_estimate(p.log(), p.log(), est).eq(0).all()


def test_k3_stays_finite_for_a_far_away_token():
    k = kl_estimate(torch.tensor([-1.0, -100.0]), torch.tensor([-100.0, -1.0]), "k3")
    assert torch.isfinite(k).all()


def test_unknown_estimator_and_shape_mismatch_are_refused():
    with pytest.raises(ValueError, match="one of k1, k2, k3"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "low_var")
    with pytest.raises(ValueError, match="differ in shape"):
        kl_estimate(torch.zeros(2), torch.zeros(3), "k1")
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        PolicyLossConfig(kl_coef=-0.1)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_policy_loss_adds_beta_times_the_estimate_aggregated_like_the_loss(agg, estimator):
    # Two sequences, three and one valid tokens (a NaN on padding must not leak); ratio 1 everywhere
    # (lp_old = lp_θ) so the surrogate is −A per token.
    beta = 0.05
    logp = torch.tensor([[LOGP[0], LOGP[1], LOGP[2]], [LOGP[3], float("nan"), 0.0]], requires_grad=True)
    ref = torch.tensor([[REF[0], REF[1], REF[2]], [REF[3], float("nan"), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    cfg = PolicyLossConfig(alpha=1.0, loss_agg=agg, kl_coef=beta, kl_estimator=estimator)
    loss, m = policy_loss(logp, logp.detach(), ref, adv, mask, cfg)
    loss.backward()

    k = [[_by_hand(estimator, d) for d in (0.5, -0.25, 0.0)], [_by_hand(estimator, 2.0)]]
    surrogate = [[-1.0] * 3, [2.0]]  # −A·r, r = 1
    if agg == "token-mean":  # Σ over tokens / 4 tokens
        total = sum(s + beta * e[0] for rs, row in zip(surrogate, k) for s, e in zip(rs, row)) / 4
        grad_scale = [[1 / 4] * 3, [1 / 4]]
    elif agg == "seq-mean-token-mean":  # per-sequence means / 2 sequences
        total = sum(sum(s + beta * e[0] for s, e in zip(rs, row)) / len(row) for rs, row in zip(surrogate, k)) / 2
        grad_scale = [[1 / 6] * 3, [1 / 2]]
    else:  # per-sequence sums / 2 sequences
        total = sum(s + beta * e[0] for rs, row in zip(surrogate, k) for s, e in zip(rs, row)) / 2
        grad_scale = [[1 / 2] * 3, [1 / 2]]
    assert float(loss.detach()) == pytest.approx(total, rel=1e-5, abs=1e-6)
    # ∂/∂lp_θ: the surrogate's −A·r (r = e^{lp−lp_old}, ∂r/∂lp = r = 1) plus β·∂k/∂d, times the aggregation weight
    for i, (rs, row) in enumerate(zip(surrogate, k)):
        for t, (s, e) in enumerate(zip(rs, row)):
            assert float(logp.grad[i, t]) == pytest.approx((s + beta * e[1]) * grad_scale[i][t], rel=1e-5, abs=1e-6)
    assert logp.grad[1, 1:].eq(0).all()
    # the metric: the token mean of the estimate over valid tokens
    assert float(m["kl_loss"]) == pytest.approx(sum(e[0] for row in k for e in row) / 4, rel=1e-5, abs=1e-6)


def test_no_penalty_leaves_the_loss_as_it_was_and_reports_no_kl_loss():
    logp = torch.tensor([LOGP], requires_grad=True)
    ref = torch.tensor([REF])
    args = (logp, logp.detach() - 0.1, ref, torch.tensor([1.0]), torch.ones(1, 4))
    plain, m = policy_loss(*args, PolicyLossConfig(alpha=1.0))
    with_kl, m_kl = policy_loss(*args, PolicyLossConfig(alpha=1.0, kl_coef=0.1, kl_estimator="k1"))
    # k1 = d = 0.5 − 0.25 + 0 + 2 over 4 tokens: token mean 0.5625, β times it added
    assert "kl_loss" not in m and float((with_kl - plain).detach()) == pytest.approx(0.1 * 0.5625, rel=1e-5)
    assert float(m_kl["kl_loss"]) == pytest.approx(0.5625, rel=1e-5)


def test_penalty_needs_the_reference_logprobs():
    logp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logp is required when alpha < 1 or kl_coef > 0"):
        policy_loss(logp, logp, None, torch.tensor([1.0]), torch.ones(1, 2), PolicyLossConfig(kl_coef=0.1))
