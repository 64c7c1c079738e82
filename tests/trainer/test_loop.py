"""Pure helpers of the loop (trainer/loop.py)."""

from armor_megatron.trainer.loop import _merge_rounds


def test_rollout_rounds_merge_anchor_rates_and_sum_generation_costs():
    rounds = [
        {"rollout/accuracy": 0.5, "rollout/generated_tokens": 100.0, "anchor/found_rate": 0.0, "anchor/tries": 8.0},
        {"rollout/accuracy": 0.9, "rollout/generated_tokens": 60.0, "anchor/found_rate": 1.0, "anchor/tries": 4.0},
    ]
    merged = _merge_rounds(rounds)
    assert merged["rollout/accuracy"] == 0.5  # the first round describes the policy
    assert merged["anchor/found_rate"] == 0.5 and merged["anchor/tries"] == 12.0
    assert merged["rollout/generated_tokens"] == 160.0
