"""The update half of an ARMOR step (`docs/design.md` §4.1, steps 5–6), on every rank, on the broadcast batch.

    lp_old = log π_old(y_t | x, y_<t)   the actor before the update, recomputed here
    lp_ref = log π_ref(y_t | x, y_<t)   the reference (when the mixed ratio or a KL term needs it)
    w_t    = min(π_old / π_engine, C)   TIS on on-policy tokens (anchors weigh 1), with algorithm.tis
    V_old, GAE advantages and returns   with a critic (estimator gae)
    then epochs × mini-batches of the actor's mixed-ratio DAPO loss (`megatron.actor`) and the
    critic's clipped value loss, on the same mini-batches

Devices: the trainer holds host tensors only. The Megatron models take host batches, move each
micro-batch to their device, and return results on it; `to_host` brings each result back here,
the one crossing on the trainer's side.
"""

from __future__ import annotations

from typing import Any

import torch

from armor_megatron.algo import explained_variance
from armor_megatron.algo.tis import truncated_is_weights
from armor_megatron.config.schema import RunConfig, needs_reference_logprobs
from armor_megatron.trainer.advantages import gae_targets
from armor_megatron.trainer.collaborators import Actor, Critic, Reference
from armor_megatron.trainer.step_report import StepTimer

TRAIN_KEYS = ("input_ids", "lengths", "response_mask", "advantages", "old_logprobs", "ref_logprobs", "tis_weights")
CRITIC_KEYS = ("input_ids", "lengths", "response_mask", "old_values", "returns")


def update_on_batch(
    batch: dict[str, Any],
    cfg: RunConfig,
    actor: Actor,
    reference: Reference | None,
    critic: Critic | None,
    train_actor: bool,
    timer: StepTimer,
) -> dict[str, Any]:
    """Log-probs (and values) of ``batch``, then the mini-batch / epoch updates; the step's mean metrics.

    Adds ``old_logprobs``, ``ref_logprobs``, ``tis_weights`` (and ``old_values``, ``advantages``,
    ``returns``) to ``batch``. ``train_actor``: False during the critic's warm-up, when only the
    critic trains.
    """
    with timer.phase("logprobs"):
        batch["old_logprobs"] = to_host(actor.compute_logprobs(batch["input_ids"], batch["lengths"]).logprobs)
        if reference is not None and needs_reference_logprobs(cfg):
            ref = reference.compute_logprobs(batch["input_ids"], batch["lengths"])
            batch["ref_logprobs"] = to_host(ref.logprobs)
    metrics: dict[str, Any] = {"rollout/logprob_abs_diff": [engine_trainer_gap(batch)]}
    if "ref_logprobs" in batch and bool(batch["is_anchor"].any()):
        metrics["rollout/anchor_logprob_abs_diff"] = [anchor_reference_gap(batch)]
    if cfg.algorithm.tis.enabled:  # π_old / π_engine on on-policy tokens, truncated; anchors weigh 1
        batch["tis_weights"], tis = truncated_is_weights(
            batch["old_logprobs"],
            batch["engine_logprobs"],
            batch["response_mask"],
            batch["is_anchor"].bool(),
            cap=cfg.algorithm.tis.cap,
        )
        metrics.update({f"train/{k}": [float(v)] for k, v in tis.items()})
    if critic is not None:
        with timer.phase("values"):
            batch["old_values"] = to_host(critic.compute_values(batch["input_ids"], batch["lengths"]))
            batch["advantages"], batch["returns"] = gae_targets(batch, cfg)
        metrics["critic/old_explained_var"] = [
            explained_variance(batch["old_values"], batch["returns"], batch["response_mask"])
        ]
    # mini_batches_per_step near-equal mini-batches, also of a partial batch from dynamic
    # sampling (never more optimizer steps than the LR schedule counts)
    n = len(batch["input_ids"])
    minis = torch.tensor_split(torch.arange(n), min(cfg.train.mini_batches_per_step, n))
    with timer.phase("update"):
        for _ in range(cfg.train.epochs_per_step):
            for rows in minis:
                mini = {k: v[rows] for k, v in batch.items()}
                if train_actor:
                    for k, v in actor.train_step({k: mini[k] for k in TRAIN_KEYS if k in mini}).items():
                        metrics.setdefault(f"train/{k}", []).append(v)
                if critic is not None:
                    for k, v in critic.train_step({k: mini[k] for k in CRITIC_KEYS}).items():
                        metrics.setdefault(f"critic/{k}", []).append(v)
    return {k: sum(v) / len(v) for k, v in metrics.items()}


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A model's result on the host (a no-op for CPU tensors)."""
    return t.detach().cpu()


def engine_trainer_gap(batch: dict[str, Any]) -> float:
    """Mean |lp_engine − lp_old| over on-policy response tokens.

    ~0 when engine and trainer hold the same weights (a weight-sync bug or a precision mismatch
    shows up here first). Anchor rows are left out: the reference engine sampled them. Host tensors.
    """
    mask = batch["response_mask"] * (~batch["is_anchor"].bool()).unsqueeze(1)
    gap = ((batch["engine_logprobs"] - batch["old_logprobs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
    return float(gap)


def anchor_reference_gap(batch: dict[str, Any]) -> float:
    """Mean |lp_engine − lp_ref| over anchor response tokens: ~0 when the anchors' engine sampled π_ref's weights."""
    mask = batch["response_mask"] * batch["is_anchor"].bool().unsqueeze(1)
    gap = ((batch["engine_logprobs"] - batch["ref_logprobs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
    return float(gap)
