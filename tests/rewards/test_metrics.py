import math
from itertools import combinations

import pytest

from armor_megatron.rewards import avg_at_k, flatten_metrics, group_metrics, metrics_by_dataset, pass_at_k


def closed_form(n, c, k):
    return 1 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize(
    "n, c, k",
    [
        (1, 1, 1),
        (2, 1, 1),
        (5, 2, 2),
        (10, 3, 1),
        (10, 3, 5),
        (16, 4, 8),
        (16, 1, 16),
        (64, 7, 10),
        (100, 50, 20),
        (1024, 3, 64),
    ],
)
def test_matches_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(closed_form(n, c, k), rel=1e-12, abs=1e-15)


def test_hand_computed_values():
    # n=4, c=1, k=2: of the C(4,2)=6 pairs, the 3 without the correct sample fail -> 1 - 3/6
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # k=1 is the fraction correct
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # brute force over all k-subsets of a concrete sample list
    samples = [1, 0, 0, 1, 0, 0, 0]
    hits = [any(samples[i] for i in subset) for subset in combinations(range(7), 3)]
    assert pass_at_k(7, 2, 3) == pytest.approx(sum(hits) / len(hits))


def test_edge_cases():
    assert pass_at_k(10, 0, 5) == 0.0  # nothing correct
    assert pass_at_k(10, 10, 1) == 1.0  # everything correct
    assert pass_at_k(10, 6, 5) == 1.0  # n - c = 4 < k = 5: every 5-subset holds a correct one
    assert pass_at_k(10, 5, 6) == 1.0
    # huge n: the product form stays finite where the binomials overflow a float
    assert pass_at_k(100_000, 1, 1) == pytest.approx(1e-5)
    assert 0.0 < pass_at_k(5000, 2, 2500) < 1.0


@pytest.mark.parametrize(
    "args, error",
    [
        ((0, 0, 1), ValueError),
        ((5, 6, 1), ValueError),
        ((5, -1, 1), ValueError),
        ((5, 2, 0), ValueError),
        ((5, 2, 6), ValueError),
        ((5.0, 2, 1), TypeError),
        ((5, True, 1), TypeError),
    ],
)
def test_bad_arguments(args, error):
    with pytest.raises(error):
        pass_at_k(*args)


def test_avg_at_k():
    assert avg_at_k([1, 0, 0, 1]) == 0.5
    assert avg_at_k([True, False]) == 0.5
    # per prompt: mean of (1/2, 1) -> 0.75, prompts weigh equally
    assert avg_at_k([[1, 0], [1, 1, 1]]) == 0.75
    with pytest.raises(ValueError, match="no scores"):
        avg_at_k([])
    with pytest.raises(TypeError, match="sequence of numbers"):
        avg_at_k(["1", "0"])


def test_group_metrics():
    groups = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    out = group_metrics(groups, ks=(1, 2, 4))
    assert out["num_prompts"] == 3.0
    assert out["avg@4"] == pytest.approx((0.25 + 0.5 + 0) / 3)
    # pass@2 per prompt: c=1 -> 1 - C(3,2)/C(4,2) = 0.5; c=2 -> 1 - 1/6; c=0 -> 0
    assert out["pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert out["pass@1"] == pytest.approx(out["avg@4"])
    # threshold: a weighted reward of 0.9 counts as correct only when threshold <= 0.9
    assert group_metrics([[0.9, 0.1]], ks=(1,), threshold=0.5)["pass@1"] == 0.5


def test_metrics_by_dataset_and_flatten():
    records = [
        ("aime", 0, 1.0),
        ("aime", 0, 0.0),
        ("aime", 1, 0.0),
        ("aime", 1, 0.0),
        ("math500", "q7", 1.0),
        ("math500", "q7", 1.0),
    ]
    out = metrics_by_dataset(records, ks=(1, 2))
    assert out["aime"] == {"num_prompts": 2.0, "avg@2": 0.25, "pass@1": 0.25, "pass@2": 0.5}
    assert out["math500"] == {"num_prompts": 1.0, "avg@2": 1.0, "pass@1": 1.0, "pass@2": 1.0}
    assert flatten_metrics(out)["eval/aime/pass@2"] == 0.5


def test_metrics_by_dataset_errors_name_the_dataset():
    with pytest.raises(ValueError, match="dataset 'aime': every prompt needs the same number of samples, got 1..2"):
        metrics_by_dataset([("aime", 0, 1.0), ("aime", 0, 1.0), ("aime", 1, 1.0)])
    with pytest.raises(ValueError, match=r"dataset 'aime': pass@4 needs 1 <= k <= 2"):
        metrics_by_dataset([("aime", 0, 1.0), ("aime", 0, 1.0)], ks=(4,))
    with pytest.raises(TypeError, match="dataset 'aime' prompt 0: score must be a number"):
        metrics_by_dataset([("aime", 0, None)])


def test_accuracy_by_domain():
    from armor_megatron.rewards.metrics import accuracy_by_domain

    records = [("math", 1.0), ("safety", 0.0), ("math", 0.0), ("knowledge", 1.0), ("math", 1.0), ("safety", 1.0)]
    assert accuracy_by_domain(records) == {
        "math": {"num_samples": 3.0, "accuracy": 2 / 3},
        "safety": {"num_samples": 2.0, "accuracy": 0.5},
        "knowledge": {"num_samples": 1.0, "accuracy": 1.0},
    }
    assert accuracy_by_domain([("m", 0.5)], threshold=0.5) == {"m": {"num_samples": 1.0, "accuracy": 1.0}}
    with pytest.raises(TypeError, match="domain 'm': score must be a number, got str"):
        accuracy_by_domain([("m", "1")])
