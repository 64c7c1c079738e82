import pytest
import torch

from armor_megatron.algo.advantages import qae_advantages
from armor_megatron.algo.anchors import RowSource, anchor_zero_advantage_rate, assemble_anchor_groups, select_anchor


@pytest.mark.parametrize(
    "tries, max_tries, expected",
    [
        ([0, 0, 1, 1], 4, (2, 3)),  # first success is the 3rd try
        ([0, 0, 0, 0, 1], 4, (None, 4)),  # the 5th try is beyond the budget
        ([1], 4, (0, 1)),
        ([], 4, (None, 0)),
        ([0.0, 0.5, 1.0], 2, (None, 2)),  # 0.5 is not verified-correct
    ],
)
def test_select_anchor_rejection_sampling(tries, max_tries, expected):
    assert select_anchor(tries, max_tries) == expected


def test_assemble_groups_with_and_without_anchor():
    G = 4
    policy = [[0, 1, 0, 1], [0, 0, 0, 1], [1, 1, 1]]
    reference = [[0, 1], [0, 0, 0, 0, 1], [1]]
    groups = assemble_anchor_groups(policy, reference, G, max_tries=4)
    # prompt 0: anchor = try 1 (2 tries), first G−1 on-policy samples, anchor last
    # prompt 1: no success within 4 tries -> G on-policy samples, no anchor
    # prompt 2: anchor = try 0 (1 try); only G−1 on-policy samples needed
    assert groups.rewards.tolist() == [[0, 1, 0, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert groups.is_anchor.tolist() == [[False, False, False, True], [False] * 4, [False, False, False, True]]
    assert groups.tries_used == (2, 4, 1) and groups.found == (True, False, True)
    assert groups.rows[:4] == (
        RowSource(0, "policy", 0),
        RowSource(0, "policy", 1),
        RowSource(0, "policy", 2),
        RowSource(0, "reference", 1),
    )
    stats = groups.stats()
    assert stats["anchor_found_rate"] == pytest.approx(2 / 3) and stats["anchor_tries_mean"] == pytest.approx(7 / 3)
    assert stats["anchor_tries_total"] == 7 and stats["num_groups"] == 3

    texts_policy = [[f"p{p}s{i}" for i in range(len(r))] for p, r in enumerate(policy)]
    texts_ref = [[f"p{p}r{i}" for i in range(len(r))] for p, r in enumerate(reference)]
    assert groups.gather(texts_policy, texts_ref) == [
        "p0s0",
        "p0s1",
        "p0s2",
        "p0r1",
        "p1s0",
        "p1s1",
        "p1s2",
        "p1s3",
        "p2s0",
        "p2s1",
        "p2s2",
        "p2r0",
    ]


def test_anchors_disabled_gives_plain_groups():
    groups = assemble_anchor_groups([[0, 1, 1], [1, 1, 0, 5]], None, 3)
    assert groups.rewards.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert not groups.is_anchor.any() and groups.stats()["anchor_found_rate"] == 0


def test_missing_on_policy_sample_raises_naming_the_prompt():
    with pytest.raises(ValueError, match="prompt 1: no anchor was found, so group size 4 needs 4"):
        assemble_anchor_groups([[0, 0, 0], [0, 0, 0]], [[1], [0]], 4)
    with pytest.raises(ValueError, match="2 prompts"):
        assemble_anchor_groups([[0, 0, 0]], [[1], [0]], 4)
    with pytest.raises(ValueError, match="group_size"):
        assemble_anchor_groups([[0]], None, 1)


def test_qae_zero_mask_drops_anchor_on_easy_prompts():
    # easy prompt: on-policy [1, 1, 0] + anchor 1 -> p = 0.75 > 1−K, Q_0.4 = 1: anchor gets A = 0
    # hard prompt: on-policy [0, 0, 0] + anchor 1 -> Q_0.4 = 0: anchor is the only positive sample
    groups = assemble_anchor_groups([[1, 1, 0], [0, 0, 0]], [[1], [0, 1]], 4)
    adv = qae_advantages(groups.rewards, k=0.4)
    assert adv[0, -1] == 0 and adv[1, -1] > 0
    torch.testing.assert_close(anchor_zero_advantage_rate(adv, groups.is_anchor), torch.tensor(0.5))
    assert anchor_zero_advantage_rate(adv, torch.zeros_like(groups.is_anchor)) == 0
