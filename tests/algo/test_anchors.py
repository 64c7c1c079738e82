import pytest
import torch

from armor_megatron.algo.advantages import qae_advantages
from armor_megatron.algo.anchors import RowSource, anchor_zero_advantage_rate, assemble_anchor_groups


def test_assemble_groups_with_and_without_anchor():
    G = 4
    policy = [[0, 1, 0, 1], [0, 0, 0, 1], [1, 1, 1]]
    anchors = [1.0, None, 1.0]  # the verified anchors the sampler found (prompt 1: none within its tries)
    groups = assemble_anchor_groups(policy, anchors, G)
    # prompts 0 and 2: the first G−1 on-policy samples, the anchor last (prompt 2 needs only G−1)
    # prompt 1: no anchor -> G on-policy samples
    assert groups.rewards.tolist() == [[0, 1, 0, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert groups.is_anchor.tolist() == [[False, False, False, True], [False] * 4, [False, False, False, True]]
    assert groups.found == (True, False, True)
    assert groups.rows[:4] == (
        RowSource(0, "policy", 0),
        RowSource(0, "policy", 1),
        RowSource(0, "policy", 2),
        RowSource(0, "anchor", 0),
    )
    texts_policy = [[f"p{p}s{i}" for i in range(len(r))] for p, r in enumerate(policy)]
    texts_anchor = ["p0a", None, "p2a"]
    assert groups.gather(texts_policy, texts_anchor) == [
        "p0s0",
        "p0s1",
        "p0s2",
        "p0a",
        "p1s0",
        "p1s1",
        "p1s2",
        "p1s3",
        "p2s0",
        "p2s1",
        "p2s2",
        "p2a",
    ]
    with pytest.raises(ValueError, match="^gather: prompt 0 has an anchor row but no anchor item$"):
        groups.gather(texts_policy, [None, None, "p2a"])


def test_anchors_disabled_gives_plain_groups():
    groups = assemble_anchor_groups([[0, 1, 1], [1, 1, 0, 5]], None, 3)
    assert groups.rewards.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert not groups.is_anchor.any() and groups.found == (False, False)


def test_missing_on_policy_sample_raises_naming_the_prompt():
    with pytest.raises(ValueError, match="prompt 1: it has no anchor, so group size 4 needs 4"):
        assemble_anchor_groups([[0, 0, 0], [0, 0, 0]], [1.0, None], 4)
    with pytest.raises(ValueError, match="2 prompts"):
        assemble_anchor_groups([[0, 0, 0]], [1.0, None], 4)
    with pytest.raises(ValueError, match="group_size"):
        assemble_anchor_groups([[0]], None, 1)


def test_qae_zero_mask_drops_anchor_on_easy_prompts():
    # easy prompt: on-policy [1, 1, 0] + anchor 1 -> p = 0.75 > 1−K, Q_0.4 = 1: anchor gets A = 0
    # hard prompt: on-policy [0, 0, 0] + anchor 1 -> Q_0.4 = 0: anchor is the only positive sample
    groups = assemble_anchor_groups([[1, 1, 0], [0, 0, 0]], [1.0, 1.0], 4)
    adv = qae_advantages(groups.rewards, k=0.4)
    assert adv[0, -1] == 0 and adv[1, -1] > 0
    torch.testing.assert_close(anchor_zero_advantage_rate(adv, groups.is_anchor), torch.tensor(0.5))
    assert anchor_zero_advantage_rate(adv, torch.zeros_like(groups.is_anchor)) == 0
