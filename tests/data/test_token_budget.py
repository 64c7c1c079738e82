"""Token-budget batching: Karmarkar–Karp balancing, first-fit-decreasing packing, the per-rank plan."""

import random

import pytest

from armor_megatron.data.token_budget import balanced_partition, pack_by_tokens, token_budget_plan


def _dapo_like_lengths(n: int, seed: int, longest: int = 2048) -> list[int]:
    """Prompt 50–500 plus a long-tailed response, a third truncated at the maximum."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        response = longest if rng.random() < 0.33 else min(longest, int(50 + rng.expovariate(1 / 500)))
        out.append(rng.randint(50, 500) + response)
    return out


def _lpt(lengths, parts):
    """Greedy: longest first onto the lightest part (the baseline KK must beat)."""
    loads = [0] * parts
    for n in sorted(lengths, reverse=True):
        loads[loads.index(min(loads))] += n
    return max(loads) - min(loads)


def test_partition_covers_every_row_once_and_is_deterministic():
    lengths = _dapo_like_lengths(37, seed=1)
    parts = balanced_partition(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(37))
    assert all(p == sorted(p) for p in parts)
    assert balanced_partition(lengths, 4) == parts


@pytest.mark.parametrize("seed", range(5))
def test_partition_spread_beats_greedy_and_stays_below_the_longest_row(seed):
    lengths = _dapo_like_lengths(64, seed=seed)
    sums = [sum(lengths[i] for i in p) for p in balanced_partition(lengths, 8)]
    spread = max(sums) - min(sums)
    assert spread <= _lpt(lengths, 8)
    assert spread < max(lengths)


def test_partition_known_optimum_and_edge_cases():
    values = [8, 7, 6, 5, 4]
    sums = sorted(sum(values[i] for i in p) for p in balanced_partition(values, 2))
    assert sums == [14, 16]  # the textbook KK result (differences 1, 1, 4 -> 2); greedy LPT ends 13 / 17
    assert _lpt(values, 2) == 4
    assert balanced_partition([], 3) == [[], [], []]
    assert sorted(map(len, balanced_partition([5, 3], 4))) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="parts must be >= 1"):
        balanced_partition([1], 0)


def test_packing_respects_the_budget_and_its_multiple():
    lengths = _dapo_like_lengths(50, seed=2)
    for multiple in (1, 2, 8):
        bins = pack_by_tokens(lengths, 4096, multiple)
        assert sorted(i for b in bins for i in b) == list(range(50))
        for b in bins:
            total = sum(lengths[i] for i in b)
            assert -(-total // multiple) * multiple <= 4096
        # first-fit decreasing leaves at most one bin at most half full
        assert sum(sum(lengths[i] for i in b) <= 2048 for b in bins) <= 1


def test_packing_refuses_a_row_longer_than_the_budget():
    with pytest.raises(ValueError, match="a 100-token sequence exceeds max_tokens_per_micro_batch=99"):
        pack_by_tokens([10, 100], 99)
    with pytest.raises(ValueError, match=r"rounded down to a multiple of 8: 96"):
        pack_by_tokens([97], 100, 8)


def test_plan_gives_every_rank_as_many_micro_batches():
    lengths = _dapo_like_lengths(13, seed=3)
    plan = token_budget_plan(lengths, 3000, dp=4, multiple=2)
    assert len({len(rank) for rank in plan}) == 1
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(13))
    tokens = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(tokens) - min(tokens) < max(lengths)
    # fewer rows than ranks: empty ranks run fillers
    assert token_budget_plan([5], 10, dp=3) == [[[0]], [[]], [[]]]
