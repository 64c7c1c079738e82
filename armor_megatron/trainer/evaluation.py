"""Evaluation: sample k responses per prompt, verify them, report avg@k and unbiased pass@k.

Used periodically by the trainer (`evaluate_during_training`) and by ``armor-eval``. Every dataset
row may name its own verifier (``type`` column); otherwise the default verifier scores it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from armor_megatron.config.schema import RunConfig
from armor_megatron.data.prompts import PromptDataset, PromptRow, row_mapping
from armor_megatron.rewards import flatten_metrics, metrics_by_dataset, score_batch
from armor_megatron.rewards.isolated import CallsInterrupted, calls_interrupted
from armor_megatron.rollout.engine import RolloutEngine, Sample, SamplingParams
from armor_megatron.rollout.multiturn import MultiTurnRollout


@dataclasses.dataclass
class EvalSet:
    """One evaluation dataset and its k (samples per prompt)."""

    name: str
    dataset: PromptDataset
    k: int = 1


@dataclasses.dataclass
class EvalResult:
    """Metrics per dataset and one record per scored sample."""

    metrics: dict[str, dict[str, float]]  # {dataset: {"num_prompts", "avg@k", "pass@j", ...}}
    records: list[dict[str, Any]]  # one dict per sample: dataset, index, prompt, answer, response, score, finish_reason


def evaluate(
    engine: RolloutEngine,
    encode: Callable[[object], list[int]],
    eval_sets: Sequence[EvalSet],
    sampling: SamplingParams,
    *,
    verifier: str = "math",
    pass_k: Sequence[int] = (1,),
    reward_workers: int | None = None,
    timeout: float | None = None,
    sample_metrics: Callable[[list[dict[str, Any]]], dict[str, float]] | None = None,
    environment: MultiTurnRollout | None = None,
) -> EvalResult:
    """Evaluate ``engine`` on every set; ``encode(prompt) -> token ids``.

    ``sample_metrics(records)`` adds its ``{name: value}`` to each set's metrics (``logging.sample_metrics``).
    ``environment``: a multi-turn run's environment loop (``rollout.environment``), which the evaluation
    runs as training does; each record then holds its ``trajectory``.
    """
    metrics: dict[str, Any] = {}
    records: list[dict[str, Any]] = []
    for es in eval_sets:
        rows = list(es.dataset.rows)
        prompts = [encode(r.prompt) for r in rows]
        if environment is None:
            groups = engine.generate(prompts, n=es.k, sampling=sampling, timeout=timeout)
        else:
            groups = environment.generate(
                engine.generate, prompts, [row_mapping(r) for r in rows], es.k, sampling, timeout
            )
        texts, answers, verifiers, meta = [], [], [], []
        for row, group in zip(rows, groups):
            for sample in group:
                texts.append(sample.text)
                answers.append(row.answer)
                verifiers.append(row.verifier or verifier)
                meta.append((row, sample))
        labels = [f"{es.dataset.path}: row {row.index}" for row, _ in meta]
        scores = _score_by_verifier(texts, answers, verifiers, reward_workers, labels, meta)
        ks = [k for k in pass_k if k <= es.k]
        metrics.update(metrics_by_dataset([(es.name, row.index, s) for (row, _), s in zip(meta, scores)], ks=ks))
        mine = [
            {
                "dataset": es.name,
                "index": row.index,
                "prompt": row.prompt,
                "answer": row.answer,
                "response": sample.text,
                "score": score,
                "finish_reason": sample.finish_reason,
                **({} if sample.trajectory is None else {"trajectory": sample.trajectory}),
            }
            for (row, sample), score in zip(meta, scores)
        ]
        if sample_metrics is not None:
            metrics[es.name].update({k: float(v) for k, v in sample_metrics(mine).items()})
        records.extend(mine)
    return EvalResult(metrics, records)


def evaluate_during_training(
    engine: RolloutEngine,
    encode: Callable[[object], list[int]],
    eval_sets: Sequence[EvalSet],
    sampling: SamplingParams,
    cfg: RunConfig,
    step: int,
    *,
    sample_metrics: Callable[[list[dict[str, Any]]], dict[str, float]] | None = None,
    environment: MultiTurnRollout | None = None,
) -> dict[str, Any]:
    """The trainer's evaluation of the policy of ``step``: flat ``eval/<set>/<metric>``, and ``eval/mean/pass@1``.

    {} when a preemption signal arrived before it (generating for an evaluation it cannot score is
    waste) or stopped it (the checkpoint matters, this evaluation does not); a line says which.
    """
    if calls_interrupted():
        print(f"[{cfg.name}] evaluation at step {step} skipped: a preemption signal arrived", flush=True)
        return {}
    try:
        result = evaluate(
            engine,
            encode,
            eval_sets,
            sampling,
            verifier=cfg.reward.verifier,
            pass_k=cfg.eval.pass_k,
            sample_metrics=sample_metrics,
            environment=environment,
        )
    except CallsInterrupted:
        print(f"[{cfg.name}] evaluation at step {step} stopped by a preemption signal", flush=True)
        return {}
    metrics = flatten_metrics(result.metrics)
    pass1 = [v["pass@1"] for v in result.metrics.values() if "pass@1" in v]
    if pass1:
        metrics["eval/mean/pass@1"] = sum(pass1) / len(pass1)
    return metrics


def _score_by_verifier(
    texts: Sequence[str],
    answers: Sequence[Any],
    verifiers: Sequence[str],
    workers: int | None,
    labels: Sequence[str],
    meta: Sequence[tuple[PromptRow, Sample]],
) -> list[float]:
    """Scores in input order, batching the responses of each verifier together.

    ``labels`` name the rows in errors; ``meta[i]``, response ``i``'s (PromptRow, Sample), gives its
    fields (the trajectory of a multi-turn response among them) and its group (a group verifier
    scores a prompt's k responses together).
    """
    rows = [row for row, _ in meta]
    scores = [0.0] * len(texts)
    for name in dict.fromkeys(verifiers):
        idx = [i for i, v in enumerate(verifiers) if v == name]
        results = score_batch(
            [texts[i] for i in idx],
            [answers[i] for i in idx],
            verifier=name,
            max_workers=workers,
            labels=[labels[i] for i in idx],
            fields=[rows[i].reward_fields(meta[i][1].trajectory) for i in idx],
            groups=[rows[i].index for i in idx],
        )
        for i, result in zip(idx, results):
            scores[i] = result.score
    return scores


def format_table(metrics: Mapping[str, Mapping[str, float]]) -> str:
    """A plain-text table: one row per dataset, one column per metric."""
    columns = sorted({name for values in metrics.values() for name in values if name != "num_prompts"})
    header = ["dataset", "prompts", *columns]
    rows = [
        [ds, f"{int(v['num_prompts'])}", *(f"{v[c]:.4f}" if c in v else "-" for c in columns)]
        for ds, v in metrics.items()
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def fmt(cells: Sequence[object]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])
