import math

import pytest
import torch

from armor_megatron.algo.loss import PolicyLossConfig, loss_normalizer, policy_loss

PPO = PolicyLossConfig(alpha=1.0, eps_low=0.2, eps_high=0.28)


def _logps_with_ratios(ratios):
    """(logp with grad, old_logp) whose PPO ratio is ``ratios``: old = log 0.5, lp = old + log r."""
    r = torch.tensor(ratios, dtype=torch.float32)
    old = torch.full_like(r, math.log(0.5))
    return (old + r.log()).requires_grad_(True), old


def test_hand_computed_clipped_surrogate_and_gradient():
    # seq 0 (A = +1): r = 1.5 -> max(−1.5, −1.28) = −1.28 (clipped high, no grad)
    #                 r = 0.5 -> max(−0.5, −0.8)  = −0.5  (A > 0 below 1−ε: not clipped)
    # seq 1 (A = −1): r = 1.1 -> max(1.1, 1.1)    = 1.1   (inside)
    #                 r = 0.7 -> max(0.7, 0.8)    = 0.8   (clipped low, no grad)
    # token-mean: (−1.28 − 0.5 + 1.1 + 0.8) / 4 = 0.03
    logp, old = _logps_with_ratios([[1.5, 0.5], [1.1, 0.7]])
    loss, m = policy_loss(logp, old, None, torch.tensor([1.0, -1.0]), torch.ones(2, 2), PPO)
    torch.testing.assert_close(loss, torch.tensor(0.03))
    loss.backward()
    # ∂ℓ/∂lp = −A·r / N where unclipped (∂r/∂lp = r), 0 where clipped.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 4], [1.1 / 4, 0.0]]))
    assert m["clip_frac_high"] == 0.25 and m["clip_frac_low"] == 0.25 and m["dual_clip_frac"] == 0
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(3.8 / 4))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(1.5))
    assert m["num_tokens"] == 4 and "approx_kl_ref" not in m


@pytest.mark.parametrize("alpha", [0.875, 0.9375])
def test_armor_gradient_is_mixture_share_times_ratio_term(alpha):
    """∂L/∂lp_θ = α·π_θ/(α·π_θ+(1−α)·π_ref) · (−A·r_mix/N) where r_mix is unclipped, 0 where clipped."""
    g = torch.Generator().manual_seed(0)
    old = -3 * torch.rand(4, 32, generator=g)
    ref = -6 * torch.rand(4, 32, generator=g)
    logp = (old + 0.6 * torch.randn(4, 32, generator=g)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])
    cfg = PolicyLossConfig(alpha=alpha)
    loss, _ = policy_loss(logp, old, ref, adv, torch.ones(4, 32), cfg)
    loss.backward()

    p, p_old, p_ref = logp.detach().double().exp(), old.double().exp(), ref.double().exp()
    r_mix = (alpha * p + (1 - alpha) * p_ref) / (alpha * p_old + (1 - alpha) * p_ref)
    share = alpha * p / (alpha * p + (1 - alpha) * p_ref)
    a = adv.double()[:, None].expand_as(r_mix)
    clipped = ((a > 0) & (r_mix > 1.28)) | ((a < 0) & (r_mix < 0.8))
    assert clipped.any() and (~clipped).any()
    expected = torch.where(clipped, 0.0, share * (-a * r_mix) / r_mix.numel())
    torch.testing.assert_close(logp.grad.double(), expected, rtol=1e-4, atol=1e-8)


