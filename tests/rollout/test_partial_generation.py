"""The partial generator against the SGLang TEST DOUBLE with decode time: stop at the target, abort, continue."""

import threading
import time

import pytest

from armor_megatron.rollout.anchor.sampler import AnchorResult
from armor_megatron.rollout.engine import Sample, SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.partial import PartialBuffer, Span
from armor_megatron.rollout.partial_generation import (
    GenerationStopped,
    GroupRequest,
    PartialGenerator,
    percentile,
    request_seed,
)
from armor_megatron.rollout.sglang.client import SGLangClient
from armor_megatron.rollout.testing.sglang_test_server import SGLangTestServer
from armor_megatron.rollout.testing.tiny_models import encode
from armor_megatron.trainer.partial_anchors import NONE_FOUND

pytestmark = pytest.mark.timeout(120)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def server(decoding_double):
    return decoding_double


def _generator(server, max_versions=2):
    client = SGLangClient(server.url, request_timeout=60)
    return PartialGenerator(client, GREEDY, PartialBuffer(max_versions=max_versions), over_provision=2.0)


def test_surplus_is_aborted_kept_and_continued_to_the_uninterrupted_responses(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompts = {k: tuple(encode(tok, text)) for k, text in [("a", "1+1="), ("b", "2+2="), ("c", "3+3="), ("d", "4+4=")]}
    lengths = {"a": (2, 3), "b": (3, 2), "c": (28, 28), "d": (28, 26)}  # far apart: a loaded CPU keeps the order
    supply = iter([GroupRequest(k, prompts[k], lengths[k]) for k in "abcd"])
    gen = _generator(server)
    done, metrics = gen.generate(supply, target=2, version="step-0")
    assert sorted(r.key for r, _ in done) == ["a", "b"]  # the short groups; c and d were aborted midway
    assert metrics["partial/surplus_aborted"] == 4 and len(gen.buffer) == 4
    assert metrics["partial/wasted_tokens"] == 0

    state = gen.state_dict()  # a checkpoint here resumes exactly (the same continuations follow)
    server.engine.weight_version = "step-1"  # an update between the steps
    done, metrics = gen.generate(iter(()), target=2, version="step-1")
    assert sorted(r.key for r, _ in done) == ["c", "d"]
    assert metrics["partial/continued"] == 4 and metrics["partial/tokens_carried"] > 0
    assert metrics["partial/versions_spanned_max"] == 2
    for request, members in done:
        for k, m in enumerate(members):
            assert len(m.sample.token_ids) == request.max_new_tokens[k]
            [[whole]] = server.engine.generate([list(request.prompt_ids)], 1, _greedy(request.max_new_tokens[k]))
            assert m.sample.token_ids == whole.token_ids  # continued from token ids = generated in one go
            assert m.spans[0].version == "step-0" and m.spans[-1] == Span(
                "step-1", m.spans[-1].start, len(whole.token_ids)
            )

    resumed = _generator(server)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state
    again, _ = resumed.generate(iter(()), target=2, version="step-1")
    assert [(r, [m.sample.token_ids for m in ms]) for r, ms in sorted(again, key=lambda x: x[0].key)] == [
        (r, [m.sample.token_ids for m in ms]) for r, ms in sorted(done, key=lambda x: x[0].key)
    ]
    gen.close()
    resumed.close()


def _greedy(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def test_dynamic_sampling_filters_groups_as_they_finish_and_refills_at_once(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    p = tuple(encode(tok, "5+5="))
    supply = iter([GroupRequest("flat", p, (2, 2)), GroupRequest("x", p, (3, 3)), GroupRequest("y", p, (4, 4))])
    gen = _generator(server)
    done, metrics = gen.generate(supply, target=1, version="step-0", accept=lambda r, m: r.key != "flat")
    assert [r.key for r, _ in done] == ["x"] and metrics["partial/filtered_groups"] == 1
    gen.close()


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5 and percentile([5.0], 0.99) == 5.0 and percentile([], 0.5) == 0


def test_rule_drop_discards_a_response_at_the_limit_and_its_group_starts_it_over(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    p = tuple(encode(tok, "6+6="))
    client = SGLangClient(server.url, request_timeout=60)
    gen = PartialGenerator(client, GREEDY, PartialBuffer(max_versions=2, on_stale="drop"), over_provision=2.0)
    short = iter([GroupRequest(k, p, (2, 2)) for k in ("a", "b", "c")])
    long = GroupRequest("long", p, (20, 20))
    done, _ = gen.generate(iter([GroupRequest("a", p, (2, 2)), long]), target=1, version="step-0")
    assert [r.key for r, _ in done] == ["a"] and len(gen.buffer) == 2
    server.engine.weight_version = "step-1"
    next(short)
    done, metrics = gen.generate(short, target=1, version="step-1")  # the long responses span 2 versions now
    assert metrics["partial/continued"] == 2 and len(gen.buffer) == 2  # aborted again, with no must_finish
    server.engine.weight_version = "step-2"
    done, metrics = gen.generate(iter(()), target=1, version="step-2")
    assert [r.key for r, _ in done] == ["long"]
    assert metrics["partial/dropped_stale"] == 2 and metrics["partial/wasted_tokens"] > 0
    [[whole]] = server.engine.generate([list(p)], 1, _greedy(20))
    for m in done[0][1]:
        assert m.spans == (Span("step-2", 0, 20),) and m.sample.token_ids == whole.token_ids
    gen.close()


def test_requests_spread_over_servers_and_each_abort_reaches_its_server(server, tiny_ckpt):
    path, _, tok = tiny_ckpt
    p = tuple(encode(tok, "8+8="))
    second = SGLangTestServer(LocalEngine.from_pretrained(path, weight_version="step-0"), seconds_per_token=0.1)
    with second:
        clients = [SGLangClient(s.url, request_timeout=60) for s in (server, second)]
        gen = PartialGenerator(clients, GREEDY, PartialBuffer(), over_provision=2.0)
        supply = iter([GroupRequest("short", p, (2, 2)), GroupRequest("long", p, (20, 20))])
        done, metrics = gen.generate(supply, target=1, version="step-0")
        assert [r.key for r, _ in done] == ["short"] and metrics["partial/surplus_aborted"] == 2
        assert server.requests["/generate"] == second.requests["/generate"] == 2
        assert server.requests["/abort_request"] == second.requests["/abort_request"] == 1
        assert len(gen.buffer) == 2 and gen.buffer.tokens < 40  # cut where decoding was, on both servers
        gen.close()


def test_seeded_requests_continue_a_response_to_the_same_tokens_in_any_run(tiny_ckpt):
    path, _, tok = tiny_ckpt
    p = tuple(encode(tok, "7+7="))
    engine = LocalEngine.from_pretrained(path, weight_version="step-0")
    with SGLangTestServer(engine, deterministic=True, seconds_per_token=0.1) as server:
        sampled = {"temperature": 1.0}

        def generator(seed, state=None):
            gen = PartialGenerator(
                SGLangClient(server.url, request_timeout=60), sampled, PartialBuffer(), 2.0, seed=seed
            )
            if state is not None:
                gen.load_state_dict(state)
            return gen

        gen = generator(seed=7)
        supply = iter([GroupRequest("short", p, (2, 2, 2)), GroupRequest("long", p, (30, 30, 30))])
        first, _ = gen.generate(supply, target=1, version="step-0")
        saved = gen.state_dict()
        assert [r.key for r, _ in first] == ["short"] and len(saved["buffer"]["items"]) == 3
        [(_, continued)] = gen.generate(iter(()), target=1, version="step-0")[0]
        assert len({m.sample.token_ids for m in continued}) == 3  # a seed per response: the group's responses differ
        for seed, same in (
            (7, True),
            (8, False),
        ):  # a resumed generator continues them to the same tokens; the seed decides
            resumed = generator(seed, saved)
            [(_, again)] = resumed.generate(iter(()), target=1, version="step-0")[0]
            assert ([m.sample.token_ids for m in again] == [m.sample.token_ids for m in continued]) is same
            assert ([m.sample.logprobs for m in again] == [m.sample.logprobs for m in continued]) is same
            resumed.close()
        gen.close()
        assert request_seed(7, "long", 0, 1) != request_seed(7, "long", 0, 0) != request_seed(7, "long", 1, 0)


def test_a_stop_aborts_everything_in_flight_and_keeps_every_token(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    p = tuple(encode(tok, "9+9="))
    stop = threading.Event()
    client = SGLangClient(server.url, request_timeout=60)
    gen = PartialGenerator(client, GREEDY, PartialBuffer(max_versions=2), over_provision=2.0, stop=stop.is_set)
    supply = iter([GroupRequest("done", p, (1, 1)), GroupRequest("a", p, (30, 30)), GroupRequest("b", p, (30, 2))])
    threading.Timer(0.8, stop.set).start()  # the short groups are complete by then, the long responses decode
    started = time.monotonic()
    with pytest.raises(GenerationStopped):
        gen.generate(supply, target=3, version="step-0")
    assert time.monotonic() - started < 2.0  # not the 3 s the long responses take
    assert server.decoding() == []
    state = gen.state_dict()
    groups = {g["key"]: g for g in state["groups"]}
    assert sorted(groups) == ["a", "b", "done"]  # the complete group was not handed out: kept
    assert state["calls"] == 0 and {g["started"] for g in groups.values()} == {1}  # the step runs again, as new
    buffered = {p["key"]: p for p in state["buffer"]["items"]}
    assert sorted(buffered) == ["a/0", "a/1", "b/0"] and sorted(groups["b"]["done"]) == ["1"]
    assert all(0 < len(p["token_ids"]) < 30 for p in buffered.values())  # cut where decoding was, kept
    stop.clear()
    done, metrics = gen.generate(iter(()), target=3, version="step-0")  # the next call continues them
    assert sorted(r.key for r, _ in done) == ["a", "b", "done"] and metrics["partial/continued"] == 3
    gen.close()


def test_a_group_whose_anchor_a_reset_made_stale_is_reanchored_or_grown_by_one_response(server, tiny_ckpt):
    """A group in progress holds its anchor's reference; after a reset the caller replaces a stale anchor
    (counted as discarded): by a fresh one, or by none and one more on-policy response, generated in full
    in that step, which the group trains in (its first responses would be too old for the next)."""
    _, _, tok = tiny_ckpt
    p = tuple(encode(tok, "7+7="))
    old = AnchorResult(0, Sample(0, (3, 4), "ab", (-0.5, -0.25), "stop", "ref-0"), 2, 4, reward=1.0)
    supply = iter([GroupRequest("short", p, (2,) * 3, old, "ref-0"), GroupRequest("long", p, (16,) * 3, old, "ref-0")])
    gen = _generator(server)
    done, metrics = gen.generate(supply, target=1, version="step-0")
    assert [r.key for r, _ in done] == ["short"] and done[0][0].anchor == old  # the anchor travels with its group
    assert metrics["partial/anchors_discarded"] == 0  # "long" is in progress: aborted, or complete after the target
    state = gen.state_dict()
    resumed = _generator(server)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state and resumed.stale_anchors("ref-1")[0].anchor == old  # kept exactly
    resumed.close()

    assert gen.stale_anchors("ref-0") == [] and [g.key for g in gen.stale_anchors("ref-1")] == ["long"]
    with pytest.raises(ValueError, match="keeps its 3 responses"):
        gen.reanchor("long", NONE_FOUND, "ref-1", (16, 16))
    gen.reanchor("long", NONE_FOUND, "ref-1", (16, 16, 16, 16))  # none found under ref-1: a 4th response
    server.engine.weight_version = "step-1"
    new = iter([GroupRequest("new", p, (2,) * 4)])
    done, metrics = gen.generate(new, target=1, version="step-1")
    [(request, members)] = done  # "long" started a step ago: due now (max_versions 2), so it takes the one place
    assert gen.groups_in_progress == 1  # before "new", complete first and kept for the next step
    assert (request.anchor, request.reference, len(members)) == (NONE_FOUND, "ref-1", 4)
    assert metrics["partial/anchors_discarded"] == 1
    [[whole]] = server.engine.generate([list(p)], 1, _greedy(16))
    assert [m.sample.token_ids for m in members] == [whole.token_ids] * 4
    assert members[3].spans == (Span("step-1", 0, 16),)  # the new response, generated in this step
    gen.close()


def test_a_due_group_that_the_filter_drops_gives_its_kept_place_to_a_group_complete_meanwhile(server, tiny_ckpt):
    _, _, tok = tiny_ckpt
    p = tuple(encode(tok, "9+9="))
    gen = _generator(server)
    done, _ = gen.generate(iter([GroupRequest("a", p, (2, 2)), GroupRequest("due", p, (16, 16))]), 1, "step-0")
    assert [r.key for r, _ in done] == ["a"] and gen.groups_in_progress == 1
    server.engine.weight_version = "step-1"
    # "b" completes first but the one place is kept for "due" (started a step ago); "due" is filtered
    done, metrics = gen.generate(iter([GroupRequest("b", p, (2, 2))]), 1, "step-1", accept=lambda r, m: r.key != "due")
    assert [r.key for r, _ in done] == ["b"] and metrics["partial/filtered_groups"] == 1
    assert gen.groups_in_progress == 0
    gen.close()
