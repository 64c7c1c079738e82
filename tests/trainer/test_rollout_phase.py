"""The rollout half of a step with real local engines: a random policy and a confident reference.

The reference is sharpened (lm_head × 100) so its first response character is near-certain;
a prompt is *solvable* when the ground truth is that character (verifier: the response starts
with the ground truth) and unsolvable when the ground truth is '#', which no response contains.
"""

import dataclasses

import pytest
import torch

from armor_megatron.algo import compute_advantages
from armor_megatron.data.prompts import PromptRow
from armor_megatron.rewards import RewardResult
from armor_megatron.rollout.anchor.build import anchor_reward
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorSampler, AnchorSamplingConfig
from armor_megatron.rollout.anchor.source import SeparateReference
from armor_megatron.rollout.engine import EngineReplyError, SamplingParams
from armor_megatron.rollout.local import LocalEngine
from armor_megatron.rollout.multiturn import EnvironmentSettings, MultiTurnRollout
from armor_megatron.rollout.testing.tiny_models import build_char_tokenizer, encode, tiny_config, tiny_weights
from armor_megatron.trainer.advantages import group_advantages
from armor_megatron.trainer.rollout_phase import (
    GroupScores,
    RolloutSettings,
    _to_batch,
    collect_groups,
    group_accuracy,
    kept_anchor,
    rows_as_samples,
    score_group,
)
from tests.registered_verifiers import registered

SAMPLING = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=3)
G = 4


def _starts_with(response, ground_truth):
    return RewardResult(float(response.startswith(ground_truth)), {})


def _never(response, ground_truth):
    return RewardResult(0.0, {})


SEEN: dict[str, int] = {}


def _starts_with_once(response, ground_truth):
    """Passes a response the first time it is checked, fails it afterwards (a flaky verifier)."""
    SEEN[response] = SEEN.get(response, 0) + 1
    return RewardResult(float(response.startswith(ground_truth) and SEEN[response] == 1), {})


@pytest.fixture(scope="module", autouse=True)
def verifiers():
    with registered(test_starts_with=_starts_with, test_never=_never, test_starts_with_once=_starts_with_once):
        yield


@pytest.fixture(scope="module")
def setup():
    tok = build_char_tokenizer()
    cfg = tiny_config(len(tok))
    policy = LocalEngine(cfg, tiny_weights(cfg, seed=1), tokenizer=tok, weight_version="step-0", seed=2)
    ref = LocalEngine(cfg, tiny_weights(cfg, seed=0, sharpen=100.0), tokenizer=tok, weight_version="ref-0", seed=1)
    rows = []
    for text in ("1+1=", "2+3=", "what", "9*9", "7-2=", "xyz", "abc", "12"):
        with torch.no_grad():
            probs = torch.softmax(ref.model(input_ids=torch.tensor([encode(tok, text)])).logits[0, -1].float(), -1)
        if probs.max() >= 0.85:
            rows.append(PromptRow(len(rows), text, tok.decode([int(probs.argmax())])))
    assert len(rows) >= 3
    rows = rows[:3] + [PromptRow(3, "5+5=", "#"), PromptRow(4, "hi", "#")]
    sampler = AnchorSampler(
        SeparateReference(ref),
        anchor_reward,  # the trainer's: each row's own verifier
        AnchorSamplingConfig(max_tries=4, tries_per_request=2, sampling=SAMPLING),
    )
    return tok, policy, sampler, rows


def _collect(setup, anchors, **kw):
    tok, policy, sampler, rows = setup
    settings = RolloutSettings(group_size=G, sampling=SAMPLING, **{"verifier": "test_starts_with", **kw})
    return collect_groups(rows, lambda p: encode(tok, p), policy, settings, anchors=anchors, pad_id=tok.pad_token_id)