def test_token_mean_weights_tokens_not_sequences():
    # r = 1 everywhere, so ℓ = −A per token. seq 0 has 3 tokens with A = 1, 2, 3; seq 1 has one
    # token with A = 6 and two padding positions.
    #   token-mean          −(1+2+3+6)/4   = −3
    #   seq-mean-token-mean −(2 + 6)/2     = −4
    #   seq-mean-token-sum  −(6 + 6)/2     = −6
    lp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, 3.0], [6.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    for agg, expected in [("token-mean", -3.0), ("seq-mean-token-mean", -4.0), ("seq-mean-token-sum", -6.0)]:
        loss, _ = policy_loss(lp, lp.detach(), None, adv, mask, PPO.replace(loss_agg=agg))
        torch.testing.assert_close(loss, torch.tensor(expected), msg=agg)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_global_normalizer_makes_micro_batch_sums_equal_the_global_loss(agg):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 7
    old, ref = -2 * torch.rand(B, T, generator=g), -2 * torch.rand(B, T, generator=g)
    base = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([7, 1, 4, 0, 5, 2])  # row 3 is an all-padding row
    mask = torch.arange(T)[None, :] < lengths[:, None]
    cfg = PolicyLossConfig(alpha=0.9, loss_agg=agg, dual_clip_c=3.0)

    full = base.clone().requires_grad_(True)
    loss_full, _ = policy_loss(full, old, ref, adv, mask, cfg)
    loss_full.backward()

    parts = [slice(0, 2), slice(2, 5), slice(5, 6)]
    normalizer = sum(loss_normalizer(mask[s], agg) for s in parts)  # the "all-reduced" count
    assert normalizer == (mask.sum() if agg == "token-mean" else 5)
    micro = base.clone().requires_grad_(True)
    total = sum(policy_loss(micro[s], old[s], ref[s], adv[s], mask[s], cfg, normalizer=normalizer)[0] for s in parts)
    total.backward()
    torch.testing.assert_close(total, loss_full)
    torch.testing.assert_close(micro.grad, full.grad)


def test_dual_clip_bounds_negative_advantages():
    # A = −1: r = 5 -> PPO loss max(5, 1.28) = 5, dual-clip min(5, c=3) = 3, gradient 0;
    #         r = 2 -> 2 < 3 unchanged, gradient −A·r/N = 2/3.
    # A = +1: r = 5 -> clipped high at −1.28 as usual (dual-clip is for A < 0 only).
    logp, old = _logps_with_ratios([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    cfg = PPO.replace(dual_clip_c=3.0)
    loss, m = policy_loss(logp, old, None, adv, torch.ones(1, 3), cfg)
    torch.testing.assert_close(loss, torch.tensor((3.0 + 2.0 - 1.28) / 3))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    torch.testing.assert_close(m["dual_clip_frac"], torch.tensor(1 / 3))
    torch.testing.assert_close(m["clip_frac_high"], torch.tensor(1 / 3))
    no_dual, _ = policy_loss(logp, old, None, adv, torch.ones(1, 3), PPO)
    torch.testing.assert_close(no_dual, torch.tensor((5.0 + 2.0 - 1.28) / 3))


def test_kl_entropy_metrics_and_padding_is_ignored():
    # token 0: π_θ/π_old = 2 -> k3 = 2 − 1 − log 2;  π_ref/π_θ = 0.5 -> k3 = 0.5 − 1 − log 0.5
    # token 1: identical policies -> 0.  Padding holds garbage (−inf, huge) that must not leak.
    logp = torch.tensor([[math.log(0.4), math.log(0.3), float("-inf")]], requires_grad=True)
    old = torch.tensor([[math.log(0.2), math.log(0.3), 0.0]])
    ref = torch.tensor([[math.log(0.2), math.log(0.3), 50.0]])
    entropy = torch.tensor([[1.0, 3.0, 1000.0]])
    mask = torch.tensor([[True, True, False]])
    loss, m = policy_loss(logp, old, ref, torch.tensor([1.0]), mask, PPO, entropy=entropy)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    torch.testing.assert_close(m["approx_kl_old"], torch.tensor((1 - math.log(2)) / 2))
    torch.testing.assert_close(m["approx_kl_ref"], torch.tensor((-0.5 + math.log(2)) / 2))
    torch.testing.assert_close(m["entropy"], torch.tensor(2.0))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(2.0))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(1.0))
    assert all(not v.requires_grad and v.dim() == 0 for v in m.values())


def test_alpha_one_with_reference_equals_ppo_without():
    g = torch.Generator().manual_seed(2)
    old, ref = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    logp = old + 0.4 * torch.randn(3, 5, generator=g)
    adv, mask = torch.randn(3, generator=g), torch.ones(3, 5)
    a, _ = policy_loss(logp, old, ref, adv, mask, PPO)
    b, _ = policy_loss(logp, old, None, adv, mask, PPO)
    assert torch.equal(a, b)


def test_empty_mask_gives_zero_loss_and_zero_metrics():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(logp, logp.detach(), None, torch.ones(2), torch.zeros(2, 3), PPO)
    assert loss == 0 and all(v == 0 for v in m.values())


def test_bf16_inputs_give_fp32_loss():
    logp = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(logp, logp.detach(), None, torch.ones(2), torch.ones(2, 3), PPO)
    assert loss.dtype == torch.float32
    loss.backward()
    assert logp.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(alpha=0.0), "alpha"),
        (dict(alpha=1.2), "alpha"),
        (dict(eps_low=0.0), "eps_low"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(dual_clip_c=1.0), "dual_clip_c"),
        (dict(loss_agg="seq-mean"), "loss_agg"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PolicyLossConfig(**kwargs)


def test_bad_inputs_raise():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="ref_logp is required"):
        policy_loss(x, x, None, torch.ones(2), x, PolicyLossConfig(alpha=0.9))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, None, torch.ones(3), x, PPO)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(x, x, None, torch.ones(2), torch.ones(2, 4), PPO)
    with pytest.raises(ValueError, match=r"logp must be \[B, T\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), None, torch.ones(3), torch.ones(3), PPO)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(x, x, None, torch.ones(2), x, PPO, normalizer=0)


# --- masked positions, the log-ratio clamp, token weights, the registry -------------------------


@pytest.mark.parametrize("alpha", [1.0, 0.9])
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_at_masked_positions_touch_neither_loss_nor_gradient(alpha, garbage):
    g = torch.Generator().manual_seed(3)
    old = -2 * torch.rand(2, 5, generator=g)
    ref = -2 * torch.rand(2, 5, generator=g)
    lp = old + 0.3 * torch.randn(2, 5, generator=g)
    adv = torch.tensor([[1.0] * 5, [-0.5] * 5])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    cfg = PolicyLossConfig(alpha=alpha)

    def run(fill):
        tensors = [t.clone() for t in (lp, old, ref, adv)]
        for t in tensors:
            t[~mask] = fill
        logp = tensors[0].requires_grad_(True)
        loss, m = policy_loss(logp, tensors[1], tensors[2], tensors[3], mask, cfg, entropy=tensors[1].abs())
        loss.backward()
        return loss, logp.grad, m

    clean_loss, clean_grad, clean_m = run(0.0)
    loss, grad, m = run(garbage)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert torch.equal(loss, clean_loss) and torch.equal(grad, clean_grad)
    assert torch.equal(grad[~mask], torch.zeros(int((~mask).sum())))
    assert all(torch.isfinite(v) for v in m.values())


def test_log_ratio_clamp_pins_the_documented_behaviour():
    # one sequence, A = −1, log r = 25 (clamped), 19 (not), −25 (clamped, A < 0 -> clipped low anyway)
    old = torch.full((1, 3), -30.0)
    logp = (old + torch.tensor([[25.0, 19.0, -25.0]])).requires_grad_(True)
    loss, m = policy_loss(logp, old, None, torch.tensor([-1.0]), torch.ones(1, 3), PPO)
    loss.backward()
    # ℓ = −A·r for r > 1: e^20 (the clamp's constant, not e^25) and e^19; clipped low: −A·0.8
    expected = (math.exp(20.0) + math.exp(19.0) + 0.8) / 3
    torch.testing.assert_close(loss.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0)
    # gradient: 0 where clamped (the paper's would be e^25/3), −A·r/N = e^19/3 where not, 0 where clipped
    torch.testing.assert_close(
        logp.grad.double(), torch.tensor([[0.0, math.exp(19.0) / 3, 0.0]], dtype=torch.float64), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(m["log_ratio_clamped_frac"], torch.tensor(2 / 3))


def test_token_weights_scale_each_token_loss_without_gradient():
    # r = 1 everywhere so ℓ = −A; weights w: L = Σ w·(−A) / N
    logp = torch.full((2, 2), -1.0, requires_grad=True)
    weights = torch.tensor([[0.5, 2.0], [1.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = policy_loss(logp, logp.detach(), None, torch.tensor([1.0, -2.0]), mask, PPO, token_weights=weights)
    torch.testing.assert_close(loss, torch.tensor((-0.5 - 2.0 + 2.0) / 3))
    loss.backward()
    assert weights.grad is None
    # ∂ℓ/∂lp = −A·r·w / N (r = 1, inside the clip range)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5 / 3, -2.0 / 3], [2.0 / 3, 0.0]]))
    with pytest.raises(ValueError, match=r"token_weights has shape \(2,\)"):
        policy_loss(logp, logp.detach(), None, torch.ones(2), mask, PPO, token_weights=torch.ones(2))


def test_policy_loss_registry():
    from armor_megatron.algo.loss import POLICY_LOSSES, get_policy_loss, make_policy_loss_config, register_policy_loss

    assert get_policy_loss("armor") is policy_loss
    cfg = make_policy_loss_config("armor", alpha=0.9, eps_high=0.3)
    assert cfg == PolicyLossConfig(alpha=0.9, eps_high=0.3)
    with pytest.raises(ValueError, match=r"^unknown policy loss 'armr' \(did you mean 'armor'\?\); known: armor"):
        get_policy_loss("armr")
    with pytest.raises(ValueError, match=r"policy loss 'armor' takes no beta; its config fields: alpha, eps_low"):
        make_policy_loss_config("armor", beta=0.1)

    @register_policy_loss("test-reinforce", config=PolicyLossConfig)
    def reinforce(
        logp, old_logp, ref_logp, advantages, mask, cfg, *, normalizer=None, entropy=None, token_weights=None
    ):
        from armor_megatron.algo.loss import aggregate_token_loss

        token_loss = -advantages.float().unsqueeze(-1) * logp
        return aggregate_token_loss(token_loss, mask, cfg.loss_agg, normalizer), {}

    try:
        loss, _ = get_policy_loss("test-reinforce")(
            torch.zeros(1, 2), torch.zeros(1, 2), None, torch.ones(1), torch.ones(1, 2), PPO
        )
        assert loss == 0
    finally:
        POLICY_LOSSES.unregister("test-reinforce")
