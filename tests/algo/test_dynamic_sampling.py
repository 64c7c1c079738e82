import pytest
import torch

from armor_megatron.algo.dynamic_sampling import DynamicSampler, dynamic_sampling_keep
from armor_megatron.data.batch import RolloutBatch


def test_keep_only_groups_with_mixed_rewards():
    rewards = torch.tensor([[1.0, 1, 1], [0, 0, 0], [0, 1, 0], [0.5, 0.5, 0.2]])
    assert dynamic_sampling_keep(rewards).tolist() == [False, False, True, True]


def _round(group_rewards, first_id, length):
    """A group-major batch: row ids, a [rows, length] token tensor, and the rewards."""
    rewards = torch.tensor(group_rewards, dtype=torch.float32)
    n = rewards.numel()
    batch = RolloutBatch(
        {"row_id": torch.arange(first_id, first_id + n), "tokens": torch.ones(n, length)},
        {"text": [f"r{first_id + i}" for i in range(n)]},
    )
    return batch, rewards


def test_sampler_fills_target_over_rounds_and_pads():
    sampler = DynamicSampler(target_groups=3, max_rounds=3, pad_values={"tokens": 0})
    # round 1: groups [1,1] (drop) and [0,1] (keep)  -> 1 kept
    assert sampler.add(*_round([[1, 1], [0, 1]], 0, length=2)) == 1 and not sampler.done
    # round 2: [1,0] keep, [0,0] drop, [1,0] keep   -> 3 kept, done
    assert sampler.add(*_round([[1, 0], [0, 0], [1, 0]], 4, length=3)) == 2 and sampler.done
    out = sampler.take()
    assert out["row_id"].tolist() == [2, 3, 4, 5, 8, 9] and out["text"][0] == "r2"
    assert out["tokens"].shape == (6, 3) and out["tokens"][0].tolist() == [1, 1, 0]
    assert sampler.stats() == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/groups_seen": 5.0,
        "dynamic_sampling/keep_rate": 3 / 5,
    }


def test_sampler_takes_only_the_target_and_fails_loudly():
    sampler = DynamicSampler(target_groups=1)
    sampler.add(*_round([[0, 1], [1, 0]], 0, length=2))
    assert sampler.take()["row_id"].tolist() == [0, 1]

    sampler = DynamicSampler(target_groups=2, max_rounds=1)
    with pytest.raises(RuntimeError, match="only 0 of 2 groups kept"):
        sampler.take()
    sampler.add(*_round([[1, 1]], 0, length=2))
    assert sampler.take(allow_partial=True) is None
    with pytest.raises(RuntimeError, match="0 of 2 groups with mixed rewards after max_rounds=1"):
        sampler.add(*_round([[0, 1]], 2, length=2))
    assert sampler.take(allow_partial=True) is None
    sampler = DynamicSampler(target_groups=2)
    sampler.add(*_round([[0, 1], [1, 1]], 0, length=2))
    assert sampler.take(allow_partial=True)["row_id"].tolist() == [0, 1]
    with pytest.raises(ValueError, match="batch has 4 rows"):
        DynamicSampler(1).add(_round([[0, 1], [1, 0]], 0, 2)[0], torch.ones(3, 2))
