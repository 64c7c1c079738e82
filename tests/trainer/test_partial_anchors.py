"""The anchors of partial rollouts' groups (`trainer.partial_anchors`), against the local reference of
test_rollout_phase: one lookup per step, stale anchors of groups in progress and of queued rows replaced
after a reset, a group none is found for grown by one response, the held lookups saved exactly."""

import pytest

from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorResult
from armor_megatron.rollout.engine import Sample
from armor_megatron.rollout.partial import PartialBuffer
from armor_megatron.rollout.partial_generation import PartialGenerator
from armor_megatron.rollout.sglang.client import SGLangClient
from armor_megatron.rollout.testing.tiny_models import encode
from armor_megatron.trainer.partial_anchors import NONE_FOUND, HeldAnchors, holds_anchors
from armor_megatron.trainer.rollout_phase import RolloutSettings
from tests.trainer.test_rollout_phase import SAMPLING, G, setup, verifiers  # noqa: F401 - its fixtures

OLD = AnchorResult(0, Sample(0, (5,), "x", (-0.5,), "stop", "ref-0"), 1, 1, reward=1.0)


def _group(tok, key, row, max_new_tokens, anchor):
    return {
        "key": f"{row.index}:{key}",
        "prompt_ids": encode(tok, row.prompt),
        "max_new_tokens": list(max_new_tokens),
        "done": {},
        "must_finish": False,
        "anchor": anchor.to_state(),
        "reference": "ref-0",
        "started": 0,
    }


def test_after_a_reset_one_lookup_replaces_the_stale_anchors_and_grows_a_group_none_is_found_for(setup):  # noqa: F811
    tok, _, sampler, rows = setup  # rows 0-2: π_ref solves them; 3-4: nothing does
    settings = RolloutSettings(group_size=G, sampling=SAMPLING, verifier="test_starts_with")
    generator = PartialGenerator(SGLangClient("http://127.0.0.1:1"), {}, PartialBuffer())
    groups = [
        _group(tok, 1, rows[0], (4,) * 3, OLD),
        _group(tok, 2, rows[3], (4,) * 3, OLD),
        _group(tok, 3, rows[1], (4,) * 4, NONE_FOUND),
    ]
    generator.load_state_dict({"buffer": PartialBuffer().state_dict(), "calls": 1, "groups": groups})
    held = HeldAnchors()
    held.held = [("ref-0", OLD)]  # looked up for row 2 before the reset
    cache = AnchorCache(sampler)
    sampler.source.engine.weight_version = "ref-1"  # the reset
    try:
        discarded = held.prepare(
            generator,
            [rows[2], rows[4]],
            lambda g: rows[int(g.key.split(":")[0])],
            cache,
            "ref-1",
            settings,
            lambda p: encode(tok, p),
            4,
        )
    finally:
        sampler.source.engine.weight_version = "ref-0"
    assert cache.stats.lookups == 4  # the two stale groups and the two queued rows, in one call
    assert discarded == 1 and generator.buffer.counts["anchors_discarded"] == 2
    assert generator.stale_anchors("ref-1") == []
    by_row = {g["key"].split(":")[0]: g for g in generator.state_dict()["groups"]}
    assert by_row["0"]["max_new_tokens"] == [4] * 3 and by_row["0"]["anchor"]["anchor"]["weight_version"] == "ref-1"
    assert by_row["3"]["max_new_tokens"] == [4] * 4 and by_row["3"]["anchor"]["anchor"] is None  # grown by one
    assert by_row["1"]["reference"] == "ref-0" and by_row["1"]["max_new_tokens"] == [4] * 4  # no anchor: untouched

    saved = HeldAnchors()
    saved.load_state_dict(held.state_dict())
    assert saved.held == held.held and holds_anchors({"generator": generator.state_dict(), "anchors": []})
    solved, unsolved = held.request("2:4", [1, 2], settings, 4), held.request("4:5", [3], settings, 4)
    assert (solved.reference, solved.anchor.anchor.weight_version, solved.max_new_tokens) == (
        "ref-1",
        "ref-1",
        (4,) * 3,
    )
    assert (unsolved.anchor.found, unsolved.max_new_tokens) == (False, (4,) * 4)
    with pytest.raises(RuntimeError, match="no anchor was looked up for its row"):
        held.request("0:6", [1], settings, 4)
    assert not holds_anchors({"generator": None, "anchors": held.state_dict()})
    generator.close()
