"""Partial rollouts: continuation from token ids, per-token versions and TIS, staleness, resume, anchors."""

import dataclasses
import io
import json
import math

import pytest
import torch

from armor_megatron.algo.tis import truncated_is_weights
from armor_megatron.rollout.engine import Sample, SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.partial import (
    Finished,
    PartialBuffer,
    PartialResponse,
    PartialStateError,
    Span,
    versions_spanned,
)
from armor_megatron.rollout.testing.tiny_models import encode

from .test_local import teacher_forced_logprobs

N = 12  # tokens of the whole response
K = 5  # tokens generated before the abort


def greedy(max_new_tokens):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def aborted(sample: Sample) -> Sample:
    """``sample`` as an abort returns it: the tokens so far, finish reason abort."""
    return dataclasses.replace(sample, finish_reason="abort")


def continue_with(engine, partial):
    [[more]] = engine.generate([partial.continuation_ids()], 1, greedy(partial.tokens_left))
    return partial.extended(more)


@pytest.fixture
def engine(tiny_ckpt):
    path, _, _ = tiny_ckpt
    return LocalEngine.from_pretrained(path, weight_version="step-0")


def test_continuation_from_token_ids_equals_one_uninterrupted_generation(engine, tiny_ckpt):
    _, _, tok = tiny_ckpt
    prompt = encode(tok, "12+7=")
    [[whole]] = engine.generate([prompt], 1, greedy(N))
    [[first]] = engine.generate([prompt], 1, greedy(K))
    partial = PartialResponse.from_sample(aborted(first), "row-3", "g0", prompt, max_new_tokens=N)
    assert partial.continuation_ids() == prompt + list(first.token_ids) and partial.tokens_left == N - K
    done = continue_with(engine, partial)
    assert isinstance(done, Finished)
    assert done.sample.token_ids == whole.token_ids and done.sample.finish_reason == whole.finish_reason == "length"
    assert done.sample.text == whole.text != first.text  # the verifier scores the whole response's text
    torch.testing.assert_close(torch.tensor(done.sample.logprobs), torch.tensor(whole.logprobs), atol=1e-5, rtol=0)
    assert done.token_versions() == ["step-0"] * N and done.spans == (Span("step-0", 0, N),)