def test_groups_hold_one_verified_anchor_exactly_where_the_reference_solves(setup):
    tok, _, sampler, rows = setup
    batch, metrics = _collect(setup, AnchorCache(sampler))
    assert len(batch) == len(rows) * G
    is_anchor = batch["is_anchor"].view(len(rows), G)
    assert is_anchor[:, :-1].sum() == 0  # anchors sit last
    assert is_anchor[:, -1].tolist() == [True, True, True, False, False]
    assert batch["accuracy"].view(len(rows), G)[:3, -1].tolist() == [1.0, 1.0, 1.0]
    assert metrics["anchor/found_rate"] == pytest.approx(3 / 5)
    assert batch["prompt_index"] == [r.index for r in rows for _ in range(G)]
    # every row: prompt tokens, then its response tokens marked by the mask
    for i in range(len(batch)):
        prompt = encode(tok, rows[i // G].prompt)
        n_resp = int(batch["response_mask"][i].sum())
        assert batch["lengths"][i] == len(prompt) + n_resp == len(prompt) + 4
        assert batch["input_ids"][i, : len(prompt)].tolist() == prompt
        response = batch["input_ids"][i, len(prompt) : len(prompt) + n_resp].tolist()
        assert tok.decode(response, skip_special_tokens=True) == batch["response_text"][i]
        assert (batch["engine_logprobs"][i] != 0).sum() == n_resp
    assert "advantages" not in batch.tensors  # computed once per step, over the batch that trains


def test_advantages_normalise_each_whole_group_anchor_included(setup):
    _, _, sampler, rows = setup
    batch, _ = _collect(setup, AnchorCache(sampler))
    settings = RolloutSettings(group_size=G, sampling=SAMPLING, verifier="test_starts_with")
    batch, metrics = group_advantages(batch, settings)
    expected = compute_advantages("dapo", rewards=batch["rewards"].view(len(rows), G)).reshape(-1)
    assert torch.equal(batch["advantages"], expected)
    assert "anchor/zero_advantage_rate" in metrics


def test_an_anchor_must_pass_its_own_rows_verifier(setup):
    """A row scored by another verifier than the run's default gets no anchor that verifier rejects."""
    tok, policy, sampler, rows = setup
    rows = [dataclasses.replace(rows[0], verifier="test_never"), *rows[1:]]
    batch, metrics = _collect((tok, policy, sampler, rows), AnchorCache(sampler))
    assert batch["is_anchor"].view(len(rows), G)[:, -1].tolist() == [False, True, True, False, False]
    assert metrics["anchor/found_rate"] == pytest.approx(2 / 5)
    assert batch["accuracy"].view(len(rows), G)[0].tolist() == [0.0] * G


def test_without_anchors_every_group_is_on_policy_and_overlong_shaping_applies(setup):
    batch, metrics = _collect(setup, None, overlong_buffer=2)
    assert len(batch) == 5 * G and not batch["is_anchor"].any() and "anchor/found_rate" not in metrics
    assert set(batch["weight_version"]) == {"step-0"}
    # every response is 4 tokens (ignore_eos) against max 4 with a buffer of 2: penalty (4 - 2) / 2 = 1
    assert torch.equal(batch["rewards"], batch["accuracy"] - 1.0)
    assert metrics["rollout/truncated_rate"] == 1.0


def test_gae_leaves_advantages_to_the_trainers_critic(setup):
    _, _, sampler, rows = setup
    batch, _ = _collect(setup, AnchorCache(sampler), estimator="gae")
    settings = RolloutSettings(group_size=G, sampling=SAMPLING, verifier="test_starts_with", estimator="gae")
    batch, metrics = group_advantages(batch, settings)
    assert torch.equal(batch["advantages"], torch.zeros(len(rows) * G))  # per-token ones come from the critic
    assert batch["rewards"].abs().sum() > 0 and "anchor/zero_advantage_rate" not in metrics


@pytest.mark.parametrize("estimator", ["reinforce++", "dapo"])
def test_advantages_see_only_the_groups_that_train(setup, estimator):
    """Dynamic sampling keeps some groups of several rounds: batch-normalised estimators must see
    exactly those; group-local ones come out the same as over the whole round."""
    batch, _ = _collect(setup, AnchorCache(setup[2]), estimator=estimator)
    settings = RolloutSettings(group_size=G, sampling=SAMPLING, verifier="test_starts_with", estimator=estimator)
    whole_round = group_advantages(batch.slice(0, len(batch)), settings)[0]["advantages"][: 2 * G].clone()
    kept = group_advantages(batch.slice(0, 2 * G), settings)[0]["advantages"]  # two groups survive
    assert torch.equal(kept, compute_advantages(estimator, rewards=batch["rewards"][: 2 * G].view(2, G)).reshape(-1))
    assert torch.equal(kept, whole_round) == (estimator == "dapo")


def test_an_anchor_is_verified_once_and_trained_with_that_reward(setup):
    """A re-check would fail it (the verifier passes a text only once): the group still holds the
    anchor, with the reward it was verified with (a re-score would make it a negative anchor)."""
    tok, policy, sampler, rows = setup
    rows = [dataclasses.replace(r, verifier="test_starts_with_once") for r in rows]
    SEEN.clear()
    batch, metrics = _collect((tok, policy, sampler, rows), AnchorCache(sampler))
    anchors = batch["is_anchor"]
    assert anchors.view(len(rows), G)[:3, -1].all()
    assert batch["accuracy"][anchors].tolist() == [1.0] * int(anchors.sum())
    assert metrics["anchor/dropped"] == 0.0


def test_an_anchor_below_the_success_reward_is_dropped_not_trained_on(setup):
    """A pooled anchor verified under a lower threshold (reward 0.5) meets a run that asks for 1."""
    tok, policy, sampler, rows = setup
    cache = AnchorCache(sampler)
    cache.load_state_dict(
        {
            "version": "ref-0",
            "pools": [[rows[0].index, [[dataclasses.asdict(_a_sample(tok, rows[0])), 0, 0.5]]]],
            "failures": [],
            "stats": {"lookups": 0, "hits": 0, "skipped": 0, "invalidations": 0},
            "rng": list(__import__("random").Random(0).getstate()),
        }
    )
    batch, metrics = _collect((tok, policy, sampler, rows[:1]), cache)
    assert not batch["is_anchor"].any() and metrics["anchor/dropped"] == 1.0
    assert metrics["anchor/found_rate"] == 0.0  # served by the cache, refused for the group


def _a_sample(tok, row):
    from armor_megatron.rollout.engine import Sample

    ids = tuple(encode(tok, row.answer + "xyz"))
    return Sample(0, ids, tok.decode(list(ids)), None, "length", "ref-0")


def test_overlong_shaping_applies_to_anchors_too(setup):
    _, _, sampler, rows = setup
    batch, _ = _collect(setup, AnchorCache(sampler), overlong_buffer=2)
    anchors = batch["is_anchor"]
    assert anchors.any()
    # every response, anchors included, is 4 tokens against a max of 4 with a buffer of 2: penalty 1
    assert torch.equal(batch["rewards"][anchors], batch["accuracy"][anchors] - 1.0)


def test_length_and_reward_spread_metrics(setup):
    batch, metrics = _collect(setup, None, overlong_buffer=2)
    lengths = batch["response_mask"].sum(1)
    assert metrics["rollout/response_len_min"] == lengths.min().item() == 4.0
    assert metrics["rollout/response_len_max"] == lengths.max().item()
    assert metrics["rollout/response_len_std"] == pytest.approx(lengths.std(unbiased=False).item())
    assert metrics["rollout/reward_min"] == batch["rewards"].min().item()
    assert metrics["rollout/reward_max"] == batch["rewards"].max().item()
    assert metrics["rollout/reward_std"] == pytest.approx(batch["rewards"].std(unbiased=False).item())


def test_accuracy_per_domain_covers_the_on_policy_rows_of_each_verifier(setup, verifiers):
    tok, policy, sampler, rows = setup
    rows = [dataclasses.replace(r, verifier="test_never") if i % 2 else r for i, r in enumerate(rows)]
    batch, metrics = _collect((tok, policy, sampler, rows), AnchorCache(sampler))
    assert metrics["rollout/accuracy/test_never"] == 0.0
    on_policy = ~batch["is_anchor"].view(len(rows), G)
    acc = batch["accuracy"].view(len(rows), G)
    default = [i for i in range(len(rows)) if i % 2 == 0]
    expected = acc[default][on_policy[default]].mean().item()
    assert metrics["rollout/accuracy/test_starts_with"] == pytest.approx(expected)


def _half_credit(response, ground_truth):
    """1 for a response starting with the truth, 0.5 (a format bonus) for any other non-empty one."""
    return RewardResult(1.0 if response.startswith(ground_truth) else 0.5 * bool(response), {})


def test_mean_score_and_accuracy_are_logged_apart_under_partial_credit(setup):
    """rollout/score* are mean scores; rollout/accuracy* the share scoring >= 1 (correct)."""
    _, _, sampler, rows = setup
    with registered(test_half_credit=_half_credit):
        batch, metrics = _collect(setup, AnchorCache(sampler), verifier="test_half_credit")
    scores = batch["accuracy"]
    on_policy = scores[~batch["is_anchor"]]
    assert set(scores.tolist()) == {0.5, 1.0}  # the anchors are correct, the random policy's responses not
    assert metrics["rollout/score"] == pytest.approx(scores.mean().item())
    assert metrics["rollout/accuracy"] == pytest.approx((scores >= 1).float().mean().item())
    assert metrics["rollout/on_policy_score"] == pytest.approx(on_policy.mean().item()) == 0.5
    assert metrics["rollout/on_policy_accuracy"] == metrics["rollout/accuracy/test_half_credit"] == 0.0
    assert metrics["rollout/score/test_half_credit"] == pytest.approx(0.5)
    assert metrics["rollout/accuracy"] < metrics["rollout/score"]


def _dapo_style(response, ground_truth):
    """Shaped as verl's math_dapo returns: a dict with its score, a bool ``acc`` and the text it read
    (``pred``); "correct" here is a first character of even code, which the random policy meets about half the time."""
    correct = bool(response) and ord(response[0]) % 2 == 0
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": response[:1]}


def test_the_verifiers_breakdown_reaches_the_metrics_log_as_its_mean(setup, tmp_path):
    """Each numeric entry a verifier returns beside its score (math_dapo's ``acc``) is logged as
    ``reward/breakdown/<entry>``: its mean over the scored responses; text entries are not metrics."""
    from armor_megatron.trainer.metrics_log import MetricsLogger, read_metrics

    with registered(test_dapo_style=_dapo_style):
        batch, metrics = _collect(setup, None, verifier="test_dapo_style")
    expected = (batch["accuracy"] == 1.0).float().mean().item()  # no anchors: every response was scored
    assert 0 < expected < 1 and metrics["reward/breakdown/acc"] == pytest.approx(expected)
    assert not any(k.startswith("reward/breakdown/pred") for k in metrics)
    log = MetricsLogger(str(tmp_path))
    log.log(1, metrics)
    log.close()
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0]["reward/breakdown/acc"] == pytest.approx(expected)


def test_sample_metrics_hook_sees_every_scored_sample_with_its_anchor_flag(setup):
    """``logging.sample_metrics`` gets each sample's prompt, response, score and anchor flag; its
    values come back as ``rollout/<name>``."""
    tok, policy, sampler, rows = setup
    seen = []

    def hook(samples):
        seen.extend(samples)
        return {"anchors": sum(s["is_anchor"] for s in samples), "correct": sum(s["score"] for s in samples)}

    batch, metrics = _collect(setup, AnchorCache(sampler), sample_metrics=hook)
    assert len(seen) == len(rows) * G
    assert [s["is_anchor"] for s in seen] == batch["is_anchor"].tolist()
    assert [s["score"] for s in seen] == batch["accuracy"].tolist()
    assert [s["prompt"] for s in seen[::G]] == [r.prompt for r in rows]
    assert metrics["rollout/anchors"] == float(batch["is_anchor"].sum()) > 0
    assert metrics["rollout/correct"] == float(batch["accuracy"].sum())


def test_samples_enter_the_trainer_checked_whichever_engine_made_them(setup):
    # the local engine samples from a model whose vocabulary is larger than the trainer's (here 4 ids):
    # the batch refuses its ids in one line, instead of an IndexError deep in the log-prob code
    tok, policy, _, rows = setup
    with pytest.raises(EngineReplyError, match=r"rollout row \d+ \(prompt \d+, weights step-0\): token id \d+ at"):
        _collect(setup, None, vocab_size=4)
    batch, _ = _collect(setup, None, vocab_size=len(tok))  # the model's own vocabulary: every id fits
    assert int(batch["input_ids"].max()) < len(tok)


def test_a_nan_score_names_the_verifier_and_the_row(setup):
    with registered(test_nan=lambda response, ground_truth: float("nan")):
        with pytest.raises(ValueError, match=r"^row 0: verifier 'test_nan' returned nan: RewardResult.score must be"):
            _collect(setup, None, verifier="test_nan")


GROUP_CALLS: list[tuple[int, tuple[str, ...], str]] = []


def _first_solver(responses, ground_truth, prompt):
    """A group verifier: a response starting with the truth scores 1 alone, 0.75 in a group of several; else 0."""
    GROUP_CALLS.append((len(responses), tuple(responses), prompt))
    return [(1.0 if len(responses) == 1 else 0.75) * r.startswith(ground_truth) for r in responses]


def test_a_group_verifier_scores_each_whole_group_anchor_included(setup):
    _, _, sampler, rows = setup
    with registered(test_first_solver=_first_solver):
        GROUP_CALLS.clear()
        batch, _ = _collect(setup, AnchorCache(sampler), verifier="test_first_solver")
    is_anchor = batch["is_anchor"].view(len(rows), G)
    texts = batch["response_text"]
    in_groups = GROUP_CALLS[-len(rows) :]
    assert all(n == 1 for n, _, _ in GROUP_CALLS[: -len(rows)])  # anchor candidates were judged alone
    assert all(n == G for n, _, _ in in_groups)  # then one call per prompt, on all G
    assert [prompt for _, _, prompt in in_groups] == [r.prompt for r in rows]  # with its row's prompt
    for p, (_, responses, _) in enumerate(in_groups):
        assert list(responses) == texts[p * G : (p + 1) * G]  # anchor (last) included, in the batch's order
    assert is_anchor[:, -1].tolist() == [True, True, True, False, False]
    accuracy = batch["accuracy"].view(len(rows), G)
    for p in range(len(rows)):  # every row trains with its score in the group, the anchor's included
        assert accuracy[p].tolist() == _first_solver(texts[p * G : (p + 1) * G], rows[p].answer, rows[p].prompt)
    assert accuracy[:3, -1].tolist() == [0.75] * 3  # accepted alone (1); trains with its score in the group


class RecordedLookups:
    """An anchor cache whose lookups are kept, so a second assembly can be handed the same anchors."""

    def __init__(self, cache):
        self.cache, self.results = cache, []

    def get(self, *args, **kwargs):
        self.results = self.cache.get(*args, **kwargs)
        return self.results


def _first_solver_dapo(responses, ground_truth, prompt):
    """A group verifier shaped as math_dapo: `_first_solver`'s scores, with ``acc`` (scored above 0) beside them."""
    return [
        {"score": s, "acc": s > 0, "pred": r[:1]}
        for s, r in zip(_first_solver(responses, ground_truth, prompt), responses)
    ]


@pytest.mark.parametrize(
    ("verifier", "prescored"),
    [("test_starts_with", False), ("test_first_solver_dapo", True)],
    ids=["scored_here", "group_verifier_with_breakdown_scored_by_the_filter"],
)
def test_pre_generated_groups_with_their_anchors_assemble_exactly_as_sampled_ones(setup, verifier, prescored):
    """The partial-rollout path (on-policy responses generated earlier, anchors looked up when each group
    started, scores from dynamic sampling's filter or not) builds the same batch and metrics as
    `collect_groups` sampling the same responses and anchors itself: the verifier's breakdown included,
    its mean over the same responses (under a group verifier, the anchors' too)."""
    tok, policy, sampler, rows = setup
    with registered(test_first_solver_dapo=_first_solver_dapo):
        settings = RolloutSettings(group_size=G, sampling=SAMPLING, verifier=verifier)
        lookups = RecordedLookups(AnchorCache(sampler))
        expected, expected_metrics = _collect(setup, lookups, verifier=verifier)
        _, samples = rows_as_samples(expected)
        anchor = expected["is_anchor"].tolist()
        generated = [[samples[i] for i in range(p * G, (p + 1) * G) if not anchor[i]] for p in range(len(rows))]
        kept = [kept_anchor(a, settings) for a in lookups.results]
        assert [len(g) for g in generated] == [G - (a is not None) for a in kept] == [G - 1] * 3 + [G] * 2
        scored = [score_group(r, g, settings, a) for r, g, a in zip(rows, generated, kept)]
        batch, metrics = collect_groups(
            rows,
            lambda p: encode(tok, p),
            policy,
            settings,
            pad_id=tok.pad_token_id,
            generated=generated,
            resolved=lookups.results,
            group_scores=GroupScores.merge(scored) if prescored else None,
        )
        accuracy = [group_accuracy(r, s.scores[0], a, settings) for r, s, a in zip(rows, scored, kept)]
    assert batch["accuracy"].view(len(rows), G).tolist() == accuracy  # what dynamic sampling's filter judged
    assert batch.tensors.keys() == expected.tensors.keys()
    for name, tensor in expected.tensors.items():
        assert torch.equal(batch[name], tensor), name
    assert batch.objects == expected.objects and metrics == expected_metrics
    if prescored:  # the filter's breakdown, each group's values pooled: one mean over the batch, anchors included
        assert 0 < metrics["reward/breakdown/acc"] < 1
    with pytest.raises(ValueError, match="row 0 has 4 pre-generated responses, 3 expected"):
        collect_groups(
            rows,
            lambda p: encode(tok, p),
            policy,
            settings,
            generated=[[*generated[0], samples[0]], *generated[1:]],
            resolved=lookups.results,
        )


class OneToolCall:
    """Answers the first model turn with " ok", ends the episode at the second."""

    def __init__(self, row):
        self.row, self.turns = row, 0

    def step(self, response):
        self.turns += 1
        return " ok" if self.turns == 1 else None


def _multi_turn(setup, verifier, **settings):
    """Rollout settings with the OneToolCall environment (8 model tokens at most, 2 a turn), and an
    anchor cache whose π_ref runs the same environment loop."""
    tok, _, sampler, _ = setup
    env = MultiTurnRollout(
        EnvironmentSettings(spec="tests:OneToolCall", max_turn_tokens=2), lambda t: encode(tok, t), OneToolCall
    )
    sampling = dataclasses.replace(SAMPLING, max_new_tokens=8)
    multi_sampler = AnchorSampler(
        sampler.source, anchor_reward, dataclasses.replace(sampler.config, sampling=sampling), env.anchor_rollout
    )
    rollout = RolloutSettings(group_size=G, sampling=sampling, verifier=verifier, environment=env, **settings)
    return rollout, AnchorCache(multi_sampler)


def test_multi_turn_groups_mask_environment_tokens_and_count_model_tokens(setup):
    tok, policy, _, rows = setup
    settings, anchors = _multi_turn(setup, "test_starts_with", overlong_buffer=4)
    batch, metrics = collect_groups(
        rows, lambda p: encode(tok, p), policy, settings, anchors=anchors, pad_id=tok.pad_token_id
    )
    obs = encode(tok, " ok")
    assert batch["is_anchor"].any()  # π_ref ran the same loop, and its whole trajectory verified
    for i in range(len(batch)):
        start, length = int(batch["prompt_lengths"][i]), int(batch["lengths"][i])
        assert length - start == 2 + len(obs) + 2  # turn, observation, turn
        assert batch["response_mask"][i, start:length].tolist() == [1, 1, 0, 0, 0, 1, 1]
        assert batch["input_ids"][i, start + 2 : start + 5].tolist() == obs
        assert batch["engine_logprobs"][i, start + 2 : start + 5].tolist() == [0.0] * 3
        assert [t["observation"] for t in batch["trajectory"][i]] == [" ok", None]
        assert batch["response_text"][i] == "".join(t["response"] for t in batch["trajectory"][i])
    # 4 model tokens: inside max_new_tokens 8 − buffer 4, unshaped (the 7 tokens with the observation would not be)
    assert torch.equal(batch["rewards"], batch["accuracy"])
    assert metrics["rollout/response_len"] == 4.0 and metrics["rollout/env_tokens"] == 3.0
    assert metrics["rollout/turns"] == 2.0 and metrics["rollout/env_truncated/max_turns"] == 0.0
    # a pending batch's rows come back as the samples they were (the stale-anchor resampling reads them)
    prompts, samples = rows_as_samples(batch)
    again = _to_batch(samples, prompts, tok.pad_token_id)
    for key in ("input_ids", "response_mask", "engine_logprobs", "prompt_lengths"):
        assert torch.equal(again[key], batch[key]), key
    assert again["trajectory"] == batch["trajectory"]


TRAJECTORIES: list = []


def _used_the_tool(response, ground_truth, trajectory):
    """A verifier reading the trajectory: 1 when the first turn's observation came back."""
    TRAJECTORIES.append(trajectory)
    return float(trajectory is not None and trajectory[0]["observation"] == " ok")


def test_a_verifier_naming_trajectory_sees_each_multi_turn_response_and_anchor_candidate(setup):
    tok, policy, _, rows = setup
    settings, anchors = _multi_turn(setup, "test_used_the_tool")
    with registered(test_used_the_tool=_used_the_tool):
        TRAJECTORIES.clear()
        batch, _ = collect_groups(
            rows, lambda p: encode(tok, p), policy, settings, anchors=anchors, pad_id=tok.pad_token_id
        )
    assert TRAJECTORIES and all(t is not None for t in TRAJECTORIES)  # anchor candidates' too
    assert bool(batch["is_anchor"].any())  # candidates the verifier accepted on their trajectories
    assert batch["accuracy"].tolist() == [1.0] * len(batch)


def test_check_spans_refuses_responses_past_the_staleness_limit_in_one_line():
    from armor_megatron.rollout.partial import Span
    from armor_megatron.trainer.overlap import LaggingBatchError
    from armor_megatron.trainer.rollout_phase import check_spans

    two = [Span("step-1", 0, 3), Span("step-2", 3, 5)]
    one = [Span("step-2", 0, 4)]
    assert check_spans([two, one], trainer_step=2, max_versions=2) == {
        "rollout/versions_spanned_max": 2.0,
        "rollout/versions_spanned_mean": 1.5,
    }
    with pytest.raises(LaggingBatchError, match=r"^step 3's response 0 holds tokens of weight_version 'step-1', 1 upd"):
        check_spans([two], trainer_step=2, max_versions=1)
    three = [Span("step-1", 0, 1), Span("step-2", 1, 2), Span("step-3", 2, 3)]
    assert check_spans([three], trainer_step=3, max_versions=3)["rollout/versions_spanned_max"] == 3.0
    with pytest.raises(LaggingBatchError, match="'step-1', 2 updates behind .*; rollout.partial.max_versions=2$"):
        check_spans([three], trainer_step=3, max_versions=2)  # three versions: the oldest is too old
    with pytest.raises(LaggingBatchError, match="weight_version 'start', from weights of no step"):
        check_spans([[Span("start", 0, 2)]], trainer_step=0, max_versions=2)


def _timed_out_group(responses, ground_truth):
    """A group verifier whose call timed out: what the worker pool answers, one result for the whole call."""
    return RewardResult(0.0, {"timed_out": 1.0})


def test_a_timed_out_group_call_counts_one_timeout_not_one_per_response(setup):
    from armor_megatron.trainer.rollout_phase import _score

    _, _, _, rows = setup
    with registered(test_timed_out_group=_timed_out_group):
        scored = _score([["a", "b", "c"], ["d", "e"]], rows[:2], ["test_timed_out_group"] * 2, None)
    assert scored.scores == [[0.0, 0.0, 0.0], [0.0, 0.0]] and scored.timeouts == 2


def test_merged_group_scores_pool_the_breakdown_over_responses_not_groups():
    one = GroupScores([[1.0, 0.0]], timeouts=1, parts={"acc": [1.0, 0.0], "timed_out": [0.0, 1.0]})
    other = GroupScores([[1.0]], parts={"acc": [1.0]})
    merged = GroupScores.merge([one, other])
    assert merged.scores == [[1.0, 0.0], [1.0]] and merged.timeouts == 1
    assert merged.breakdown == {"acc": pytest.approx(2 / 3), "timed_out": 0.5}  # each entry over its carriers
    merged.scores[0].append(9.0)
    assert one.scores == [[1.0, 0.0]]  # the groups' own lists are not shared
