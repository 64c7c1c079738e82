"""GAE targets from the critic's values (trainer/advantages.py)."""

import math
import os

import pytest
import torch

from armor_megatron.config import load_config
from armor_megatron.trainer.advantages import gae_targets

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO_CONFIG = os.path.join(ROOT, "configs", "tiny_cpu_ppo.yaml")


def _batch():
    # one prompt token (t = 0), response tokens at t = 1, 2; the position 3 is padding
    return {
        "response_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
        "rewards": torch.tensor([1.0]),
        "old_values": torch.tensor([[9.0, 0.5, 0.25, 9.0]]),
    }


def test_gae_targets_by_hand():
    # γ = 1, λ = 0.95, reward 1 on the last response token (t = 2), V after it = 0:
    #   t = 2: δ = 1 + 0 − 0.25 = 0.75                      A = 0.75,                   R = 1.0
    #   t = 1: δ = 0 + 0.25 − 0.5 = −0.25, A = −0.25 + 0.95·0.75 = 0.4625,        R = 0.9625
    # the values 9.0 outside the response never enter
    cfg = load_config(PPO_CONFIG, ["critic.whiten_advantages=false"])
    adv, ret = gae_targets(_batch(), cfg)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.4625, 0.75, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.9625, 1.0, 0.0]]))


def test_gae_targets_whitened():
    # two advantages whitened with the Bessel std: ∓1/√2; the returns are not whitened
    cfg = load_config(PPO_CONFIG)
    adv, ret = gae_targets(_batch(), cfg)
    h = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[0.0, -h, h, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.9625, 1.0, 0.0]]))


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.5, 0.0)])
def test_gae_targets_follow_algorithm_gamma_and_lambda(gamma, lam):
    overrides = [f"algorithm.gamma={gamma}", f"algorithm.lam={lam}", "critic.whiten_advantages=false"]
    cfg = load_config(PPO_CONFIG, overrides)
    adv, _ = gae_targets(_batch(), cfg)
    # λ = 1, γ = 1: A_1 = reward − V_1 = 0.5.  λ = 0: A_1 = δ_1 = γ·V_2 − V_1 = 0.125 − 0.5 = −0.375
    expected = 0.5 if lam == 1.0 else -0.375
    assert adv[0, 1].item() == pytest.approx(expected)


def test_group_advantages_come_from_the_shaped_rewards_not_the_accuracy():
    """Overlong shaping that differs within a group changes the advantages; the accuracy alone would not."""
    from armor_megatron.algo import compute_advantages
    from armor_megatron.data.batch import RolloutBatch
    from armor_megatron.rollout.engine import SamplingParams
    from armor_megatron.trainer.advantages import group_advantages
    from armor_megatron.trainer.rollout_phase import RolloutSettings

    accuracy = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    rewards = accuracy - torch.tensor([0.0, 0.5, 0.0, 0.25, 0.0, 0.0, 0.75, 0.0])  # overlong penalties
    batch = RolloutBatch()
    batch["rewards"], batch["accuracy"] = rewards, accuracy
    batch["is_anchor"] = torch.tensor([True, False, False, False, True, False, False, False])
    settings = RolloutSettings(group_size=4, sampling=SamplingParams(max_new_tokens=4), estimator="dapo")
    batch, metrics = group_advantages(batch, settings)
    shaped = compute_advantages("dapo", rewards=rewards.view(2, 4)).reshape(-1)
    assert torch.equal(batch["advantages"], shaped.float())
    assert not torch.allclose(shaped, compute_advantages("dapo", rewards=accuracy.view(2, 4)).reshape(-1))
    assert metrics == {"anchor/zero_advantage_rate": 0.0}
