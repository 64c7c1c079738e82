"""The rollout half of an ARMOR step (Algorithm 1, lines 3–6), on the rank that drives the engines.

For a batch of P prompts:

1. anchors: one verified reference response per prompt (rejection sampling, or the anchor
   cache while the reference is frozen); none when every try failed;
2. on-policy: G−1 samples from π_old per prompt with an anchor, G without (the anchor slot is
   filled by one more on-policy sample);
3. rewards: on-policy samples are scored by their row's verifier; an anchor keeps the reward it
   was verified with when sampled (never scored twice; one below ``anchor_success_reward`` is
   dropped and counted in ``anchor/dropped``), except under a group verifier, which scores the
   whole group, anchor included, in one call. accuracy = that score (the metrics log its mean as
   ``rollout/score`` and the share reaching ``CORRECT_THRESHOLD`` as ``rollout/accuracy``); the training reward adds
   DAPO's overlong shaping to every row, anchors included: an anchor near the length limit is
   penalised like any response of that length (the shaping is part of the reward function
   the whole group is compared under);
4. groups of G (anchor last); DAPO dynamic sampling then filters groups with all-equal accuracy
   (the caller refills from more prompts) and `trainer.advantages` computes the advantages of
   the batch that trains, over each whole group, anchor included.

The result is a ``RolloutBatch`` of P·G rows (prompt-major):

    input_ids      [N, L] int64   prompt + response, right-padded with pad_id
    lengths        [N]    int64   prompt + response tokens
    response_mask  [N, L] fp32    1 at positions t holding a model token of the response (predicted
                                  from < t); 0 at a multi-turn response's environment tokens
    rewards        [N]    fp32    shaped training reward;  accuracy [N] fp32 verifier score
    is_anchor      [N]    bool
    engine_logprobs[N, L] fp32    the engine's log-probs of the response tokens (0 elsewhere)
objects: prompt_index (dataset row), response_text, finish_reason.
A batch of multi-turn responses (``rollout.environment``, `armor_megatron.rollout.multiturn`) also
holds ``prompt_lengths`` [N] int64 and the objects ``trajectory`` (each response's turns); its
lengths, rewards' overlong shaping and ``rollout/response_len`` count the model's tokens only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from armor_megatron.algo import (
    apply_overlong_shaping,
    assemble_anchor_groups,
)
from armor_megatron.data.batch import RolloutBatch
from armor_megatron.data.prompts import PromptRow, row_mapping
from armor_megatron.rewards import load_verifier, score_batch
from armor_megatron.rewards.metrics import CORRECT_THRESHOLD
from armor_megatron.rollout.anchor.cache import AnchorCache
from armor_megatron.rollout.anchor.sampler import AnchorResult
from armor_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams, check_sample
from armor_megatron.rollout.multiturn import MultiTurnRollout, truncation_metrics
from armor_megatron.rollout.partial import Span, versions_spanned
from armor_megatron.trainer.overlap import LaggingBatchError, step_of_version


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """What the rollout phase needs: group size, sampling, advantage estimator and its parameters."""

    group_size: int
    sampling: SamplingParams
    estimator: str = "dapo"  # read by trainer.advantages
    estimator_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    verifier: str = "math"
    anchor_success_reward: float = 1.0  # an anchor's carried reward must reach it (positive anchors only)
    overlong_buffer: int | None = None  # tokens; None disables overlong shaping
    overlong_penalty: float = 1.0
    reward_workers: int | None = None
    timeout: float | None = None
    vocab_size: int | None = None  # the model's: every sample's token ids and log-probs are checked against it
    sample_metrics: Callable[[list[dict[str, Any]]], dict[str, float]] | None = None  # logging.sample_metrics, loaded
    environment: MultiTurnRollout | None = None  # rollout.environment: multi-turn rollouts with tools


@dataclasses.dataclass(frozen=True)
class GroupScores:
    """Some groups' verifier scores, as `_score` makes them, so a caller that scored them first hands them on whole.

    ``scores[p]``: group ``p``'s scores, in order; ``timeouts``: the verifier calls stopped at their
    timeout (scored 0); ``parts``: each breakdown entry a verifier returned beside a score
    (``RewardResult.breakdown``, e.g. math_dapo's ``acc``), its values over the responses carrying it.
    """

    scores: list[list[float]]
    timeouts: int = 0
    parts: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def breakdown(self) -> dict[str, float]:
        """Each breakdown entry's mean over the responses that carry it (``reward/breakdown/<entry>``)."""
        return {key: sum(values) / len(values) for key, values in self.parts.items()}

    @staticmethod
    def merge(groups: Sequence[GroupScores]) -> GroupScores:
        """``groups``' scores in order, their timeouts summed, their breakdown values pooled (one mean over all)."""
        parts: dict[str, list[float]] = {}
        for group in groups:
            for key, values in group.parts.items():
                parts.setdefault(key, []).extend(values)
        return GroupScores(
            [list(scores) for group in groups for scores in group.scores],
            sum(group.timeouts for group in groups),
            parts,
        )


def anchor_truths(rows: Sequence[PromptRow], settings: RolloutSettings) -> list[tuple[Any, ...]]:
    """What an anchor candidate of each row is verified against: ``(verifier, answer, row fields)``.

    So an anchor passes exactly the check its group is scored with
    (`rollout.anchor.build.anchor_reward`); with an environment a fourth item, the row that builds
    π_ref's environments (`data.prompts.row_mapping`).
    """
    truths = [(r.verifier or settings.verifier, r.answer, r.reward_fields()) for r in rows]
    if settings.environment is None:
        return truths
    return [(*truth, row_mapping(r)) for truth, r in zip(truths, rows)]


def generate_responses(
    engine: RolloutEngine,
    prompts: Sequence[Sequence[int]],
    rows: Sequence[PromptRow],
    n: int,
    settings: RolloutSettings,
) -> list[list[Sample]]:
    """``n`` responses per prompt from ``engine``: one request, or the environment loop (multi-turn)."""
    if settings.environment is None:
        return engine.generate(prompts, n=n, sampling=settings.sampling, timeout=settings.timeout)
    return settings.environment.generate(
        engine.generate, prompts, [row_mapping(r) for r in rows], n, settings.sampling, settings.timeout
    )


def collect_groups(
    rows: Sequence[PromptRow],
    encode: Callable[[Any], list[int]],
    engine: RolloutEngine,
    settings: RolloutSettings,
    anchors: AnchorCache | None = None,
    pad_id: int = 0,
    generated: Sequence[Sequence[Sample]] | None = None,
    group_scores: GroupScores | None = None,
    resolved: Sequence[AnchorResult] | None = None,
) -> tuple[RolloutBatch, dict[str, float]]:
    """Sample, verify and group one batch of prompts; returns (batch of P·G rows, metrics).

    ``anchors``: an ``AnchorCache`` (or anything with its ``get(prompt_ids, ground_truths, keys,
    timeout) -> [AnchorResult]``) whose ground truths are ``(verifier, answer)`` pairs, so an
    anchor is accepted by the verifier its row is scored with; None for on-policy groups only.
    ``generated``: the on-policy responses of each row, already sampled (partial rollouts,
    `rollout.partial_generation`): G−1 for a row whose anchor is kept, G otherwise; ``resolved``:
    the anchors of those rows, already looked up (one `AnchorResult` per row, in place of
    ``anchors``); ``group_scores``: their verifier scores, timed-out calls and breakdown when
    already computed (by dynamic sampling's filter: `score_group` per group, `GroupScores.merge`d),
    as `_score` makes them, so the metrics are those of scoring the groups here.
    """
    G = settings.group_size
    prompt_ids = [encode(r.prompt) for r in rows]
    verifiers = [r.verifier or settings.verifier for r in rows]
    if resolved is not None and (anchors is not None or generated is None):
        raise ValueError("collect_groups: resolved anchors come with pre-generated groups, in place of a cache")
    anchor_results = (
        list(resolved)
        if resolved is not None
        else anchors.get(
            prompt_ids, anchor_truths(rows, settings), keys=[r.index for r in rows], timeout=settings.timeout
        )
        if anchors
        else None
    )
    # Anchors were verified once, by the sampler: their rewards travel with them. One below the
    # success reward (a pooled anchor verified under another threshold) is dropped before the
    # on-policy samples are drawn, so its slot gets one more of them; it is never trained on.
    results: list[AnchorResult | None] = list(anchor_results) if anchor_results is not None else [None] * len(rows)
    offered = [a is not None and a.found for a in results]
    kept = [kept_anchor(a, settings) for a in results]
    found = [a is not None for a in kept]
    if generated is not None:
        for p, (group, has_anchor) in enumerate(zip(generated, found)):
            if len(group) != G - has_anchor:
                raise ValueError(
                    f"collect_groups: row {p} has {len(group)} pre-generated responses, "
                    f"{G - has_anchor} expected (group size {G}, {'an' if has_anchor else 'no'} anchor)"
                )
    policy = (
        [list(g) for g in generated]
        if generated is not None
        else _sample_on_policy(engine, prompt_ids, rows, found, G, settings)
    )

    anchor_samples = [None if a is None else a.anchor for a in kept]
    anchor_scores = [None if a is None else a.reward for a in kept]
    texts = [[s.text for s in group] for group in policy]
    trajectories = [[s.trajectory for s in group] for group in policy]  # multi-turn: what the verifier may see
    in_group = [_scores_groups(v) and a is not None for v, a in zip(verifiers, anchor_samples)]
    for p, anchor in enumerate(anchor_samples):  # a group verifier sees the whole group, anchor last
        if in_group[p] and anchor is not None:
            texts[p].append(anchor.text)
            trajectories[p].append(anchor.trajectory)
    verified = (
        group_scores
        if group_scores is not None
        else _score(texts, rows, verifiers, settings.reward_workers, trajectories)
    )
    policy_scores = [list(scores) for scores in verified.scores]  # the caller's lists stay as they are
    for p, scores in enumerate(policy_scores):
        if in_group[p]:  # the anchor's score in its group replaces the one it was accepted with
            anchor_scores[p] = scores.pop()
    groups = assemble_anchor_groups(policy_scores, anchor_scores if anchor_results is not None else None, G)
    samples: list[Sample] = groups.gather(policy, anchor_samples)
    accuracy = groups.rewards
    lengths = torch.tensor([s.model_tokens for s in samples], dtype=torch.float32).view_as(accuracy)
    rewards = accuracy
    if settings.overlong_buffer:
        rewards = apply_overlong_shaping(
            accuracy, lengths, settings.sampling.max_new_tokens, settings.overlong_buffer, settings.overlong_penalty
        )
    prompt_of_row = [rows[src.prompt] for src in groups.rows]
    batch = _to_batch(samples, [prompt_ids[src.prompt] for src in groups.rows], pad_id, settings.vocab_size)
    batch["rewards"] = rewards.reshape(-1).float()
    batch["accuracy"] = accuracy.reshape(-1).float()
    batch["is_anchor"] = groups.is_anchor.reshape(-1)
    batch["prompt_index"] = [r.index for r in prompt_of_row]

    metrics = {
        "rollout/score": accuracy.mean().item(),  # the verifier's mean score, before shaping
        "rollout/accuracy": (accuracy >= CORRECT_THRESHOLD).float().mean().item(),  # share verified correct
        "rollout/reward": rewards.mean().item(),
        "rollout/response_len": lengths.mean().item(),
        "rollout/response_len_min": lengths.min().item(),
        "rollout/response_len_max": lengths.max().item(),
        "rollout/response_len_std": lengths.std(unbiased=False).item(),
        "rollout/reward_min": rewards.min().item(),
        "rollout/reward_max": rewards.max().item(),
        "rollout/reward_std": rewards.std(unbiased=False).item(),
        "rollout/truncated_rate": sum(s.finish_reason == "length" for s in samples) / len(samples),
        "rollout/generated_tokens": float(sum(s.model_tokens for group in policy for s in group)),
        "reward/timeouts": float(verified.timeouts),  # verifier calls stopped at their timeout (scored 0)
        **{f"reward/breakdown/{k}": v for k, v in verified.breakdown.items()},  # the verifiers' own criteria (e.g. acc)
        **truncation_metrics(samples),  # multi-turn: turns, environment tokens, limits hit
    }
    on_policy = accuracy[~groups.is_anchor]  # anchors reach the success reward by construction
    metrics["rollout/on_policy_score"] = on_policy.mean().item()
    metrics["rollout/on_policy_accuracy"] = (on_policy >= CORRECT_THRESHOLD).float().mean().item()
    metrics.update(_accuracy_by_domain(accuracy, groups.is_anchor, verifiers))
    if settings.sample_metrics is not None:
        scored = [
            {
                "prompt": row.prompt,
                "response": s.text,
                "score": float(a),
                "is_anchor": bool(anchor),
                "weight_version": s.weight_version,  # the engine weights that sampled it (an anchor: π_ref's)
                **({} if s.trajectory is None else {"trajectory": s.trajectory}),
            }
            for row, s, a, anchor in zip(prompt_of_row, samples, accuracy.reshape(-1), groups.is_anchor.reshape(-1))
        ]
        metrics.update({f"rollout/{k}": float(v) for k, v in settings.sample_metrics(scored).items()})
    if anchor_results is not None:  # set exactly when there are anchors
        metrics.update(
            {
                "anchor/found_rate": sum(found) / len(found),  # anchors in the groups
                "anchor/dropped": float(sum(offered) - sum(found)),
                "anchor/tries": float(sum(a.tries for a in anchor_results)),
                "anchor/cached_rate": sum(bool(a.cached) for a in anchor_results if a.found) / max(sum(found), 1),
                "anchor/generated_tokens": float(sum(a.generated_tokens for a in anchor_results)),
            }
        )
    return batch, metrics


def replace_stale_anchors(
    batch: RolloutBatch,
    reference_version: str,
    rows_by_index: dict[int, PromptRow],
    encode: Callable[[Any], list[int]],
    engine: RolloutEngine,
    settings: RolloutSettings,
    anchors: AnchorCache,
    pad_id: int = 0,
) -> tuple[RolloutBatch, int]:
    """Resample the anchors of ``batch`` an older reference produced.

    Those another reference than ``reference_version`` produced (a batch generated before a
    reference reset, trained after it); returns (the batch, how many).

    Each stale anchor row gets a fresh anchor of the new reference from ``anchors`` (its rejection
    sampling, as `collect_groups` asks it); a prompt the new reference finds none for gets one more
    on-policy sample from ``engine`` in that row instead, as a group without anchor does. Rewards
    (overlong shaping) are recomputed from the rows' accuracies and lengths; the caller recomputes
    the advantages. Every other row is kept as it was, with its engine log-probs and version; under
    a group verifier the scores of a changed group are all made again, by one call on the group.
    """
    is_anchor = batch["is_anchor"].clone()
    stale = stale_anchor_rows(batch, reference_version)
    if not stale:
        return batch, 0
    prompts, samples = rows_as_samples(batch)
    accuracy = batch["accuracy"].clone()
    rows = [rows_by_index[batch["prompt_index"][i]] for i in stale]
    verifiers = [r.verifier or settings.verifier for r in rows]
    fresh = anchors.get(
        [prompts[i] for i in stale],
        anchor_truths(rows, settings),
        keys=[r.index for r in rows],
        timeout=settings.timeout,
    )
    missing = []
    for j, (i, result) in enumerate(zip(stale, fresh)):
        anchor = result.anchor if result.found else None
        if anchor is not None and result.reward is not None and result.reward >= settings.anchor_success_reward:
            samples[i], accuracy[i] = dataclasses.replace(anchor, prompt_index=i), float(result.reward)
        else:
            missing.append(j)
    if missing:
        extra = generate_responses(
            engine, [prompts[stale[j]] for j in missing], [rows[j] for j in missing], 1, settings
        )
        scores = _score(
            [[g[0].text] for g in extra],
            [rows[j] for j in missing],
            [verifiers[j] for j in missing],
            settings.reward_workers,
            [[g[0].trajectory] for g in extra],
        ).scores
        for j, group, score in zip(missing, extra, scores):
            i = stale[j]
            samples[i], accuracy[i], is_anchor[i] = dataclasses.replace(group[0], prompt_index=i), score[0], False
    G = settings.group_size
    regroup = [(i - i % G, j) for j, i in enumerate(stale) if _scores_groups(verifiers[j])]
    if regroup:  # a group verifier's scores depend on the whole group: score each changed group again
        scores = _score(
            [[samples[k].text for k in range(first, first + G)] for first, _ in regroup],
            [rows[j] for _, j in regroup],
            [verifiers[j] for _, j in regroup],
            settings.reward_workers,
            [[samples[k].trajectory for k in range(first, first + G)] for first, _ in regroup],
        ).scores
        for (first, _), group_scores in zip(regroup, scores):
            accuracy[first : first + G] = torch.tensor(group_scores)
    out = _to_batch(samples, prompts, pad_id, settings.vocab_size)
    lengths = torch.tensor([s.model_tokens for s in samples], dtype=torch.float32)
    rewards = accuracy
    if settings.overlong_buffer:
        rewards = apply_overlong_shaping(
            accuracy, lengths, settings.sampling.max_new_tokens, settings.overlong_buffer, settings.overlong_penalty
        )
    out["rewards"] = rewards.float()
    out["accuracy"] = accuracy.float()
    out["is_anchor"] = is_anchor
    out["prompt_index"] = list(batch["prompt_index"])
    out.meta.update(batch.meta)
    return out, len(stale)


def stale_anchor_rows(batch: RolloutBatch, reference_version: str) -> list[int]:
    """Rows of ``batch`` holding an anchor of another reference than ``reference_version``."""
    anchors = batch["is_anchor"].tolist()
    return [i for i, v in enumerate(batch["weight_version"]) if anchors[i] and v != reference_version]


def rows_as_samples(batch: RolloutBatch) -> tuple[list[list[int]], list[Sample]]:
    """Per row of a rollout batch.

    Its prompt's token ids and its response as a `Sample` (the inverse of `_to_batch`, engine
    log-probs included).
    """
    prompts, samples = [], []
    multi_turn = "prompt_lengths" in batch  # else the response is the mask's tokens, all after the prompt
    n_response = batch["response_mask"].sum(1).long().tolist()
    for i, (length, n) in enumerate(zip(batch["lengths"].tolist(), n_response)):
        start = int(batch["prompt_lengths"][i]) if multi_turn else length - n
        ids = batch["input_ids"][i]
        prompts.append(ids[:start].tolist())
        samples.append(
            Sample(
                prompt_index=i,
                token_ids=tuple(ids[start:length].tolist()),
                text=batch["response_text"][i],
                logprobs=tuple(batch["engine_logprobs"][i, start:length].tolist()),
                finish_reason=batch["finish_reason"][i],
                weight_version=batch["weight_version"][i],
                loss_mask=tuple(batch["response_mask"][i, start:length].long().tolist()) if multi_turn else None,
                trajectory=batch["trajectory"][i] if multi_turn else None,
            )
        )
    return prompts, samples


def _accuracy_by_domain(accuracy: torch.Tensor, is_anchor: torch.Tensor, verifiers: Sequence[str]) -> dict[str, float]:
    """``rollout/accuracy/<verifier>`` and ``rollout/score/<verifier>``.

    Share verified correct (score >= ``CORRECT_THRESHOLD``) and mean score of the on-policy responses
    of the groups each verifier scores (mixed-domain datasets route rows by their ``type``);
    accuracy (the verifier scores) and is_anchor are [P, G].
    """
    out = {}
    for name in dict.fromkeys(verifiers):
        rows = torch.tensor([v == name for v in verifiers])
        on_policy = ~is_anchor[rows]
        if on_policy.any():
            scores = accuracy[rows][on_policy]
            out[f"rollout/accuracy/{name}"] = (scores >= CORRECT_THRESHOLD).float().mean().item()
            out[f"rollout/score/{name}"] = scores.mean().item()
    return out


def kept_anchor(result: AnchorResult | None, settings: RolloutSettings) -> AnchorResult | None:
    """The anchor a group trains with: ``result`` when found with a reward reaching ``anchor_success_reward``, else None.

    A group without one takes G on-policy samples (the anchor slot gets one more).
    """
    if result is None or not result.found or result.reward is None or result.reward < settings.anchor_success_reward:
        return None
    return result


def score_group(
    row: PromptRow, samples: Sequence[Sample], settings: RolloutSettings, anchor: AnchorResult | None = None
) -> GroupScores:
    """One row's on-policy responses scored by its verifier, as `collect_groups` scores them: a group of one.

    ``anchor``: the group's kept anchor (`kept_anchor`); a group verifier sees it last, in the same
    call, its score comes last in the scores and its breakdown counts, as in `collect_groups`.
    """
    verifier = row.verifier or settings.verifier
    texts, trajectories = [s.text for s in samples], [s.trajectory for s in samples]
    if anchor is not None and anchor.anchor is not None and _scores_groups(verifier):
        texts.append(anchor.anchor.text)
        trajectories.append(anchor.anchor.trajectory)
    return _score([texts], [row], [verifier], settings.reward_workers, [trajectories])


def group_accuracy(
    row: PromptRow, scores: Sequence[float], anchor: AnchorResult | None, settings: RolloutSettings
) -> list[float]:
    """The accuracies of a whole group (G), anchor last, from `score_group`'s ``scores`` and its kept ``anchor``.

    The anchor's is its score in the group under a group verifier, else the reward it was verified with.
    """
    if anchor is None or _scores_groups(row.verifier or settings.verifier):
        return list(scores)
    assert anchor.reward is not None  # a kept anchor carries its reward
    return [*scores, anchor.reward]


def check_spans(spans_per_response: Sequence[Sequence[Span]], trainer_step: int, max_versions: int) -> dict[str, float]:
    """Refuse a partial-rollout response generated by too many or too old policy versions.

    Each response's token spans (`rollout.partial.Span`) must come from ``step-k`` weights with
    0 <= trainer_step − k < max_versions (the lag check of each token span, as
    `trainer.overlap.check_lag` checks whole rows), so no response spans more than ``max_versions``.
    Returns ``rollout/versions_spanned_max`` and ``_mean``. Raises `LaggingBatchError` in one line.
    """
    for row, spans in enumerate(spans_per_response):
        versions = list(dict.fromkeys(s.version for s in spans))
        for version in versions:
            k = step_of_version(version)
            if k is None or not 0 <= trainer_step - k < max_versions:
                behind = "from weights of no step" if k is None else f"{trainer_step - k} updates behind"
                raise LaggingBatchError(
                    f"step {trainer_step + 1}'s response {row} holds tokens of weight_version {version!r}, {behind} "
                    f"the trainer's 'step-{trainer_step}'; rollout.partial.max_versions={max_versions}"
                )
    return versions_spanned(spans_per_response)


def _sample_on_policy(
    engine: RolloutEngine,
    prompt_ids: Sequence[Sequence[int]],
    rows: Sequence[PromptRow],
    found: Sequence[bool],
    G: int,
    settings: RolloutSettings,
) -> list[list[Sample]]:
    """G−1 samples for prompts with an anchor and G for the rest (two requests at most)."""
    out: list[list[Sample] | None] = [None] * len(prompt_ids)
    for n in (G - 1, G):
        idx = [i for i, f in enumerate(found) if (n == G - 1) == f]
        if not idx:
            continue
        groups = generate_responses(engine, [prompt_ids[i] for i in idx], [rows[i] for i in idx], n, settings)
        for i, group in zip(idx, groups):
            out[i] = list(group)
    return cast(list[list[Sample]], out)  # every prompt asked for G−1 or G


def _scores_groups(verifier: str) -> bool:
    """Whether ``verifier`` scores one prompt's responses together (a group verifier, docs/rewards.md)."""
    return load_verifier(verifier).plan.scope == "group"


def _score(
    texts: list[list[str]],
    rows: Sequence[PromptRow],
    verifiers: Sequence[str],
    workers: int | None,
    trajectories: Sequence[Sequence[Any]] | None = None,
) -> GroupScores:
    """Per-prompt score lists, scoring all responses of one verifier in one batch; the timed-out calls; the breakdown.

    ``texts[p]``: the responses to ``rows[p]``, scored by ``verifiers[p]`` (a group verifier gets
    them in one call); ``trajectories[p][j]``: response ``j``'s turns (multi-turn; None: single-turn
    responses); an error names the row. The breakdown: each entry a verifier returned beside its
    score (``RewardResult.breakdown``, e.g. math_dapo's ``acc``), its values over the responses that
    carry it (`GroupScores.breakdown`: their mean).
    """
    flat = [(p, j, t) for p, group in enumerate(texts) for j, t in enumerate(group)]
    scores: list[list[float]] = [[] for _ in texts]
    parts: dict[str, list[float]] = {}
    timeouts = 0
    for name in dict.fromkeys(verifiers):
        todo = [(p, j, t) for p, j, t in flat if verifiers[p] == name]
        if not todo:
            continue
        results = score_batch(
            [t for _, _, t in todo],
            [rows[p].answer for p, _, _ in todo],
            verifier=name,
            max_workers=workers,
            labels=[f"row {rows[p].index}" for p, _, _ in todo],
            fields=[rows[p].reward_fields(trajectories[p][j] if trajectories else None) for p, j, _ in todo],
            groups=[p for p, _, _ in todo],
        )
        for (p, _, _), result in zip(todo, results):
            scores[p].append(result.score)
            for key, value in result.breakdown.items():
                parts.setdefault(key, []).append(value)
        # a group or batch call that timed out gives each of its responses the same result: one call
        timeouts += len({id(r) for r in results if r.breakdown.get("timed_out")})
    return GroupScores(scores, timeouts, parts)


def _to_batch(
    samples: Sequence[Sample], prompts: Sequence[Sequence[int]], pad_id: int, vocab_size: int | None = None
) -> RolloutBatch:
    """The rows of a rollout batch, from the samples of any engine.

    This is where every engine's samples enter the trainer, so with ``vocab_size`` each is checked
    first (`rollout.engine.check_sample`: ids in the vocabulary, log-probs <= 0).
    """
    if vocab_size is not None:
        for k, s in enumerate(samples):
            check_sample(s, vocab_size, f"rollout row {k} (prompt {s.prompt_index}, weights {s.weight_version})")
    lengths = [len(p) + s.num_tokens for p, s in zip(prompts, samples)]
    width = max(lengths)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros(n, width, dtype=torch.float32)
    engine_logprobs = torch.zeros(n, width, dtype=torch.float32)
    for i, (p, s) in enumerate(zip(prompts, samples)):
        start, end = len(p), len(p) + s.num_tokens
        input_ids[i, :start] = torch.tensor(p, dtype=torch.long)
        input_ids[i, start:end] = torch.tensor(s.token_ids, dtype=torch.long)
        # the loss mask: environment tokens of a multi-turn response are never trained on
        response_mask[i, start:end] = 1.0 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.logprobs is not None:
            engine_logprobs[i, start:end] = torch.tensor(s.logprobs, dtype=torch.float32)
    batch = RolloutBatch(
        tensors={
            "input_ids": input_ids,
            "lengths": torch.tensor(lengths, dtype=torch.long),
            "response_mask": response_mask,
            "engine_logprobs": engine_logprobs,
        },
        objects={
            "response_text": [s.text for s in samples],
            "finish_reason": [s.finish_reason for s in samples],
            "weight_version": [s.weight_version for s in samples],
        },
    )
    if any(s.trajectory is not None for s in samples):  # multi-turn: where each response starts, its turns
        batch["prompt_lengths"] = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        batch["trajectory"] = [s.trajectory for s in samples]
    return batch
