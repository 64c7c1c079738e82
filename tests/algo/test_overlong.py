import pytest
import torch

from armor_megatron.algo.overlong import apply_overlong_shaping, overlong_penalty


def test_soft_overlong_penalty_piecewise():
    # L_max = 20, L_cache = 4: free up to 16 tokens, then −(|y| − 16)/4, −1 from 20 on.
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    torch.testing.assert_close(overlong_penalty(lengths, 20, 4), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(
        overlong_penalty(lengths, 20, 4, penalty_factor=0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    )


def test_shaping_adds_to_rewards():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    lengths = torch.tensor([[18, 18], [5, 20]])
    torch.testing.assert_close(apply_overlong_shaping(rewards, lengths, 20, 4), torch.tensor([[0.5, -0.5], [1.0, 0.0]]))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), 20, 0)
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(torch.tensor([1]), 20, 21)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(torch.tensor([1]), 20, 4, penalty_factor=-1)
    with pytest.raises(ValueError, match="differ in shape"):
        apply_overlong_shaping(torch.ones(2), torch.ones(3), 20, 4)