def test_per_token_tis_on_a_response_spanning_two_versions(engine, tiny_ckpt):
    """Tokens 0..K-1 from step-0, K..N-1 from step-1; π_old = step-1. Each token is weighed by its own
    engine log-prob: w_t = min(exp(lp_old,t − lp_engine,t), C), checked against float64 by hand."""
    _, _, tok = tiny_ckpt
    prompt = encode(tok, "what is 3-1?")
    [[first]] = engine.generate([prompt], 1, greedy(K))
    partial = PartialResponse.from_sample(aborted(first), "row-0", "g0", prompt, max_new_tokens=N)
    gen = torch.Generator().manual_seed(0)
    moved = [(name, t + 0.05 * torch.randn(t.shape, generator=gen)) for name, t in engine.model.state_dict().items()]
    engine.update_weights(moved, "step-1")
    done = continue_with(engine, partial)
    assert done.spans == (Span("step-0", 0, K), Span("step-1", K, N))
    assert done.sample.weight_version == "step-1"

    response = list(done.sample.token_ids)
    old = teacher_forced_logprobs(engine.model.double(), prompt, response).tolist()  # π_old = step-1, float64
    eng = list(done.sample.logprobs)
    cap = 2.0
    expected = [min(math.exp(o - e), cap) for o, e in zip(old, eng)]
    weights, metrics = truncated_is_weights(
        torch.tensor([old], dtype=torch.float64),
        torch.tensor([eng], dtype=torch.float64),
        torch.ones(1, N),
        torch.tensor([False]),
        cap=cap,
    )
    torch.testing.assert_close(weights[0].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    # the step-1 span was sampled by π_old itself: weight 1; the step-0 span carries the version gap
    assert all(abs(w - 1) < 1e-4 for w in expected[K:])
    assert max(abs(w - 1) for w in expected[:K]) > 1e-3


def _partial(key, versions, reference=None, logprob=-0.5):
    """A partial response with one token per entry of ``versions`` (consecutive equal versions share a span)."""
    spans, start = [], 0
    for i, v in enumerate(versions + [None]):
        if i and (v != versions[i - 1]):
            spans.append(Span(versions[i - 1], start, i))
            start = i
    n = len(versions)
    return PartialResponse(key, "g-" + key, (1, 2), tuple(range(3, 3 + n)), (logprob,) * n, tuple(spans), 64, reference)


def test_staleness_limit_rule_finish_finishes_at_the_last_allowed_version():
    buf = PartialBuffer(max_versions=2, on_stale="finish")
    buf.add(_partial("a", ["step-0", "step-0"]))
    buf.add(_partial("b", ["step-1"]))
    [a, b] = buf.take("step-1", reference=None)
    assert (a.partial.key, a.must_finish) == ("a", True)  # step-1 is its second and last version
    assert (b.partial.key, b.must_finish) == ("b", False)  # still one version
    assert len(buf) == 0 and buf.counts["continued"] == 2 and buf.counts["tokens_carried"] == 3
    assert buf.counts["surplus_aborted"] == 2 and buf.counts["dropped_stale"] == 0


def test_staleness_limit_rule_drop_discards_and_counts_the_tokens():
    buf = PartialBuffer(max_versions=2, on_stale="drop")
    buf.add(_partial("a", ["step-0", "step-1", "step-1"]))
    buf.add(_partial("b", ["step-2"]))
    [b] = buf.take("step-2", reference=None)
    assert b.partial.key == "b" and not b.must_finish
    assert buf.counts["dropped_stale"] == 1 and buf.counts["dropped_tokens"] == 3


def test_config_of_the_limit_is_checked():
    with pytest.raises(ValueError, match="max_versions must be >= 2"):
        PartialBuffer(max_versions=1)
    with pytest.raises(ValueError, match="on_stale"):
        PartialBuffer(on_stale="wait")


def test_anchors_are_discarded_across_a_reset_and_kept_with_the_same_reference():
    buf = PartialBuffer()
    buf.add(_partial("anchor-old", ["ref-0"], reference="ref-0"))
    buf.add(_partial("anchor-same", ["ref-1"], reference="ref-1"))
    buf.add(_partial("policy", ["step-4"]))
    assert buf.discard_anchors("ref-1") == 1
    buf.add(_partial("anchor-later", ["ref-0"], reference="ref-0"))  # e.g. restored from before the reset
    taken = buf.take("step-5", reference="ref-1")
    assert [c.partial.key for c in taken] == ["anchor-same", "policy"]
    assert not taken[0].must_finish  # π_ref never changes between resets: an anchor spans one version
    assert buf.counts["anchors_discarded"] == 2


def test_resume_with_a_non_empty_buffer_is_bit_exact():
    buf = PartialBuffer(max_versions=3, on_stale="drop")
    odd = [-0.1 - 1e-17, -1 / 3, -math.pi, float("-inf"), -5e-324]
    p = _partial("a", ["step-0", "step-1", "step-1", "step-2", "step-2"])
    buf.add(dataclasses.replace(p, logprobs=tuple(odd)))
    buf.add(_partial("z", ["ref-0"], reference="ref-0"))
    buf.take("step-9", None)  # counters move: the resumed buffer must carry them
    buf.add(dataclasses.replace(p, logprobs=tuple(odd)))
    buf.add(_partial("anchor", ["ref-0"], reference="ref-0"))
    saved = io.BytesIO()
    torch.save(buf.state_dict(), saved)
    saved.seek(0)
    restored = PartialBuffer(max_versions=3, on_stale="drop")
    restored.load_state_dict(torch.load(saved, weights_only=True))
    from_json = PartialBuffer(max_versions=3, on_stale="drop")
    from_json.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    state = buf.state_dict()
    expected = [(c.partial, c.must_finish) for c in buf.take("step-2", "ref-0")]
    assert [c[0].key for c in expected] == ["a", "anchor"] and expected[0][0].logprobs == tuple(odd)
    for other in (restored, from_json):
        assert other.state_dict() == state
        assert [(c.partial, c.must_finish) for c in other.take("step-2", "ref-0")] == expected
        assert other.counts == buf.counts


def test_a_buffer_saved_under_another_rule_is_refused():
    state = PartialBuffer(max_versions=3).state_dict()
    with pytest.raises(PartialStateError, match="max_versions=3"):
        PartialBuffer(max_versions=2).load_state_dict(state)


def test_versions_spanned_metrics():
    spans = [_partial("a", ["step-0", "step-1"]).spans, _partial("b", ["step-1"]).spans, ()]
    assert versions_spanned(spans) == {"rollout/versions_spanned_max": 2.0, "rollout/versions_spanned_mean": 4 / 3}


def test_a_response_saved_without_its_text_is_refused_in_one_line():
    sample = Sample(0, (3, 4), "ab", (-0.5, -0.25), "abort", "step-0")
    state = PartialResponse.from_sample(sample, "g/0", "g", (1, 2), max_new_tokens=8).to_state()
    assert PartialResponse.from_state(state).text == "ab"
    del state["text"]
    with pytest.raises(PartialStateError, match="saved without its text"):
        PartialResponse.from_state(state)
